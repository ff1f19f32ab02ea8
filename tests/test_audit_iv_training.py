"""Audit IV (issue 53), the training side, through the real CLI:

* 2: a stop signal during an evaluation does not wait for it: SIGUSR1 (1 rank) or SIGTERM (to one of 2 ranks) sent
  inside a slow evaluation leads to a committed checkpoint and the exit within 15 s; the interrupted evaluation is
  not recorded, the resumed run evaluates that step first, and its val rows, loss rows and weights are bitwise the
  uninterrupted run's. The walltime rule counts an evaluation's measured duration before it starts one (in process,
  over a fake clock). The eval line shows its duration, and the ETA counts the evaluations to come (in process).
* 5: a --val-dataset that is a training file is refused in one line; documents it shares with the training data are
  counted in a warning.
* 6: --check refuses an --init-from whose safetensors header is unreadable, and a bad JSON Lines record past the first.
* 7: a non-finite number in --init-from's config.json is said to be one (not "differs from --model").
* 8: a tokenizer smaller than --init-from's embeddings is refused (run and --check); --force-tokenizer trains anyway.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, free_port, loss_rows, run_train, val_rows

STOP_WITHIN_S = 15.0  # the bound: the signal's checkpoint committed and the process gone



def committed(exp: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in exp.glob("step-*") if (p / "COMMITTED").exists())


def rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def one_error(proc) -> str:
    """The one line a refusal says (exit 2, no traceback)."""
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


# --- 2: a stop during an evaluation -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def val_parquet(corpus, tmp_path_factory) -> Path:
    """A separate validation file of a few documents: about a hundred windows of 32 tokens, all of which an
    evaluation reads (the default --eval-tokens)."""
    path = tmp_path_factory.mktemp("val") / "val.parquet"
    pq.write_table(pq.read_table(corpus, columns=["text"]).slice(400, 4), path)
    return path


def eval_args(corpus: str, val: Path, ck: Path) -> list[str]:
    return TINY + ["--dataset", corpus, "--val-dataset", str(val), "--eval-every", "2", "--training-steps", "4",
                   "--checkpoint-frequency", "0", "--checkpoint-dir", str(ck), "--log-loss-to-csv"]


@pytest.fixture(scope="module")
def whole(corpus, val_parquet, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted run (1 rank): evaluations at steps 2 and 4. Its folder and its output."""
    ck = tmp_path_factory.mktemp("whole")
    done = run_train(eval_args(corpus, val_parquet, ck) + ["--experiment_name", "whole"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r[0] for r in val_rows(ck / "whole" / "val.csv")] == ["2", "4"]
    return ck / "whole", done.stdout


def ranks(args: list[str], out: Path, env: dict, world: int) -> list[subprocess.Popen]:
    """train.py as ``world`` plain rank processes (no launcher in between: the test signals one rank), output to
    files."""
    port = free_port()
    procs = []
    for r in range(world):
        extra = {} if world == 1 else {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(out / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen([PY, str(ROOT / "train.py"), *(["--distributed"] if world > 1 else []),
                                           *args], stdout=log, stderr=subprocess.STDOUT,
                                          env=env_for_tests({**env, **extra}), cwd=ROOT))
    return procs


def stop_inside_evaluation(args: list[str], exp: Path, out: Path, sig: int, world: int, to_rank: int) -> float:
    """Start a run whose evaluations are slow (60 s, spread over their batches), send ``sig`` to rank ``to_rank``
    inside step 2's evaluation, and return how long every rank took to exit after it. Every rank must exit 4
    (stopped, not requeued: no SLURM here) with step 2 committed."""
    procs = ranks(args, out, {"PYRECOVER_TEST_EVAL_SLEEP": "60"}, world)
    try:
        deadline = time.monotonic() + 240
        while rows(exp / "loss.csv") < 2:  # step 2's row is written, then its evaluation starts
            assert all(p.poll() is None for p in procs), (out / "rank0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.05)
        time.sleep(2.0)  # well inside the evaluation (its first batch, then 60 s of sleep slices)
        procs[to_rank].send_signal(sig)
        sent = time.monotonic()
        for p in procs:
            try:
                p.wait(timeout=max(0.1, sent + STOP_WITHIN_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        took = time.monotonic() - sent
        logs = "\n".join((out / f"rank{r}.log").read_text()[-2500:] for r in range(world))
        assert all(p.returncode is not None for p in procs), \
            f"still running {STOP_WITHIN_S:.0f}s after {signal.Signals(sig).name} inside an evaluation:\n{logs}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [4] * world, logs
    assert committed(exp) == [2], logs
    assert "eval step 2" not in (out / "rank0.log").read_text()  # given way: not reported
    return took


def test_sigusr1_inside_an_evaluation_saves_at_once_and_the_resumed_run_is_bitwise_the_whole(
        tmp_path, corpus, val_parquet, whole):
    ck = tmp_path / "ck"
    args = eval_args(corpus, val_parquet, ck) + ["--experiment_name", "stopped"]
    took = stop_inside_evaluation(args, ck / "stopped", tmp_path, signal.SIGUSR1, world=1, to_rank=0)
    print(f"SIGUSR1 inside an evaluation: committed and exited in {took:.1f}s")
    whole, said = whole
    # the eval line says how long the evaluation took
    assert re.search(r"^eval step 2: val loss \S+ ppl \S+ \(\d+ tokens, \d+\.\ds\)$", said, re.M), said[-3000:]
    assert not (ck / "stopped" / "val.csv").exists() or val_rows(ck / "stopped" / "val.csv") == []

    resumed = run_train(args + ["--resume-from-checkpoint", "latest"], timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step 2's evaluation gave way to the stop" in resumed.stdout, resumed.stdout[-3000:]
    assert val_rows(ck / "stopped" / "val.csv") == val_rows(whole / "val.csv")  # step 2 redone: the same value
    assert loss_rows(ck / "stopped" / "loss.csv") == loss_rows(whole / "loss.csv")
    same = check_weights(whole / "step-00000004", ck / "stopped" / "step-00000004")
    assert same.returncode == 0, same.stdout + same.stderr


def test_sigterm_to_one_of_two_ranks_inside_a_saves_evaluation_stops_both_at_once(tmp_path, corpus, val_parquet):
    """The evaluation a periodic save makes for its card (no --eval-every): the save it belongs to becomes the stop's,
    with the probe alone in its card (the resumed run owes that evaluation)."""
    ck = tmp_path / "ck"
    args = eval_args(corpus, val_parquet, ck) + ["--eval-every", "0", "--checkpoint-frequency", "2",
                                                 "--experiment_name", "two"]
    took = stop_inside_evaluation(args, ck / "two", tmp_path, signal.SIGTERM, world=2, to_rank=1)
    print(f"SIGTERM to rank 1 inside a save's evaluation (2 ranks): committed and exited in {took:.1f}s")
    said = (tmp_path / "rank0.log").read_text()
    assert "saving and stopping at step 2: another rank received a stop signal" in said, said[-3000:]
    import json

    card = json.loads((ck / "two" / "step-00000002" / "manifest.json").read_text())["meta"]["card"]
    assert "probe_loss" in card["eval"] and "eval_loss" not in card["eval"], card["eval"]


def test_the_walltime_rule_counts_an_evaluation_before_it_starts():
    """In process, over a fake clock: 50 s left, 10 s needed for the steps and the save, and an evaluation measured at
    60 s: the boundary goes on, but that evaluation does not start -- the stop comes first, and the next boundary saves
    it."""
    from checkpoint.policy import WALLTIME, IntervalPolicy, StepBoundary
    from checkpoint.walltime import WalltimePolicy

    now = [1000.0]
    wt = WalltimePolicy(lambda: (1050.0, "test"), margin_s=10.0, clock=lambda: now[0], background=False)
    wt.start()
    policy = StepBoundary(IntervalPolicy(0, 100), agree=lambda v: v, walltime=wt, mono=lambda: now[0])
    assert not policy(1).stop
    assert not policy.interrupt(before_eval=True)  # nothing measured yet: the first evaluation starts
    policy.observe_eval(60.0)
    assert not policy(2).stop and not policy.interrupt()  # between batches: the steps and the save still fit
    assert policy.interrupt(before_eval=True)  # 50 s left < 10 s + the 60 s evaluation
    decision = policy(3)
    assert decision.stop and decision.save and decision.vote == WALLTIME
    assert "the evaluation due now 60.00s" in wt.explain(wt.eval_s)


def test_the_eta_counts_the_evaluations_to_come():
    """In process: 5 of 10 steps in 10 s, of which one evaluation took 4 s; evaluations at every 2nd step: 5 steps
    at 1.2 s and 3 evaluations (6, 8, 10) at 4 s."""
    from metrics import Metrics

    metrics = Metrics(writer=True, csv_path=None, total_steps=10, evaluations=lambda a, b: b // 2 - a // 2)
    metrics.note_eval(2, {"val_loss": 1.0, "val_ppl": 2.7, "val_tokens": 64, "eval_loss": 1.0, "probe_loss": 1.0},
                      4.0)
    metrics._t_loop = time.monotonic() - 10.0
    assert metrics._eta(5) == "0:00:18"


# --- 5: a validation set that is training data ------------------------------------------------------------------------

def test_val_dataset_naming_the_training_file_is_refused(tmp_path, corpus):
    """The same file (the issue's case: refused before anything is trained or written), and a byte-identical copy
    through --check (the same refusal, as the submit script's dry run says it)."""
    run = run_train(TINY + ["--dataset", corpus, "--val-dataset", corpus, "--eval-every", "1", "--eval-tokens", "256",
                            "--training-steps", "2", "--checkpoint-dir", str(tmp_path / "ck")], timeout=240)
    line = one_error(run)
    assert f"--val-dataset {corpus}: {corpus} is the training file {corpus}" in line, line
    assert "--val-fraction" in line, line
    assert not list((tmp_path / "ck").glob("*/step-*"))

    copy = tmp_path / "copy.parquet"
    copy.write_bytes(Path(corpus).read_bytes())
    check = run_train(TINY + ["--check", "--dataset", corpus, "--val-dataset", str(copy), "--checkpoint-dir",
                              str(tmp_path / "ck")], timeout=240)
    assert f"{copy} is a byte-identical copy of the training file {corpus}" in one_error(check)


def test_val_documents_that_training_reads_too_are_counted(tmp_path, corpus):
    """Three training documents among five: a warning says how many (a run still starts: duplicates across splits
    are common in gathered text, and may be meant); --check says it too."""
    shared = pq.read_table(corpus, columns=["text"]).slice(400, 3).column("text").to_pylist()
    val = tmp_path / "val.parquet"
    import pyarrow as pa

    pq.write_table(pa.table({"text": shared + ["A document of its own, not in the corpus.", "Nor is this one."]}), val)
    check = run_train(TINY + ["--check", "--dataset", corpus, "--val-dataset", str(val), "--checkpoint-dir",
                              str(tmp_path / "ck")], timeout=240)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    warnings = [ln for ln in check.stderr.splitlines() if ln.startswith("warning: --val-dataset")]
    assert len(warnings) == 1 and f": 3 of its 5 documents are also in --dataset {corpus} (the same text)" \
        in warnings[0], check.stderr[-2000:]


# --- 6, 7, 8: --check and --init-from -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A Hugging Face Llama folder of the tiny shape with 32,000-row embeddings (the default tokenizer's size)."""
    from test_continued_pretraining import _model_folder

    folder = tmp_path_factory.mktemp("hf") / "model"
    folder.mkdir()
    _model_folder(folder, 32000)
    return folder


def variant(model_folder: Path, where: Path, *, weights: bytes | None = None, config: dict | None = None) -> Path:
    """A copy of ``model_folder`` (its weights linked unless given) with another config.json or weights file."""
    import json

    where.mkdir()
    if weights is None:
        (where / "model.safetensors").symlink_to(model_folder / "model.safetensors")
    else:
        (where / "model.safetensors").write_bytes(weights)
    theirs = json.loads((model_folder / "config.json").read_text())
    (where / "config.json").write_text(json.dumps(theirs | (config or {})))
    return where


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    import pyarrow as pa

    from test_tokenizer_hf import TEXTS

    path = tmp_path_factory.mktemp("small") / "small.parquet"
    pq.write_table(pa.table({"text": [t + f" ({i})" for i in range(60) for t in TEXTS]}), path)
    return path


def test_check_refuses_an_unreadable_safetensors_header(tmp_path, model_folder, small_data):
    raw = bytearray((model_folder / "model.safetensors").read_bytes())
    raw[:8] = (len(raw) * 4).to_bytes(8, "little")  # a header longer than the file
    bad = variant(model_folder, tmp_path / "bad", weights=bytes(raw))
    args = ["--init-from", str(bad), "--dataset", str(small_data), "--checkpoint-dir", str(tmp_path / "ck")]
    check = run_train(["--check", *args], timeout=240)
    line = one_error(check)
    assert line.startswith(f"error: --init-from {bad / 'model.safetensors'}: not a readable safetensors file"), line
    assert "OK" not in check.stdout


def test_check_reads_json_lines_records_past_the_first(tmp_path):
    import json

    data = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i}: " + "words " * 20}) for i in range(1, 21)]
    lines[10] = '{"text": "line eleven is cut off'
    data.write_text("\n".join(lines) + "\n")
    check = run_train(TINY + ["--check", "--dataset", str(data), "--checkpoint-dir", str(tmp_path / "ck")],
                      timeout=240)
    line = one_error(check)
    assert line.startswith(f"error: {data} line 11: not JSON"), line


def test_a_non_finite_number_in_the_init_from_config_is_said_to_be_one(tmp_path, model_folder, small_data):
    nan = variant(model_folder, tmp_path / "nan", config={"rms_norm_eps": float("nan")})
    run = run_train(["--init-from", str(nan), "--dataset", str(small_data), "--training-steps", "1",
                     "--checkpoint-dir", str(tmp_path / "ck")], timeout=240)
    line = one_error(run)
    assert f"{nan / 'config.json'}: rms_norm_eps NaN is not a finite number" in line, line
    assert "--init-from" in line and "differs from --model" not in line and "drop --model" not in line, line


def test_a_tokenizer_smaller_than_the_embeddings_is_refused(tmp_path, model_folder, small_data):
    from test_tokenizer_hf import make_tokenizer_json

    own = variant(model_folder, tmp_path / "own")
    (own / "tokenizer.json").write_bytes(make_tokenizer_json(vocab_size=300))
    args = TINY + ["--init-from", str(own), "--dataset", str(small_data), "--training-steps", "1",
                   "--checkpoint-dir", str(tmp_path / "ck")]
    args.remove("--model"), args.remove("tiny")  # the shape is the folder's
    for how in (["--check"], []):
        line = one_error(run_train(how + args, timeout=240))
        assert f"--init-from {own}: tokenizer hf-own-" in line and "but the weights' embeddings have 32000 rows" \
            in line and "--force-tokenizer" in line, line
    forced = run_train(args + ["--force-tokenizer"], timeout=240)
    assert forced.returncode == 0, forced.stdout[-2000:] + forced.stderr[-2000:]
    assert "warning: --force-tokenizer: --init-from" in forced.stdout, forced.stdout[-2000:]
