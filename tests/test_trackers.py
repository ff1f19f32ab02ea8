"""--tracker tensorboard / wandb through the real CLI, read back with each tool's own reader, and the batch-log lines.

One killed-and-resumed run (module fixture) is shared by the assertions: SIGKILL at row 7 after a checkpoint at step
4 (steps 5-7 are lost work, redone by the resume), then a resume to step 12. The loss CSV (whose own guarantee
test_resume_and_interrupt / test_faults cover) is the reference: every tracker must hold every step exactly once, with
the CSV's values.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, kill_run_at_row, env_for_tests, loss_rows, run_train

sys.path.insert(0, str(ROOT))
import trackers  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS, SAVE_EVERY, KILL_AT = 12, 4, 7


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, corpus):
    """(run directory, stdout of the resumed incarnation)."""
    ckpt = tmp_path_factory.mktemp("trackers")
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(ckpt), "--log-loss-to-csv",
                   "--training-steps", str(STEPS), "--checkpoint-frequency", str(SAVE_EVERY), "--eval-windows", "8",
                   "--logging-frequency", "2"]
    run = ckpt / "default"
    # the first incarnation: the flag repeated; the requeued one: comma-separated (both spellings are accepted)
    kill_run_at_row([PY, str(ROOT / "train.py"), *base, "--tracker", "tensorboard", "--tracker", "wandb"],
                    run / "loss.csv", KILL_AT, env=env_for_tests({"WANDB_MODE": ""}))
    resumed = run_train(base + ["--tracker", "tensorboard,wandb", "--resume-from-checkpoint", "latest"],
                        env={"WANDB_MODE": ""}, check=True)
    return run, resumed.stdout


def _csv(run: Path) -> dict[int, tuple[float, float]]:
    rows = loss_rows(run / "loss.csv")
    assert [int(r[0]) for r in rows] == list(range(1, STEPS + 1))
    return {int(step): (float(loss), float(lr)) for step, loss, lr, _ in rows}


def test_tensorboard_has_every_step_once_after_kill_and_resume(killed_and_resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = killed_and_resumed
    folder = run / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one file per incarnation; the reader merges them
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    csv = _csv(run)
    for tag, column in (("train/loss", 0), ("train/lr", 1)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, STEPS + 1)), tag  # the killed run's 5-7 purged
        # float32 in the event file: the CSV's value rounded the same way
        import numpy as np
        assert [e.value for e in events] == [float(np.float32(csv[e.step][column])) for e in events], tag
    for tag in ("train/grad_norm", "perf/tokens_per_s", "perf/step_s", "train/tokens_seen", "memory/peak_rss_mib"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    assert all(e.value > 0 for e in acc.Scalars("memory/peak_rss_mib"))  # rank 0's resident set, this step's peak
    assert [e.step for e in acc.Scalars("eval/loss")] == [4, 8, 12]  # the card's held-out loss at each save
    # blocked/persist times: once per save (the killed run's save at 4 was logged at step 5, purged with it)
    assert [int(e.value) for e in acc.Scalars("checkpoint/step")] == [8, 12]
    assert all(e.value > 0 for e in acc.Scalars("checkpoint/persist_s"))
    assert "perf/mfu" not in acc.Tags()["scalars"]  # unknown on CPU: not logged as a made-up number


def test_wandb_offline_run_has_every_step_once_after_kill_and_resume(killed_and_resumed):
    run, _ = killed_and_resumed
    run_id = (run / "wandb" / trackers.WANDB_ID_FILE).read_text().strip()
    segments = trackers.offline_segments(run, run_id)
    # one run: every offline segment under the run directory carries the id the first start stored
    assert len(segments) == 2 and len(list((run / "wandb").glob("offline-run-*"))) == 2, segments
    histories = [trackers.read_wandb_history(s) for s in segments]
    steps = [step for h in histories for step in sorted(h)]
    assert steps == list(range(1, STEPS + 1)), [sorted(h) for h in histories]
    assert max(histories[0]) >= SAVE_EVERY  # the killed incarnation's steps up to its checkpoint are in W&B
    csv = _csv(run)
    rows = {step: row for h in histories for step, row in h.items()}
    for step, (loss, lr) in csv.items():  # JSON of the Python float: exactly the CSV's repr
        assert json.loads(rows[step]["train/loss"]) == loss and json.loads(rows[step]["train/lr"]) == lr, step
    assert [s for s in sorted(rows) if "eval/loss" in rows[s]] == [4, 8, 12]
    # the records are W&B's own: the run record of the resumed segment names the same id
    kinds = [r.WhichOneof("record_type") for r in trackers.read_wandb_records(segments[1])]
    run_records = [r.run for r in trackers.read_wandb_records(segments[1]) if r.WhichOneof("record_type") == "run"]
    assert "history" in kinds and run_records and run_records[0].run_id == run_id


def test_tracker_folders_do_not_disturb_the_run_directory(killed_and_resumed):
    run, stdout = killed_and_resumed
    assert not re.search(r"unknown|unexpected|removed what", stdout), stdout
    listed = run_train_module_checkpoint(["list", str(run)])
    assert listed.returncode == 0, listed.stderr
    assert sorted(int(p.name.split("-")[1]) for p in run.glob("step-*")) == [4, 8, 12]


def run_train_module_checkpoint(args: list[str]):
    import subprocess

    return subprocess.run([PY, "-m", "checkpoint", *args], capture_output=True, text=True, timeout=120,
                          env=env_for_tests(), cwd=ROOT)


def test_plain_batch_log_lines_carry_lr_and_eta(killed_and_resumed):
    """Not a terminal: one plain line per --logging-frequency steps and at the incarnation's first step, with the
    learning rate the CSV records, the step's peak memory and an ETA (h:mm:ss) that reaches 0 at the last step."""
    run, stdout = killed_and_resumed
    csv = _csv(run)
    line = re.compile(r"^step (\d+)/12 loss (\S+) lr (\S+) tok/s \S+ step_s \S+ gnorm \S+ peak_rss [\d,]+MiB "
                      r"eta (\d+):(\d\d):(\d\d)$")
    found = [m for m in map(line.match, stdout.splitlines()) if m]
    assert [int(m[1]) for m in found] == [5, 6, 8, 10, 12], stdout  # resumed from step 4: its first step is 5
    for m in found:
        step = int(m[1])
        assert m[2] == f"{csv[step][0]:.4f}" and m[3] == f"{csv[step][1]:.3e}", m[0]
    assert found[-1].groups()[3:] == ("0", "00", "00")


