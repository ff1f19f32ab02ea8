"""Fault injection (quick), corruption and tampering, full disk, malicious pickle, just-in-time checkpointing.

Every test drives the real CLI in subprocesses and checks the outcome bitwise against an uninterrupted run.
The long fault-injection run is `make faults K=500` (tests/faults/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, free_port, in_ci, loss_rows, run_train, torchrun_cmd

sys.path.insert(0, str(ROOT))
from checkpoint import layout  # noqa: E402
from checkpoint.errors import CheckpointError  # noqa: E402
from checkpoint.fsio import CHECKSUM_ALGORITHM, checksum_bytes, checksum_file  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS, FREQ = 6, 2
EXP = "run"


def args_for(corpus: str, ckpt: Path, *extra: str, steps: int = STEPS, freq: int = FREQ) -> list[str]:
    return [*TINY, "--dataset", corpus, "--training-steps", str(steps), "--checkpoint-frequency", str(freq),
            "--max-kept-checkpoints", "0", "--checkpoint-dir", str(ckpt), "--experiment_name", EXP,
            "--log-loss-to-csv", *extra]


def step_dir(exp: Path, step: int) -> Path:
    return exp / layout.step_dir_name(step)


def assert_same_as(reference_exp: Path, exp: Path, step: int = STEPS) -> None:
    cw = check_weights(step_dir(reference_exp, step), step_dir(exp, step), "--tolerance", "0", "--optimizer")
    assert cw.returncode == 0, cw.stdout + cw.stderr
    assert loss_rows(exp / "loss.csv") == loss_rows(reference_exp / "loss.csv")


def one_line_matching(text: str, pattern: str) -> str:
    lines = [ln for ln in text.splitlines() if re.search(pattern, ln)]
    assert len(lines) == 1, f"expected exactly one line matching {pattern!r}, got {lines}\n{text[-3000:]}"
    return lines[0]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted single-process run: checkpoints at steps 2, 4, 6 (all kept) and its loss CSV."""
    ckpt = tmp_path_factory.mktemp("reference")
    run_train(args_for(corpus, ckpt), check=True)
    exp = ckpt / EXP
    assert [i.step for i in layout.list_checkpoints(exp)] == [2, 4, 6]
    return exp


# --- the fault-injection harness, quick ------------------------------------------------------------------------------


def test_fault_injection_quick(corpus, tmp_path):
    """One trial per configuration (every registered backend x 1 and 2 ranks, + 2 ranks with --jit-checkpoint):
    random and named-point SIGKILLs, resumes from `latest`; nothing lost, bit-exact finish. Trial 3 is an overlap:
    a frozen incarnation, a refused second start, a --force-takeover one; the frozen one stops fenced."""
    from faults.harness import configurations, report, run_suite

    trials = len(configurations())
    total, per_config, seconds = run_suite(trials, seed=1234, dataset=corpus, workdir=tmp_path, steps=5, max_kills=1)
    text = report(total, per_config, seconds, 1234, trials)
    print(text)
    assert total.trials == trials
    assert total.kills >= trials // 2 and total.resumes >= 1  # a random kill may fall after a (short) run's end
    assert total.overlaps >= 1 and total.refused_starts >= 1 and total.fenced_exits >= 1, text
    assert not total.violations(), text


# --- corruption and tampering ----------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_manifest(folder: Path, edit) -> None:
    """What a careful tamperer does: edit manifest.json and re-seal COMMITTED with the new manifest's checksum."""
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    edit(manifest)
    raw = json.dumps(manifest, indent=1).encode()
    (folder / layout.MANIFEST).write_bytes(raw)
    (folder / layout.COMMITTED).write_text(json.dumps({f"manifest_{CHECKSUM_ALGORITHM}": checksum_bytes(raw)}))


def _rename_entry(manifest: dict, old: str, new: str) -> None:
    manifest["files"][new] = manifest["files"].pop(old)


