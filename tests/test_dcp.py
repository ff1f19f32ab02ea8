"""The dcp backend (torch.distributed.checkpoint) end to end, through the real CLI: DDP and FSDP2 on torchrun/gloo,
kill -9 and resume bit-exact, async save, resharding N -> M ranks, conversion to/from vanilla, bad input."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, check_weights, csv_rows, env_for_tests, kill_run_at_row, loss_rows, torchrun_cmd

sys.path.insert(0, str(ROOT))
from checkpoint import layout  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 12
FREQ = 4
DCP = ["--checkpoint-backend", "dcp"]


def _args(corpus: str, ckdir: Path, *extra: str, keep: int = 2) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--log-loss-to-csv", "--checkpoint-dir", str(ckdir), "--max-kept-checkpoints", str(keep), *extra]


def _cmd(nproc: int, args: list[str], script: Path | None = None) -> list[str]:
    script = script or ROOT / "train.py"
    if nproc == 1:
        return [PY, str(script), *args]
    cmd = torchrun_cmd(nproc, args)
    cmd[cmd.index(str(ROOT / "train.py"))] = str(script)
    return cmd


def _run(nproc: int, args: list[str], *, script: Path | None = None, env: dict | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(nproc, args, script), capture_output=True, text=True, timeout=timeout,
                          env=env_for_tests(env), cwd=ROOT)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


def _kill_at_row(nproc: int, args: list[str], csv: Path, row: int) -> None:
    kill_run_at_row(_cmd(nproc, args), csv, row)


def _bitwise(a: Path, b: Path) -> None:
    cmp = check_weights(a, b, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, cmp.stdout + cmp.stderr


def _step(root: Path, step: int) -> Path:
    return root / layout.step_dir_name(step)


PARALLEL = {"ddp": ["--distributed", "--parallel", "ddp"], "fsdp": ["--distributed", "--parallel", "fsdp"]}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Uninterrupted dcp runs keeping every checkpoint: 2 ranks DDP, 2 ranks FSDP, 1 process."""
    refs = {}
    for name, nproc in (("ddp", 2), ("fsdp", 2), ("single", 1)):
        ck = tmp_path_factory.mktemp(f"dcp-ref-{name}")
        _ok(_run(nproc, _args(corpus, ck, *DCP, *PARALLEL.get(name, []), keep=0)))
        refs[name] = ck / "default"
        assert [i.step for i in layout.list_checkpoints(refs[name])] == [4, 8, 12]
    return refs


def _same_as_reference(ref: Path, run: Path) -> None:
    _bitwise(ref, run)
    assert loss_rows(run / "loss.csv") == loss_rows(ref / "loss.csv")
    assert [int(r[0]) for r in loss_rows(run / "loss.csv")] == list(range(1, STEPS + 1))  # every step exactly once


# --- same world size: kill -9, resume latest, bit-exact ------------------------------------------------------------


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_kill_and_resume_is_bit_exact(parallel, corpus, tmp_path, reference):
    seed = int(os.environ.get("PYRECOVER_TEST_SEED", time.time_ns() % 10_000))
    kill_row = random.Random(seed).randint(FREQ + 1, STEPS - 2)
    print(f"kill at step {kill_row} (PYRECOVER_TEST_SEED={seed})")
    args = _args(corpus, tmp_path, *DCP, *PARALLEL[parallel])
    _kill_at_row(2, args, tmp_path / "default/loss.csv", kill_row)
    proc = _ok(_run(2, args + ["--resume-from-checkpoint", "latest"]))
    assert "dcp backend" in proc.stdout and "resumed from" in proc.stdout
    root = tmp_path / "default"
    manifest = layout.verify(_step(root, STEPS))
    assert manifest["backend"] == "dcp" and manifest["world_size"] == 2
    # every rank wrote its own shard file; rank 0 DCP's index; all of them checksummed in the manifest
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt"} <= set(manifest["files"])
    _same_as_reference(reference[parallel], root)