def test_a_resume_that_changes_the_values_says_so_for_wandb(tmp_path, corpus):
    """A run to step 6, then a resume from its step-4 checkpoint with another --learning-rate: the redone steps 5-6
    differ from what the first run logged (a kill after step 4 does the same, but how far W&B's buffered segment got
    before the kill is timing; a finished run makes the overlap certain). TensorBoard purges and shows the new
    values; the W&B offline segments cannot be rewritten, so the run says so in one line (each step still once)."""
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--log-loss-to-csv",
                   "--checkpoint-frequency", "4", "--tracker", "tensorboard,wandb"]
    run = tmp_path / "default"
    run_train(base + ["--training-steps", "6"], check=True)
    proc = run_train(base + ["--training-steps", "8", "--resume-from-checkpoint", "4", "--learning-rate", "1e-4"],
                     check=True)
    warned = [ln for ln in proc.stdout.splitlines() if ln.startswith("wandb: step 5 redone with other values")]
    assert len(warned) == 1 and "train/lr" in warned[0], proc.stdout
    run_id = (run / "wandb" / trackers.WANDB_ID_FILE).read_text().strip()
    steps = [s for seg in trackers.offline_segments(run, run_id) for s in sorted(trackers.read_wandb_history(seg))]
    assert steps == list(range(1, 9))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    csv_lr = {int(r[0]): float(r[2]) for r in loss_rows(run / "loss.csv")}
    assert [(e.step, e.value) for e in acc.Scalars("train/lr")] == [(s, pytest.approx(csv_lr[s], rel=1e-6))
                                                                    for s in range(1, 9)]