CORRUPTIONS = {
    # case: (what is done to the newest checkpoint, pattern of the one-line explanation)
    "model-truncated": (lambda d: _truncate(d / "model.pt"), r"model\.pt has \d+ bytes, manifest says \d+: truncated"),
    "model-bitflip": (lambda d: _flip(d / "model.pt"), r"model\.pt fails its checksum"),
    "optimizer-truncated": (lambda d: _truncate(d / "optimizer.pt"), r"optimizer\.pt has \d+ bytes.*truncated"),
    "optimizer-bitflip": (lambda d: _flip(d / "optimizer.pt"), r"optimizer\.pt fails its checksum"),
    "rankfile-bitflip": (lambda d: _flip(d / "rank-00000.pt"), r"rank-00000\.pt fails its checksum"),
    "rankfile-truncated": (lambda d: _truncate(d / "rank-00000.pt"), r"rank-00000\.pt has \d+ bytes.*truncated"),
    "manifest-bitflip": (lambda d: _flip(d / layout.MANIFEST), r"manifest\.json does not match its commit marker"),
    "manifest-truncated": (lambda d: _truncate(d / layout.MANIFEST), r"manifest\.json does not match its commit"),
    "commit-marker-deleted": (lambda d: (d / layout.COMMITTED).unlink(), r"step-00000006: not committed"),
    "manifest-dotdot": (lambda d: _rewrite_manifest(d, lambda m: _rename_entry(m, "model.pt", "../step-00000004/model.pt")),
                        r"unsafe path '\.\./step-00000004/model\.pt'.*tampered"),
    "manifest-absolute": (lambda d: _rewrite_manifest(d, lambda m: _rename_entry(m, "optimizer.pt", "/etc/passwd")),
                          r"unsafe path '/etc/passwd'.*tampered"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_to_previous(case, corpus, reference, tmp_path):
    """Damage the newest checkpoint (step 6): `latest` skips it with one line naming the file and the problem, resumes
    from step 4, and finishes bit-identical to the uninterrupted run."""
    damage, pattern = CORRUPTIONS[case]
    exp = tmp_path / EXP
    shutil.copytree(reference, exp)
    damage(step_dir(exp, 6))

    with pytest.raises(CheckpointError):
        layout.verify(step_dir(exp, 6))

    proc = run_train(args_for(corpus, tmp_path, "--resume-from-checkpoint", "latest"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    warning = one_line_matching(out, r"skipping .*step-00000006")
    assert re.search(pattern, warning), warning
    assert re.search(r"resumed from \S+step-00000004 \(step 4", out), out[-3000:]
    assert_same_as(reference, exp)


def test_tampered_manifest_never_reaches_outside_the_folder(corpus, reference, tmp_path):
    """A manifest naming `../victim` is refused by every entry point (verify, explicit path, tools); the file outside
    is neither read into the model nor touched."""
    exp = tmp_path / EXP
    shutil.copytree(reference, exp)
    victim = tmp_path / "victim.pt"
    shutil.copy(step_dir(exp, 4) / "model.pt", victim)
    before = victim.read_bytes()
    _rewrite_manifest(step_dir(exp, 6), lambda m: _rename_entry(m, "model.pt", "../../victim.pt"))

    explicit = run_train(args_for(corpus, tmp_path, "--resume-from-checkpoint", str(step_dir(exp, 6))))
    assert explicit.returncode == 2
    one_line_matching(explicit.stderr, r"^error: .*unsafe path '\.\./\.\./victim\.pt'")
    tool = subprocess.run([PY, "-m", "checkpoint", "verify", str(step_dir(exp, 6))], capture_output=True, text=True,
                          cwd=ROOT, env=env_for_tests(), timeout=120)
    assert tool.returncode != 0 and "unsafe path" in tool.stdout + tool.stderr
    cw = check_weights(step_dir(exp, 6), step_dir(reference, 6))
    assert cw.returncode == 2 and "unsafe path" in cw.stdout + cw.stderr
    assert victim.read_bytes() == before


# --- malicious pickle ------------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this creates ``marker`` (it calls builtins.open). A stand-in for any code an attacker wants run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_pickle(folder: Path, marker: Path, name: str = "model.pt") -> None:
    import torch

    torch.save({"tok_embeddings.weight": _Payload(marker)}, folder / name)
    size, digest = checksum_file(folder / name)

    def edit(m):
        m["files"][name] = {"size": size, CHECKSUM_ALGORITHM: digest}

    _rewrite_manifest(folder, edit)  # checksums and commit marker say: valid


def test_malicious_pickle_is_refused_and_never_runs(corpus, reference, tmp_path):
    import torch

    # The payload is live: loading it the unsafe way really creates its marker.
    probe = tmp_path / "probe"
    probe.mkdir()
    torch.save({"x": _Payload(probe / "ran")}, probe / "evil.pt")
    torch.load(probe / "evil.pt", weights_only=False)
    assert (probe / "ran").exists()

    exp = tmp_path / EXP
    shutil.copytree(reference, exp)
    marker = tmp_path / "PWNED"
    _plant_pickle(step_dir(exp, 6), marker)
    layout.verify(step_dir(exp, 6))  # checksums are valid: only the loader can catch it

    proc = run_train(args_for(corpus, tmp_path, "--resume-from-checkpoint", "latest"))
    assert proc.returncode != 0
    line = one_line_matching(proc.stderr, r"^error: ")
    assert re.search(r"refusing to load \S+model\.pt: it contains pickled Python objects", line), line
    assert "weights_only=True" in line  # says why: a checkpoint must load with weights_only=True
    assert "Traceback" not in proc.stderr
    cw = check_weights(step_dir(exp, 6), step_dir(reference, 6))
    assert cw.returncode == 2 and "weights_only=True" in cw.stdout + cw.stderr
    assert not marker.exists()

    # Same for a per-rank file.
    _plant_pickle(step_dir(exp, 4), marker, name="rank-00000.pt")
    proc = run_train(args_for(corpus, tmp_path, "--resume-from-checkpoint", "4"))
    assert proc.returncode != 0
    assert re.search(r"refusing to load \S+rank-00000\.pt", one_line_matching(proc.stderr, r"^error: "))
    assert not marker.exists()


# --- save errors: injected I/O error, real ENOSPC --------------------------------------------------------------------


def _writes_per_save(reference: Path) -> int:
    manifest = json.loads((step_dir(reference, 2) / layout.MANIFEST).read_text())
    return len(manifest["files"]) + 3  # payload files, part record, manifest, COMMITTED


def _first_write_of_step4(reference: Path) -> int:
    # the run's first writes are config.resolved.json and places.json, then the step-2 save
    return 2 + _writes_per_save(reference) + 1


def test_save_error_continue_retries_at_next_interval(corpus, reference, tmp_path):
    """An I/O error in the step-4 save with --on-save-error continue: one warning line, training goes on, the step-6
    save succeeds, and the result is bit-identical; the failed step-4 folder is cleaned up."""
    first_write_of_step4 = _first_write_of_step4(reference)
    proc = run_train(args_for(corpus, tmp_path, "--on-save-error", "continue"),
                     env={"PYRECOVER_FAULT": f"after_write_before_fsync:{first_write_of_step4}:error"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = one_line_matching(proc.stderr, r"^warning: saving step 4")
    assert "injected I/O error" in line and "training continues" in line
    exp = tmp_path / EXP
    assert [i.step for i in layout.list_checkpoints(exp)] == [2, 6]
    assert_same_as(reference, exp)


def test_save_error_stop_is_the_default(corpus, reference, tmp_path):
    first_write_of_step4 = _first_write_of_step4(reference)
    proc = run_train(args_for(corpus, tmp_path),
                     env={"PYRECOVER_FAULT": f"after_write_before_fsync:{first_write_of_step4}:error"})
    assert proc.returncode == 1
    one_line_matching(proc.stderr, r"^error: saving step 4 .*failed: injected I/O error")
    assert "Traceback" not in proc.stderr
    exp = tmp_path / EXP
    assert layout.resolve(exp, "latest").step == 2
    assert "step 5/" not in proc.stdout  # it stopped at the failed save


@pytest.fixture
def small_disk(tmp_path):
    """A 60 MiB tmpfs: one 48 MiB checkpoint of the tiny model fits, a second does not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        reason = "mounting a size-limited tmpfs needs root and mount(8)"
        if in_ci():
            pytest.fail(f"{reason} (CI=true: a skipped disk-full test would hide a broken CI image)")
        pytest.skip(reason)
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        reason = f"cannot mount a tmpfs here: {proc.stderr.strip()}"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("backend", ["vanilla", "concurrent", "dcp"])
def test_disk_full_stops_cleanly_and_keeps_latest(corpus, reference, small_disk, backend):
    """Every backend: the real ENOSPC is named (DCP's torch.save would mask it as "unexpected pos"), the failed folder
    is removed, `latest` stays the previous checkpoint, and with space again the run resumes bit-identical."""
    chosen = ["--checkpoint-backend", backend]
    proc = run_train(args_for(corpus, small_disk, *chosen))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = one_line_matching(proc.stderr, r"^error: ")
    assert re.search(r"saving step 4 .* no space left on device; free space or point --checkpoint-dir elsewhere", line)
    assert "Traceback" not in proc.stderr
    exp = small_disk / EXP
    latest = layout.resolve(exp, "latest")
    assert latest.step == 2  # intact and verified
    assert not step_dir(exp, 4).exists()  # the failed save gave its space back

    # With space again, resume from it and finish bit-identical.
    subprocess.run(["mount", "-o", "remount,size=400m", str(small_disk)], check=True)
    proc = run_train(args_for(corpus, small_disk, *chosen, "--resume-from-checkpoint", "latest"), check=True)
    assert re.search(r"resumed from \S+step-00000002 \(step 2", proc.stdout)
    assert_same_as(reference, exp)


def test_disk_full_continue_retries_every_interval(corpus, reference, small_disk):
    proc = run_train(args_for(corpus, small_disk, "--on-save-error", "continue"))
    err = proc.stderr
    assert re.search(r"^warning: saving step 4 .*no space left on device.*training continues", err, re.M), err[-2000:]
    assert re.search(r"^warning: saving step 6 .*no space left on device.*training continues", err, re.M), err[-2000:]
    # It trained to the end, but the final checkpoint is missing: that is a failure, said in one line.
    assert proc.returncode == 1
    one_line_matching(err, r"^error: training reached step 6 but its final checkpoint could not be saved")
    exp = small_disk / EXP
    assert layout.resolve(exp, "latest").step == 2
    assert [r[0] for r in loss_rows(exp / "loss.csv")] == [str(s) for s in range(1, STEPS + 1)]


# --- just-in-time checkpointing --------------------------------------------------------------------------------------

JIT_STEPS, JIT_FREQ, CRASH_AT = 8, 4, 7


def _plain_ranks(args: list[str], env: dict | None = None, world: int = 2) -> list[subprocess.Popen]:
    """Ranks as plain processes (RANK/WORLD_SIZE/MASTER_*), no launcher agent that would SIGTERM the survivors."""
    port = free_port()
    procs = []
    for r in range(world):
        e = env_for_tests({"PYTHONFAULTHANDLER": "1", **(env or {}), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([PY, str(ROOT / "train.py"), "--distributed", *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=e, cwd=ROOT))
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER=1: dumps every thread's stack
            try:
                text, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            text = "[timed out]\n" + text
        out.append((p.returncode, text))
    return out


def _loop_seconds(rank0_output: str) -> float:
    return float(re.search(r"done: \d+ steps, final loss \S+, ([\d.]+)s in the loop", rank0_output).group(1))


def _jit_args(corpus: str, ckpt: Path, *extra: str) -> list[str]:
    return args_for(corpus, ckpt, "--resume-from-checkpoint", "latest", *extra, steps=JIT_STEPS, freq=JIT_FREQ)


@pytest.fixture(scope="module")
def jit_reference(corpus, tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("jit-reference")
    results = _finish(_plain_ranks(_jit_args(corpus, ckpt)))
    assert all(rc == 0 for rc, _ in results), results[0][1][-3000:]
    return ckpt / EXP


def _resume(corpus: str, ckpt: Path, *extra: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    results = _finish(_plain_ranks(_jit_args(corpus, ckpt, *extra)))
    assert all(rc == 0 for rc, _ in results), "\n".join(f"rank {r} exit {rc}:\n{out[-2500:]}"
                                                        for r, (rc, out) in enumerate(results))
    return time.perf_counter() - t0, results[0][1]


def test_jit_rank_killed_mid_step_saves_last_step_and_resumes_bit_exact(corpus, jit_reference, tmp_path):
    """Rank 1 is SIGKILLed after the forward pass of step 7; rank 0 notices at the gradient all-reduce, saves step 6
    without the process group and exits 3. The rerun replays one step and ends bitwise equal to an uninterrupted run.
    The same crash with periodic checkpoints only resumes from step 4 and replays three."""
    crash = {"PYRECOVER_CRASH_AT_STEP": f"{CRASH_AT}:1"}
    jit_ckpt, periodic_ckpt = tmp_path / "jit", tmp_path / "periodic"

    t0 = time.perf_counter()
    (rc0, out0), (rc1, out1) = _finish(_plain_ranks(_jit_args(corpus, jit_ckpt, "--jit-checkpoint",
                                                              "--pg-timeout-seconds", "30"), env=crash))
    jit_crash_s = time.perf_counter() - t0
    assert rc1 == -signal.SIGKILL and f"[crash] rank 1: kill after the forward pass of step {CRASH_AT}" in out1
    assert rc0 == 3, out0[-3000:]
    one_line_matching(out0, rf"jit: rank 0 noticed a failure during the forward/backward of step {CRASH_AT} .*Connection")
    saved = one_line_matching(out0, rf"jit: rank 0 saved step {CRASH_AT - 1} .* in [\d.]+s")
    jit_save_s = float(re.search(r" in ([\d.]+)s", saved).group(1))
    exp = jit_ckpt / EXP
    manifest = layout.verify(step_dir(exp, CRASH_AT - 1))
    assert manifest["meta"]["jit"] is True and manifest["world_size"] == 2 and manifest["meta"]["rng_exact"] is True
    assert {"rank-00000.pt", "rank-00001.pt", "model.pt", "optimizer.pt"} <= set(manifest["files"])
    card = manifest["meta"]["card"]  # documented like any checkpoint, but no forward pass in a failure path: no probe
    assert card["progress"]["step"] == CRASH_AT - 1 and "eval" not in card

    # --validate-on-resume does not strand a requeued job on a just-in-time save: it says so and goes on.
    jit_resume_s, out = _resume(corpus, jit_ckpt, "--validate-on-resume")
    assert re.search(rf"resumed from \S+step-{CRASH_AT - 1:08d} \(step {CRASH_AT - 1}", out)
    assert "is a just-in-time save (no forward pass, no probe): not validated" in out, out[-3000:]
    assert_same_as(jit_reference, exp, JIT_STEPS)

    # The alternative: periodic checkpoints only.
    (prc0, pout0), (prc1, _) = _finish(_plain_ranks(_jit_args(corpus, periodic_ckpt), env=crash))
    assert prc1 == -signal.SIGKILL and prc0 not in (0, 3)
    periodic_resume_s, pout = _resume(corpus, periodic_ckpt)
    assert re.search(r"resumed from \S+step-00000004 \(step 4", pout)
    assert_same_as(jit_reference, periodic_ckpt / EXP, JIT_STEPS)

    # Replayed = steps of the crashed step's work redone: from the resumed step up to and including the crashed one.
    replay_jit, replay_periodic = CRASH_AT - (CRASH_AT - 1), CRASH_AT - JIT_FREQ
    step_s_jit = _loop_seconds(out) / (JIT_STEPS - (CRASH_AT - 1))
    step_s_periodic = _loop_seconds(pout) / (JIT_STEPS - JIT_FREQ)
    print(f"\nrecovery cost, rank 1 killed in step {CRASH_AT} of {JIT_STEPS} (periodic checkpoint every {JIT_FREQ}):\n"
          f"  --jit-checkpoint : resumed from step {CRASH_AT - 1}, {replay_jit} step replayed "
          f"(~{replay_jit * step_s_jit:.2f}s of training) + JIT save {jit_save_s:.2f}s before exiting "
          f"[crashed run {jit_crash_s:.1f}s, rerun {jit_resume_s:.1f}s wall incl. start-up]\n"
          f"  periodic only    : resumed from step {JIT_FREQ}, {replay_periodic} steps replayed "
          f"(~{replay_periodic * step_s_periodic:.2f}s of training) [rerun {periodic_resume_s:.1f}s wall]")
    assert replay_jit == 1 < replay_periodic


def test_jit_under_torchrun_failed_rank_raises(corpus, jit_reference, tmp_path):
    """torchrun SIGTERMs the surviving worker ~0.1 s after one fails (and SIGKILLs it 30 s later): with
    --jit-checkpoint the survivor treats SIGTERM like a peer failure and still saves. Rank 1 *raises* here: it does
    not save (a rank that failed itself is not trusted); rank 0 does."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(torchrun_cmd(2, _jit_args(corpus, ckpt, "--jit-checkpoint", "--pg-timeout-seconds", "30")),
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env_for_tests({"PYRECOVER_CRASH_AT_STEP": f"{CRASH_AT}:1:raise"}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0  # torchrun reports the failed worker; the survivor's own exit code is 3
    assert re.search(r"exitcode\s*:\s*3\b", out), "\n".join(ln for ln in out.splitlines() if "[rank1]" not in ln)
    one_line_matching(out, r"jit: rank 1 failed itself \(RuntimeError: injected crash of rank 1")
    one_line_matching(out, rf"jit: rank 0 saved step {CRASH_AT - 1} ")
    _, resumed = _resume(corpus, ckpt)
    assert re.search(rf"resumed from \S+step-{CRASH_AT - 1:08d}", resumed)
    assert_same_as(jit_reference, ckpt / EXP, JIT_STEPS)


def test_jit_hung_rank_is_noticed_after_the_pg_timeout(corpus, jit_reference, tmp_path):
    """Rank 1 hangs (no socket closes): rank 0 notices only when --pg-timeout-seconds expires, then saves."""
    ckpt = tmp_path / "ckpt"
    procs = _plain_ranks(_jit_args(corpus, ckpt, "--jit-checkpoint", "--pg-timeout-seconds", "10"),
                         env={"PYRECOVER_CRASH_AT_STEP": f"{CRASH_AT}:1:hang"})
    try:
        (rc0, out0), = _finish(procs[:1], timeout=240)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert rc0 == 3, out0[-3000:]
    line = one_line_matching(out0, r"jit: rank 0 noticed a failure")
    assert re.search(r"[Tt]imed out|timeout", line), line
    one_line_matching(out0, rf"jit: rank 0 saved step {CRASH_AT - 1} ")
    _, resumed = _resume(corpus, ckpt)
    assert re.search(rf"resumed from \S+step-{CRASH_AT - 1:08d}", resumed)
    assert_same_as(jit_reference, ckpt / EXP, JIT_STEPS)


# --- JIT decisions, in-process (no training) -------------------------------------------------------------------------


class _Piece:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, sd):
        self.value = sd["v"]


def _jit(tmp_path: Path, step: int = 5, rank: int = 0, metrics=None):
    from checkpoint import CheckpointManager, CheckpointState, RankInfo, TrainState, make_backend
    from checkpoint.jit import JustInTime

    who = RankInfo(rank, 2)
    manager = CheckpointManager(tmp_path, make_backend("vanilla", who), who, run_id="test")
    state = CheckpointState(model=_Piece(1), train_state=TrainState(step=step), dataloader=_Piece(7))
    return JustInTime(manager, state, ensure_logged=metrics.ensure_logged if metrics else (lambda step: None))


def test_jit_survivor_commits_and_logs_the_step_rank0_never_logged(tmp_path):
    """Rank 1 completes step 5 and rank 0 dies before writing CSV row 5: rank 1 saves step 5 as a committed,
    verifiable 2-rank checkpoint (meta.jit) and its metrics append row 5, so the CSV still has every step once."""
    from metrics import Metrics

    csv_path = tmp_path / "loss.csv"
    csv_path.write_text("step,loss,lr,tokens_seen,wall_time,restart\n" +
                        "".join(f"{i},{i}.0,0.1,{10 * i},0.0,0\n" for i in range(1, 5)))
    metrics = Metrics(writer=False, csv_path=csv_path)  # rank 1: notes rows, writes none
    jit = _jit(tmp_path, step=5, rank=1, metrics=metrics)
    jit.begin_step()
    jit.begin_optimizer()
    jit.end_step()
    metrics.step(5, 5.0, 0.1, None, 1.0, 50, 0)
    assert jit.save_if_survivor(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")) is True
    manifest = layout.verify(step_dir(tmp_path, 5))
    assert manifest["step"] == 5 and manifest["world_size"] == 2 and manifest["meta"]["jit"] is True
    assert {"model.pt", "train_state.pt", "rank-00000.pt", "rank-00001.pt"} <= set(manifest["files"])
    assert [r[0] for r in loss_rows(csv_path)] == ["1", "2", "3", "4", "5"]
    assert loss_rows(csv_path)[-1] == ("5", "5.0", "0.1", "50")
    assert not any(p.name.startswith(".staging-") and any(p.rglob("step-*")) for p in tmp_path.iterdir())


def test_jit_keeps_a_valid_periodic_save_of_the_same_step(tmp_path):
    """A periodic save of step 5 committed while the survivor was writing: the layout keeps it, the JIT copy goes."""
    jit = _jit(tmp_path, step=5)
    jit.begin_step()
    pieces, meta = jit._pieces()
    first = jit.manager.save_alone(5, pieces, meta=meta | {"first": True})
    second = jit.manager.save_alone(5, pieces, meta=meta)
    assert first == second and layout.verify(first)["meta"].get("first") is True


def test_jit_never_saves_from_inside_the_optimizer_step(tmp_path):
    from checkpoint.jit import OPTIMIZER

    jit = _jit(tmp_path)
    jit.begin_step()
    jit.begin_optimizer()
    assert jit.phase == OPTIMIZER
    assert jit.save_if_survivor(RuntimeError("Connection closed by peer")) is False  # -> re-raised, exit 1
    assert not list(tmp_path.glob("step-*"))


def test_jit_tells_peer_failures_from_own_failures():
    from checkpoint.jit import is_peer_failure

    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms"))
    assert not is_peer_failure(RuntimeError("injected crash of rank 1 at step 7"))
    assert not is_peer_failure(ValueError("bad value"))
    assert not is_peer_failure(MemoryError())