def test_async_save_completes_and_resumes_bit_exact(corpus, tmp_path, reference):
    args = _args(corpus, tmp_path, *DCP, *PARALLEL["fsdp"], "--async-checkpoint")
    _kill_at_row(2, args, tmp_path / "default/loss.csv", FREQ + 3)
    proc = _ok(_run(2, args + ["--resume-from-checkpoint", "latest"]))
    assert "resumed from" in proc.stdout
    root = tmp_path / "default"
    # the save started at the last step was still in flight when the loop ended: close() finished and committed it
    assert [i.step for i in layout.list_checkpoints(root) if i.committed][-1] == STEPS
    _same_as_reference(reference["fsdp"], root)
    # the async save checkpoints are the very same bytes of state as the synchronous ones
    _bitwise(_step(reference["fsdp"], 8), _step(root, 8))


def test_async_background_save_error_stops_the_run_in_one_line(corpus, tmp_path):
    # the first file DCP writes fails with EIO -- in the background writer thread of the async save
    proc = _run(1, _args(corpus, tmp_path, *DCP, "--async-checkpoint"), env={"PYRECOVER_FAULT": "dcp_write_file:1:error"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: saving step 4") and "injected I/O error" in errors[0], errors
    # surfaced by the per-step poll (a few steps after the step-4 save, as fast as its background thread fails), not
    # by the next save at step 8, which would wait for it (one async save in flight); training stopped there
    assert csv_rows(tmp_path / "default/loss.csv") < 2 * FREQ
    assert not [i for i in layout.list_checkpoints(tmp_path / "default") if i.committed]  # nothing half-saved committed


# --- resharding: N ranks -> M ranks ---------------------------------------------------------------------------------

# Loads a checkpoint with the CURRENT world size through the real CheckpointManager + dcp backend (model wrapped by
# train.py's own code), then saves what it loaded right away: the re-saved checkpoint must be bitwise equal to the source.
_PROBE = r'''
import os, sys
sys.path.insert(0, os.environ["PYTHONPATH"].split(os.pathsep)[0])
import torch
import distributed, schedules, train
from model import Transformer
from dataset import TrainLoader
from checkpoint import (CheckpointManager, CheckpointState, ModelState, OptimizerState, RankInfo, RNGState, RunInfo,
                        TrainState, make_backend)

src, dst = os.environ["PROBE_SRC"], os.environ["PROBE_DST"]
args = train.build_parser().parse_args(sys.argv[1:])
env = distributed.init(args.distributed)
tokenizer, windows, config, _ = train.check_inputs(args, env)
model = distributed.parallelize(Transformer(config), env, args.parallel)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.lr_lambda(args.lr_warmup_steps, args.training_steps))
rank = RankInfo(env.rank, env.world_size, env.local_rank)
state = CheckpointState(model=ModelState(model, sharded=True), optimizer=OptimizerState(model, optimizer, sharded=True),
                        lr_scheduler=scheduler,
                        dataloader=TrainLoader(windows, args.batch_size, env.rank, env.world_size, args.seed),
                        train_state=TrainState(), rng=RNGState(), run_info=RunInfo())
step = CheckpointManager(src, make_backend("dcp", rank), rank, run_id="probe").load(src, state)
out = CheckpointManager(dst, make_backend("dcp", rank), rank, run_id="probe")
out.save(step, state)
out.close()
print(f"PROBE rank {env.rank}/{env.world_size}: loaded and re-saved step {step}", flush=True)
distributed.shutdown(env)
'''


@pytest.mark.parametrize("source,nproc,parallel,batch", [  # batch: per rank, keeping the saved global batch
    ("fsdp", 1, None, 8),    # 2 -> 1: FSDP shards into one plain process
    ("fsdp", 4, "fsdp", 2),  # 2 -> 4: re-sharded FSDP (4 ranks on 2 cores: tiny model)
    ("single", 2, "ddp", 2),  # 1 -> 2
])
def test_resharded_load_is_bitwise_and_training_continues(source, nproc, parallel, batch, corpus, tmp_path, reference):
    src = _step(reference[source], 4)
    saved_ranks = layout.verify(src)["world_size"]
    flags = TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--batch-size", str(batch)]
    flags += PARALLEL[parallel] if parallel else []
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    out = tmp_path / "resaved"
    proc = _ok(_run(nproc, flags, script=probe, env={"PROBE_SRC": str(src), "PROBE_DST": str(out)}))
    assert proc.stdout.count("loaded and re-saved step 4") == nproc
    resaved = layout.verify(_step(out, 4))
    assert resaved["world_size"] == nproc != saved_ranks
    _bitwise(src, _step(out, 4))  # weights + AdamW moments/steps after a load at M ranks == those saved by N ranks

    # ... and training continues from there at the new world size (same global batch: same data, same schedule)
    run = tmp_path / "run"
    run.mkdir()
    args = _args(corpus, run, *DCP, "--batch-size", str(batch), "--resume-from-checkpoint", str(src))
    proc = _ok(_run(nproc, args + (PARALLEL[parallel] if parallel else [])))
    assert "resumed from" in proc.stdout and f"world size: checkpoint {saved_ranks}, now {nproc}" in proc.stdout
    rows, ref_rows = loss_rows(run / "default/loss.csv"), loss_rows(reference[source] / "loss.csv")
    assert [int(r[0]) for r in rows] == list(range(5, STEPS + 1))
    # Another reduction order: equal up to float rounding, not bitwise. A wrong data position or lost AdamW moments
    # would change the losses by far more than this.
    for got, want in zip(rows, ref_rows[4:]):
        assert got[0] == want[0] and got[3] == want[3] and abs(float(got[1]) - float(want[1])) < 1e-4, (got, want)
    close = check_weights(run / "default", reference[source], "--tolerance", "1e-3", "--optimizer")
    assert close.returncode == 0, close.stdout + close.stderr


def test_resharding_to_a_global_batch_the_data_position_does_not_fit(corpus, tmp_path, reference):
    src = _step(reference["ddp"], 4)  # 4 steps x global batch 8: data position 32
    line = _one_error_line(_run(3, _args(corpus, tmp_path, *DCP, *PARALLEL["ddp"], "--resume-from-checkpoint", str(src))))
    assert "global sample 32" in line and "global batch 12" in line
    assert not (tmp_path / "default" / "loss.csv").exists() or csv_rows(tmp_path / "default" / "loss.csv") == 0


# --- formats: a checkpoint loads through the backend that wrote it; conversion ---------------------------------


def test_vanilla_configured_run_resumes_a_dcp_checkpoint(corpus, tmp_path, reference):
    args = _args(corpus, tmp_path, *PARALLEL["ddp"], "--resume-from-checkpoint", str(_step(reference["ddp"], 4)))
    proc = _ok(_run(2, args))
    assert "dcp backend" in proc.stdout  # loaded by the backend named in the manifest, not the configured one
    final = layout.verify(_step(tmp_path / "default", STEPS))
    assert final["backend"] == "vanilla"
    _bitwise(_step(reference["ddp"], STEPS), _step(tmp_path / "default", STEPS))  # across formats
    assert loss_rows(tmp_path / "default/loss.csv") == loss_rows(reference["ddp"] / "loss.csv")[4:]


def _cli(*a: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "checkpoint", *a], capture_output=True, text=True, cwd=ROOT, env=env_for_tests(),
                          timeout=300)


def test_convert_round_trip_and_fsdp_resumes_a_vanilla_checkpoint(corpus, tmp_path, reference):
    src = _step(reference["fsdp"], 8)
    out = _cli("convert", str(src), str(tmp_path / "vanilla/default"), "--to", "vanilla")
    assert out.returncode == 0 and "committed" in out.stdout, out.stderr
    out = _cli("convert", str(tmp_path / "vanilla/default"), str(tmp_path / "dcp"), "--to", "dcp")
    assert out.returncode == 0, out.stderr
    van, back = _step(tmp_path / "vanilla/default", 8), _step(tmp_path / "dcp", 8)
    assert layout.verify(van)["backend"] == "vanilla" and {"model.pt", "optimizer.pt"} <= set(layout.verify(van)["files"])
    assert layout.verify(back)["backend"] == "dcp" and layout.verify(back)["meta"]["converted_from"] == "vanilla"
    for a, b in ((src, van), (van, back), (src, back)):
        _bitwise(a, b)
    assert _cli("verify", str(tmp_path / "dcp")).returncode == 0
    again = _cli("convert", str(van), str(tmp_path / "dcp"), "--to", "dcp")
    assert again.returncode == 2 and "already holds a committed checkpoint" in again.stderr
    same = _cli("convert", str(src), str(tmp_path / "x"), "--to", "dcp")
    assert same.returncode == 2 and "already in dcp format" in same.stderr

    # A 2-rank FSDP run (dcp configured) resumes from the *vanilla* checkpoint: full tensors are scattered into the
    # shards; it then finishes exactly like the uninterrupted FSDP run.
    args = _args(corpus, tmp_path / "vanilla", *DCP, *PARALLEL["fsdp"], "--resume-from-checkpoint", "latest")
    proc = _ok(_run(2, args))
    assert "vanilla backend" in proc.stdout
    _bitwise(_step(reference["fsdp"], STEPS), _step(tmp_path / "vanilla/default", STEPS))
    assert loss_rows(tmp_path / "vanilla/default/loss.csv") == loss_rows(reference["fsdp"] / "loss.csv")[8:]


# --- bad input -----------------------------------------------------------------------------------------------------


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """Exit code 2 (torchrun: a rank's), one `error: ` line (identical on every rank), no traceback through our code
    (torchrun prints its own ChildFailedError traceback when a rank exits non-zero)."""
    if "torch.distributed.run" in proc.args:
        assert proc.returncode != 0 and "exitcode  : 2 " in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    else:
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    ours = [line for line in proc.stderr.splitlines() if line.strip().startswith(f'File "{ROOT}') and ".venv" not in line]
    assert not ours, proc.stderr[-3000:]
    # each rank checks the same flags and says the same line (ranks > 0 as "error (rank r): "); torchrun may stop rank 0
    # before it prints when another rank refused first, so the message, not rank 0's line, is what must be one
    said = [re.match(r"error(?: \(rank \d+\))?: (.*)", line) for line in proc.stderr.splitlines()]
    messages = {m.group(1) for m in said if m}
    assert len(messages) == 1, proc.stderr[-3000:]
    return "error: " + messages.pop()


def test_flag_combinations_only_dcp_can_do_are_refused_before_training(corpus, tmp_path):
    base = _args(corpus, tmp_path, "--training-steps", "2")
    line = _one_error_line(_run(2, base + PARALLEL["fsdp"]))
    assert "--parallel fsdp" in line and "--checkpoint-backend dcp" in line
    line = _one_error_line(_run(1, base + ["--async-checkpoint"]))
    assert "--async-checkpoint" in line
    line = _one_error_line(_run(1, base + ["--checkpoint-dir", "s3://some-bucket/x"]))
    assert "object storage" in line and "dcp" in line
    assert not (tmp_path / "default").exists() or not layout.list_checkpoints(tmp_path / "default")


def test_wrong_model_and_tampered_metadata(corpus, tmp_path, reference):
    src = _step(reference["single"], 4)
    # another --model preset: one line naming the first tensor that does not fit, both shapes
    line = _one_error_line(_run(1, _args(corpus, tmp_path, *DCP, "--model", "small", "--resume-from-checkpoint", str(src))))
    assert "does not fit this model" in line and "shape" in line

    # DCP's .metadata is a pickle: a tampered one (manifest re-sealed, so only the unpickler stands in the way) is
    # refused and its payload never runs
    ck = tmp_path / "tampered" / layout.step_dir_name(4)
    ck.parent.mkdir()
    subprocess.run(["cp", "-r", str(src), str(ck)], check=True)
    marker = tmp_path / "PWNED"
    (ck / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    files = json.loads((ck / "manifest.json").read_text())["files"]
    files[".metadata"] = layout.atomic_write_bytes(ck / ".metadata", (ck / ".metadata").read_bytes())
    (ck / "COMMITTED").unlink()
    layout.commit(ck, 4, 1, "dcp", [{"rank": 0, "files": files}])
    line = _one_error_line(_run(1, _args(corpus, tmp_path, *DCP, "--resume-from-checkpoint", str(ck))))
    assert "refusing to load" in line and "posix.system" in line
    assert not marker.exists()
    assert check_weights(ck, src).returncode == 2 and not marker.exists()  # the reader refuses it too


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))