def test_tensorboard_repair_of_a_step_rank0_never_wrote_keeps_it_once(tmp_path):
    """metrics.ensure_logged's TensorBoard part (a survivor's just-in-time save): whether rank 0 wrote the step or
    not, and however many survivors repair it, the reader sees it once, with the survivor's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "tensorboard"
    writer = SummaryWriter(log_dir=str(folder), purge_step=1)
    for step in range(1, 6):
        writer.add_scalar("train/loss", float(step), step)
    writer.close()
    row = {"step": 5, "loss": repr(0.5), "lr": repr(1e-3), "tokens_seen": 640}
    for _survivor in range(2):
        trackers.repair_tensorboard(folder, 5, row)
    row6 = {"step": 6, "loss": repr(0.25), "lr": repr(1e-3), "tokens_seen": 768}
    trackers.repair_tensorboard(folder, 6, row6)  # a step rank 0 never wrote at all
    acc = EventAccumulator(str(folder))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                                                      (5, 0.5), (6, 0.25)]


def test_tracker_problems_are_one_line_in_preflight(tmp_path, corpus):
    base = TINY + ["--dataset", corpus, "--checkpoint-dir", str(tmp_path), "--training-steps", "2"]
    proc = run_train(base + ["--tracker", "mlflow"], timeout=120)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "tensorboard, wandb" in errors[0], proc.stderr[-2000:]
    # A package that is not installed: Python's own marker for "not importable" (sys.modules[name] = None, which
    # importlib.util.find_spec honours), set in a sitecustomize the interpreter runs at start-up.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    proc = run_train(base + ["--tracker", "tensorboard,wandb"], timeout=120,
                     env={"PYTHONPATH": f"{shim}:{ROOT}"})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    # the command that works from this checkout (pyrecover is not on PyPI): the extra, editable, into this Python
    assert f"{shlex.quote(PY)} -m pip install -e {shlex.quote(f'{ROOT}[wandb]')}" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "default" / "tensorboard").exists()  # refused before anything was opened or trained
    (tmp_path / "a-file").write_text("")
    proc = run_train(base + ["--tracker", "tensorboard", "--tracker-dir", str(tmp_path / "a-file")], timeout=120)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "--tracker-dir" in errors[0], proc.stderr[-2000:]


def test_status_lines_do_not_break_the_progress_bar(tmp_path, corpus):
    """With the bar on (PYRECOVER_PROGRESS=1), a status line (a checkpoint committed) goes through tqdm.write: the
    bar's line is cleared first (CR, blanks, CR) and redrawn after, never cut by the line. Both streams into one
    pipe, as a terminal shows them."""
    import subprocess

    cmd = [PY, str(ROOT / "train.py"), *TINY, "--dataset", corpus, "--checkpoint-dir", str(tmp_path),
           "--training-steps", "6", "--checkpoint-frequency", "3", "--logging-frequency", "1"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180, cwd=ROOT,
                         env=env_for_tests({"PYRECOVER_PROGRESS": "1"})).stdout
    for step in (3, 6):
        line = f"checkpoint step {step} committed".encode()
        assert re.search(rb"\r +\r" + line, out), out[-3000:]
    assert b"step 3/6 loss" not in out  # a bar, not the plain lines of a batch log


def test_the_wandb_reader_follows_records_across_blocks(tmp_path):
    """The transaction-log reader on a log of several 32 KiB blocks written by W&B itself (offline): every row from
    block 0; from a later block, exactly the rows that start in it or after (what a checkpoint's sync re-reads)."""
    import subprocess

    script = ("import wandb\n"
              f"run = wandb.init(dir={str(tmp_path)!r}, id='blocks01', mode='offline', "
              "settings=wandb.Settings(console='off', x_disable_stats=True, silent=True))\n"
              "for s in range(1, 1501):\n"
              "    run.log({'train/loss': 1.0 / s, 'pad': 'x' * 40}, step=s)\n"
              "run.finish()\n")
    subprocess.run([PY, "-c", script], check=True, timeout=120, env=env_for_tests({"WANDB_MODE": "offline"}))
    (log,) = trackers.offline_segments(tmp_path, "blocks01")
    blocks = log.stat().st_size // trackers.BLOCK
    assert blocks >= 2
    full = trackers.read_wandb_history(log)
    assert sorted(full) == list(range(1, 1501))
    assert all(json.loads(full[s]["train/loss"]) == 1.0 / s for s in full)
    tail = trackers.read_wandb_history(log, from_block=blocks)
    assert tail and sorted(tail) == list(range(min(tail), 1501)) and min(tail) > 1
    assert all(tail[s] == full[s] for s in tail)
