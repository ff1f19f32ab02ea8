"""The node-local tier (--local-checkpoint-dir, checkpoint/tier.py) through the real CLI: torchrun/gloo ranks, real
SIGKILLs of the whole job, real files.

Two ranks on this one host stand for two nodes (PYRECOVER_TEST_RANKS_PER_NODE=1, knobs.py): each is its own node's
leader, writes the shared pieces into its own local folder and loads only from there. The 2-node SLURM cluster tests
run the same with real hosts (tests/slurm/).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (PY, ROOT, TINY, check_weights, csv_rows, env_for_tests, in_ci, kill_run_at_row, loss_rows,
                     run_torchrun, run_train, torchrun_cmd)

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS, SHARED_EVERY, LOCAL_EVERY = 30, 20, 2
TWO_NODES = {"PYRECOVER_TEST_RANKS_PER_NODE": "1"}


def _args(corpus: str, ckpt: Path, local: Path | None) -> list[str]:
    args = TINY + ["--dataset", corpus, "--checkpoint-dir", str(ckpt), "--experiment_name", "run",
                   "--training-steps", str(STEPS), "--checkpoint-frequency", str(SHARED_EVERY), "--log-loss-to-csv",
                   "--resume-from-checkpoint", "latest"]
    if local is not None:
        args += ["--local-checkpoint-dir", str(local), "--local-checkpoint-frequency", str(LOCAL_EVERY)]
    return args


def _tier(local: Path, ckpt: Path) -> Path:
    """The run's folder in the local tier ``local`` (tier.py: its experiment name and a key of its shared folder)."""
    from checkpoint.places import tier_root

    return tier_root(local, "run", str(ckpt / "run"))


def _resumed(output: str) -> tuple[int, str]:
    """(step, where) of the `resumed from` line."""
    m = re.search(r"resumed from (\S+) \(step (\d+), \w+ backend; ([^,]+(?:, \d+ from the shared tier)?)", output)
    assert m, output[-3000:]
    return int(m.group(2)), m.group(3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    """An uninterrupted 2-rank run without a local tier: what every tiered run must end with, bit for bit."""
    ckpt = tmp_path_factory.mktemp("reference")
    run_torchrun(2, _args(corpus, ckpt, None), check=True, env=TWO_NODES)
    return ckpt / "run"


def test_whole_job_kills_resume_from_the_local_tier_then_a_swapped_node_from_the_shared_tier(tmp_path, corpus,
                                                                                              reference):
    """Seeded whole-job SIGKILLs with the local tier every 2 steps and the shared tier every 20:
    1. a kill before the first shared save, then rank 1's copy of the newest local step corrupted: the restart
       resumes from the step before it, from both ranks' local tiers, and drains that step;
    2. a kill after it, then rank 1's local folder wiped (its node replaced): the restart takes the shared tier;
    and the run ends bitwise equal to the uninterrupted one, every loss row once."""
    seed = int(os.environ.get("PYRECOVER_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    first, second = rng.randint(5, 17), rng.randint(23, 28)
    print(f"seed {seed}: kills after rows {first} and {second}")
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    # concurrent: its saves overwrite the retired local steps' files (tier.Spares), so reused files are in the run
    args, env = _args(corpus, ckpt, local) + ["--checkpoint-backend", "concurrent"], env_for_tests(TWO_NODES)
    csv = ckpt / "run" / "loss.csv"

    mine = _tier(local, ckpt)

    def committed() -> list[set[int]]:
        return [{int(p.name[5:]) for p in (mine / f"rank-0000{r}").glob("step-*") if (p / "COMMITTED").exists()}
                for r in (0, 1)]

    # The local saves commit in the background: the kill waits until the save of the last local step before row
    # `first` has committed on both ranks, so the restart's step is known to within one local interval.
    killed = kill_run_at_row(torchrun_cmd(2, args), csv, first, env=env,
                             ready=lambda: max(set.intersection(*committed()), default=0) >= first - LOCAL_EVERY)
    assert sorted(p.name for p in mine.iterdir()) == ["rank-00000", "rank-00001"]
    held = committed()
    common = sorted(held[0] & held[1])
    assert common and first - LOCAL_EVERY <= common[-1] <= killed + 1, (first, killed, held)
    expect = common[-1]
    if len(common) > 1:  # rank 1's copy of the newest common step is corrupted: both ranks take the one before
        damaged = mine / "rank-00001" / f"step-{common[-1]:08d}" / "rank-00001.pt"
        data = damaged.read_bytes()
        damaged.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        expect = common[-2]
    print(f"local steps held {held}; expected resume from {expect}")
    # The drain of step 20 to the shared tier runs in the background: steps slowed to 0.3 s give it the 3+ steps
    # before the crash (at 0.17 s steps, on a busy machine, the crash at step 24 could come first: seed 483664795).
    out = run_torchrun(2, args, env={**TWO_NODES, "PYRECOVER_CRASH_AT_STEP": f"{second + 1}:0",
                                     "PYRECOVER_STEP_SLEEP": "0.3"})
    step, where = _resumed(out.stdout + out.stderr)
    assert where == "2 of 2 ranks from their local tier", out.stdout[-2000:]
    assert step == expect, (held, step)
    assert (ckpt / "run" / f"step-{step:08d}" / "COMMITTED").exists(), "the restored step was not drained"
    shared = ckpt / "run" / f"step-{SHARED_EVERY:08d}" / "COMMITTED"
    assert shared.exists(), f"the crash at step {second + 1} came before step {SHARED_EVERY}'s drain committed"

    # rank 0 died after the forward pass of step second+1 (the job's other rank with it): rank 1's node is replaced
    shutil.rmtree(mine / "rank-00001")
    out = run_torchrun(2, args, check=True, env=TWO_NODES)
    step, where = _resumed(out.stdout + out.stderr)
    assert step == SHARED_EVERY and "from the shared tier" in where, (step, where)
    final = ckpt / "run" / f"step-{STEPS:08d}"
    assert check_weights(final, reference / f"step-{STEPS:08d}", "--optimizer").returncode == 0
    assert loss_rows(csv) == loss_rows(reference / "loss.csv")
    assert not mine.exists(), "a clean end leaves the local tier empty"


def test_peer_copy_restores_a_lost_nodes_newest_local_step_and_losing_its_buddys_copy_too_falls_back_to_shared(
        tmp_path, corpus, reference):
    """--peer-checkpoint on two emulated nodes (local tier every 2 steps, shared every 20); whole-job SIGKILLs:
    1. after the shared save of step 20, node 1 is lost: its own folder and the copy it held of node 0 are wiped. The
       restart takes the newest local step (not the shared step 20): rank 0 from its own tier, rank 1 from the copy
       its buddy (node 0) kept, over the peer group, verified;
    2. a crash later, node 1 is lost again, and so is the copy of it on its buddy: rank 1's newest part is gone
       everywhere, so the run says so in one line and resumes from the shared tier;
    and the run ends bitwise equal to the uninterrupted one, every loss row once."""
    seed = int(os.environ.get("PYRECOVER_TEST_SEED", random.randrange(1 << 30)))
    first = random.Random(seed).randint(23, 25)
    print(f"seed {seed}: kill after row {first}")
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    args, env = _args(corpus, ckpt, local) + ["--peer-checkpoint"], env_for_tests(TWO_NODES)
    csv = ckpt / "run" / "loss.csv"
    mine = _tier(local, ckpt)
    own, kept = (lambda r: mine / f"rank-0000{r}"), (lambda r: mine / "peer" / f"rank-0000{r}")

    def steps(folder: Path) -> set[int]:
        return {int(p.name[5:]) for p in folder.glob("step-*") if (p / "COMMITTED").exists()}

    def everywhere() -> int:  # the newest step of which every part is committed on both nodes
        return max(steps(own(0)) & steps(own(1)) & steps(kept(0)) & steps(kept(1)), default=0)

    killed = kill_run_at_row(torchrun_cmd(2, args), csv, first, env=env, ready=lambda: everywhere() >= first - 2)
    expect = everywhere()
    assert SHARED_EVERY < expect <= killed + 1, (expect, killed)
    # `list` by the run folder alone finds the tier through the run's config: both parts and both peer copies
    listing = subprocess.run([PY, "-m", "checkpoint", "list", str(ckpt / "run")], capture_output=True, text=True,
                             cwd=ROOT, env=env_for_tests(), timeout=120)
    assert re.search(rf"^\s+{expect}\s.*  local 2/2  peer: ranks 0,1\s+valid parts$", listing.stdout, re.M), \
        listing.stdout + listing.stderr
    shutil.rmtree(own(1))  # node 1 is lost: its own parts and the copy of node 0 it held
    shutil.rmtree(kept(0))
    out = run_torchrun(2, args, env={**TWO_NODES, "PYRECOVER_CRASH_AT_STEP": "29:0"})
    text = out.stdout + out.stderr
    step, where = _resumed(text)
    assert (step, where) == (expect, "2 of 2 ranks from their local tier (1 from a peer copy)"), text[-3000:]
    assert f"peer copy: step {expect} for rank(s) 1 from a copy on another node" in text, text[-3000:]
    assert (ckpt / "run" / f"step-{step:08d}" / "COMMITTED").exists(), "the restored step was not drained"

    shutil.rmtree(own(1))  # node 1 lost again, and its buddy's copy of it with it
    shutil.rmtree(kept(1), ignore_errors=True)
    shutil.rmtree(kept(0), ignore_errors=True)
    newest = max(steps(own(0)))
    out = run_torchrun(2, args, check=True, env=TWO_NODES)
    text = out.stdout + out.stderr
    step, where = _resumed(text)
    assert step == expect and where == "2 of 2 ranks from the shared tier" or "from the shared tier" in where, (
        step, where, text[-3000:])
    assert step == expect, (step, expect)  # the shared tier's newest: the step restored and drained above
    assert (f"peer copy: step {newest} is lost for rank(s) 1 (no surviving node holds their part); resuming from an "
            "older step") in text, text[-3000:]
    final = ckpt / "run" / f"step-{STEPS:08d}"
    assert check_weights(final, reference / f"step-{STEPS:08d}", "--optimizer").returncode == 0
    assert loss_rows(csv) == loss_rows(reference / "loss.csv")
    assert not mine.exists(), "a clean end leaves the local tier empty, peer copies included"


def test_two_ranks_of_one_node_read_ahead_their_leaders_pieces_and_resume_bitwise(tmp_path, corpus, reference):
    """Two ranks on one node: its leader (rank 0) holds the shared pieces, rank 1 only its own file. After a kill,
    rank 1's read-ahead plans its part and the leader's shared pieces and verifies and parses them before its load
    (shown in process: the plan needs no process group); the restart through the CLI loads both ranks from the
    local tier and ends bitwise."""
    from checkpoint import Session, Settings, When
    from checkpoint.backends.base import RankInfo

    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    args = _args(corpus, ckpt, local)
    killed = run_torchrun(2, args, env={"PYRECOVER_CRASH_AT_STEP": "9"})
    assert killed.returncode != 0, killed.stdout[-2000:]
    mine = _tier(local, ckpt)
    held = [{int(p.name[5:]) for p in (mine / f"rank-0000{r}").glob("step-*") if (p / "COMMITTED").exists()}
            for r in (0, 1)]
    newest = max(held[0] & held[1])
    for step in held[1] - held[0]:  # a save rank 0 did not commit before the kill: the restart cannot take it
        shutil.rmtree(mine / "rank-00001" / f"step-{step:08d}")
    own, leaders = mine / "rank-00001" / f"step-{newest:08d}", mine / "rank-00000" / f"step-{newest:08d}"
    assert sorted(p.name for p in own.glob("*.pt")) == ["rank-00001.pt"], "rank 1 holds its own file only"

    session = Session(Settings(checkpoint_dir=str(ckpt), experiment="run", local_dir=str(local), local_every=2,
                               when=When(every_steps=SHARED_EVERY, final_step=STEPS), resume="latest"),
                      RankInfo(1, 2, 1), agree=lambda v: v)
    ahead = session.prepare().reading
    assert ahead.wait(timeout=60)
    shared = sorted(p for p in leaders.glob("*.pt") if p.name != "rank-00000.pt")
    assert shared and sorted(map(str, (p for p, _ in ahead.files))) == sorted(map(str, [own / "rank-00001.pt",
                                                                                         *shared]))
    assert len(session._verified_ahead) == 1 + len(shared), "every planned file verified and parsed"

    out = run_torchrun(2, args, check=True)
    step, where = _resumed(out.stdout + out.stderr)
    assert (step, where) == (newest, "2 of 2 ranks from their local tier"), (step, where)
    final = ckpt / "run" / f"step-{STEPS:08d}"
    assert check_weights(final, reference / f"step-{STEPS:08d}", "--optimizer").returncode == 0
    assert loss_rows(ckpt / "run" / "loss.csv") == loss_rows(reference / "loss.csv")


def test_a_kill_during_a_local_write_falls_back_to_the_previous_local_step(tmp_path, corpus):
    """One process; SIGKILL in a local save with a file written but not yet fsynced: that save never committed, the
    restart takes the previous local step, and the run ends bitwise."""
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    args = _args(corpus, ckpt, local)
    proc = run_train(args, env={"PYRECOVER_FAULT": "after_write_before_fsync:16"})  # the 3rd local save's 1st files
    assert proc.returncode == -9, proc.stderr[-2000:]
    mine = _tier(local, ckpt) / "rank-00000"
    interrupted = [int(p.name[5:]) for p in mine.glob(".staging-*/step-*")]
    committed = [int(p.name[5:]) for p in mine.glob("step-*") if (p / "COMMITTED").exists()]
    assert len(interrupted) == 1 and committed and max(committed) == interrupted[0] - LOCAL_EVERY, (interrupted,
                                                                                                   committed)
    proc = run_train(args, check=True)
    step, where = _resumed(proc.stdout + proc.stderr)
    assert (step, where) == (max(committed), "1 of 1 ranks from their local tier"), (step, where)
    single = tmp_path / "single"
    run_train(_args(corpus, single, None), check=True)
    assert check_weights(ckpt / "run" / f"step-{STEPS:08d}", single / "run" / f"step-{STEPS:08d}",
                         "--optimizer").returncode == 0
    assert loss_rows(ckpt / "run" / "loss.csv") == loss_rows(single / "run" / "loss.csv")


def test_a_local_tier_of_another_run_is_never_used(tmp_path, corpus):
    """Other runs on the same --local-checkpoint-dir, with the same experiment name, after a kill left local steps:
    1. a run with another --checkpoint-dir, from a fresh start to its clean end: it keeps a folder of its own there,
       and reads, retires and removes none of the killed run's files;
    2. the killed run's shared folder deleted, then started again with `latest`: its local steps belong to the run
       that was deleted (another lineage), so the new run starts fresh and removes them."""
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    args = _args(corpus, ckpt, local)
    proc = run_train(args, env={"PYRECOVER_CRASH_AT_STEP": "9"})
    assert proc.returncode == -9
    mine = _tier(local, ckpt)
    assert list((mine / "rank-00000").glob("step-*")), "the killed run left no local step"

    def tree() -> dict:
        return {str(p.relative_to(mine)): (p.stat().st_ino, p.read_bytes()) for p in sorted(mine.rglob("*"))
                if p.is_file()}

    held = tree()
    other = tmp_path / "other"
    run_train(_args(corpus, other, local) + ["--training-steps", "4"], check=True)
    assert (other / "run" / "step-00000004" / "COMMITTED").exists()
    assert tree() == held, "another run changed the killed run's local tier"
    assert sorted(p.name for p in local.iterdir()) == [mine.name], "the other run left its local folder behind"

    listing = subprocess.run([PY, "-m", "checkpoint", "list", str(ckpt / "run"), "--local", str(local)],
                             capture_output=True, text=True, cwd=ROOT, env=env_for_tests(), timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"^\s+8\s.*\s48\.0  vanilla\s+1  local 1/1\s+valid parts$", listing.stdout, re.M), listing.stdout
    shutil.rmtree(ckpt / "run")
    proc = run_train(args[:-2] + ["--resume-from-checkpoint", "latest", "--training-steps", "4"], check=True)
    assert "starting fresh from step 0" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert "written by another run, job or layout (lineage differ)" in proc.stdout + proc.stderr


def test_a_local_tier_too_small_is_one_line(tmp_path, corpus):
    """A 4 MiB tmpfs (Docker's /dev/shm is 64 MiB) cannot hold this rank's parts: one line before the loop, exit 2,
    no traceback, no SIGBUS."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        assert not in_ci(), "CI runs as root: it must mount the small tmpfs"
        pytest.skip("needs root to mount a small tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        proc = run_train(_args(corpus, tmp_path / "ckpt", small))
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "loss" not in proc.stdout  # before the first step
    line = proc.stderr.strip().splitlines()[-1]
    assert "MiB free, but this rank's part of a checkpoint is" in line and "--local-checkpoint-keep" in line, line


def test_a_retired_local_step_gives_its_files_to_the_next_save(tmp_path):
    """Retention in the local tier un-commits a step and keeps its payload files as spares; the next save overwrites a
    spare in place (the same inode: no page allocation on tmpfs) with exactly its own bytes, shorter ones included.
    A step folder holding a file PyRecover did not write is refused and nothing moves."""
    from checkpoint import layout
    from checkpoint.backends import RankInfo
    from checkpoint.errors import CheckpointError
    from checkpoint.fsio import atomic_write, checksum_file
    from checkpoint.places import tier_root
    from checkpoint.places.tier import LocalTier

    origin = str(tmp_path / "shared" / "run")
    tier = LocalTier(tier_root(tmp_path, "run", origin), RankInfo(0, 1), leader=0, identity={"origin": origin},
                     spares=True)  # a backend that overwrites spares (concurrent)
    step = tier.root / layout.step_dir_name(2)
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(os.urandom(3 << 20))
    (step / "rank-00000.pt").write_bytes(b"small")  # under Spares.MIN_BYTES: not worth keeping
    (step / layout.COMMITTED).write_text("")
    inode = (step / "model.pt").stat().st_ino
    layout.remove_step_dir(step, "why", salvage=tier.spares.give)
    assert not step.exists()
    (spare,) = tier.spares.dir.iterdir()
    assert spare.stat().st_ino == inode

    data = os.urandom((2 << 20) + 123)
    out = tier.root / "model.pt"
    record = atomic_write(out, lambda w: w.write(data), reuse=tier.spares.take(len(data)))
    assert out.stat().st_ino == inode and out.read_bytes() == data
    assert (record["size"], record[layout.CHECKSUM_ALGORITHM]) == checksum_file(out)
    assert list(tier.spares.dir.iterdir()) == [] and tier.spares.take(1) is None

    foreign = tier.root / layout.step_dir_name(4)
    foreign.mkdir()
    (foreign / "model.pt").write_bytes(os.urandom(2 << 20))
    (foreign / "notes.txt").write_text("mine")
    (foreign / layout.COMMITTED).write_text("")
    with pytest.raises(CheckpointError, match="notes.txt"):
        layout.remove_step_dir(foreign, "move them out", salvage=tier.spares.give)
    assert (foreign / layout.COMMITTED).exists() and (foreign / "model.pt").exists()
    assert list(tier.spares.dir.iterdir()) == []

    # a payload file with a second name (a hard link made to keep the step) is not a spare: it is never overwritten
    pinned = tier.root / layout.step_dir_name(6)
    pinned.mkdir()
    kept = os.urandom(2 << 20)
    (pinned / "model.pt").write_bytes(kept)
    (pinned / layout.COMMITTED).write_text("")
    os.link(pinned / "model.pt", tmp_path / "my-copy.pt")
    layout.remove_step_dir(pinned, "why", salvage=tier.spares.give)
    assert list(tier.spares.dir.iterdir()) == [] and (tmp_path / "my-copy.pt").read_bytes() == kept

    # a clean end empties the rank's folder of what PyRecover wrote, and of nothing else
    (foreign / "notes.txt").unlink()
    out.unlink()
    (tier.root / ".staging-0123abcd" / "step-00000008").mkdir(parents=True)
    tier.spares.give(foreign)
    (tier.root / "README.mine").write_text("mine")
    tier.clear()
    assert sorted(p.name for p in tier.root.iterdir()) == ["README.mine"]
    (tier.root / "README.mine").unlink()
    tier.clear()
    assert not tier.root.parent.exists(), "an emptied run folder is removed"


def test_a_failed_drain_gives_up_on_the_shared_step_at_once_and_keeps_the_local_one(tmp_path):
    """A local file changed after its commit: its drain fails, the shared tier's folder is abandoned at once (a
    failure record there, so rank 0 does not wait out its commit timeout), the error comes back to the training
    thread, and the step stays protected from local retention (the local tier still holds it)."""
    from checkpoint.backends import RankInfo
    from checkpoint.errors import CheckpointError
    from checkpoint.fsio import atomic_write_bytes
    from checkpoint.places import tier_root
    from checkpoint.places.tier import Drainer, LocalTier

    tier = LocalTier(tier_root(tmp_path / "local", "run", str(tmp_path / "shared")), RankInfo(0, 1), leader=0,
                     identity={"origin": str(tmp_path / "shared")})
    staged = tier.save_dir("0123abcd", 2)
    files = {"model.pt": atomic_write_bytes(staged / "model.pt", os.urandom(1 << 20))}
    published = tier.commit(staged, 2, files, backend="vanilla", run_id="0123abcd", meta={}, guard=lambda what: None)
    (published / "model.pt").write_bytes(b"changed after its commit")
    landed, abandoned = [], []
    drainer = Drainer(tier, lambda *args, **kwargs: landed.append(args),
                      lambda where, error: abandoned.append((where, str(error))))
    shared = tmp_path / "shared" / "step-00000002"
    shared.mkdir(parents=True)
    drainer.submit(2, shared)
    with pytest.raises(CheckpointError, match="changed since its local commit"):
        drainer.wait()
    drainer.close()
    assert not landed and [where for where, _ in abandoned] == [shared], abandoned
    assert "changed since its local commit" in abandoned[0][1]
    assert drainer.protected() == {2}


# --- a local copy that differs from the shared tier's copy of the same step (issue #41, class 6) -------------------


def _stop_at_row(cmd: list[str], csv: Path, row: int, out: Path, env: dict | None = None) -> int:
    """Run ``cmd`` until its loss CSV has ``row`` rows, then SIGTERM every rank, as SLURM ends a job: the run saves at
    the next step boundary, in the local tier and drained to the shared one, and stops; its local tier stays (a stop
    is not a clean end). Returns the stop step; the output goes to ``out``."""
    with open(out, "w") as f:  # a file, not a pipe: nothing blocks the run while this waits for its rows
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=env_for_tests({**(env or {}), "PYRECOVER_STEP_SLEEP": "0.2"}))
        try:
            ranks = [proc.pid]
            deadline = time.monotonic() + 240
            while csv_rows(csv) < row or len(ranks := _ranks(proc)) < _nproc(cmd):
                assert proc.poll() is None, f"run ended (rc {proc.returncode}): {out.read_text()[-2000:]}"
                assert time.monotonic() < deadline
                time.sleep(0.02)
            for pid in ranks:
                os.kill(pid, signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    said = re.findall(r"saving and stopping at step (\d+): received SIGTERM", out.read_text())
    assert said and len(set(said)) == 1, out.read_text()[-3000:]
    return int(said[0])


def _nproc(cmd: list[str]) -> int:
    return next((int(a.split("=")[1]) for a in cmd if a.startswith("--nproc_per_node=")), 1)


def _ranks(proc: subprocess.Popen) -> list[int]:
    """The run's train.py processes: ``proc`` itself, or torchrun's children."""
    if _nproc(proc.args) == 1:
        return [proc.pid]
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else 0
            if parent == proc.pid and b"train.py" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _local_steps(rank_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in rank_dir.glob("step-*") if (p / "COMMITTED").exists())


def _reseal(step_dir: Path, older: Path) -> None:
    """Give a local step the payload of an ``older`` one and rewrite its manifest and COMMITTED as layout.commit does:
    on its own, the local step still verifies."""
    from checkpoint import layout
    from checkpoint.fsio import checksum_file

    manifest = json.loads((step_dir / layout.MANIFEST).read_text())
    for name in manifest["files"]:
        shutil.copyfile(older / name, step_dir / name)
        size, digest = checksum_file(step_dir / name)
        manifest["files"][name] = {"size": size, manifest["checksum"]: digest}
    layout.write_commit(step_dir, json.dumps(manifest, indent=1).encode())
    layout.verify(step_dir)


def _refused_once(output: str, copy: Path, why: str) -> None:
    """Exactly one line names the refused local ``copy`` (besides rank 0's read-ahead of it), and says ``why``."""
    lines = [line for line in output.splitlines() if str(copy) in line and not line.startswith("read ahead ")]
    assert len(lines) == 1, lines or output[-3000:]
    assert lines[0].startswith(f"local tier: removed {copy}: not usable (") and why in lines[0], lines[0]


def test_a_local_copy_resealed_with_older_weights_loses_to_the_shared_tiers_copy_of_that_step(tmp_path, corpus):
    """One rank. A stop saves step S in both tiers; then the local copy of S gets the payload of the local step before
    it and its manifest resealed, so it verifies on its own. The restart takes S from the shared tier, says so in one
    line naming the local copy, and the run ends bitwise equal to an uninterrupted one -- although the restart had
    read the tampered copy ahead while it set up."""
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    args = _args(corpus, ckpt, local)
    stop = _stop_at_row([PY, str(ROOT / "train.py"), *args], ckpt / "run" / "loss.csv", 5, tmp_path / "stop.log")
    mine = _tier(local, ckpt) / "rank-00000"
    held = _local_steps(mine)
    assert held[-1] == stop and len(held) == 2, held
    assert (ckpt / "run" / f"step-{stop:08d}" / "COMMITTED").exists()
    tampered = mine / f"step-{stop:08d}"
    _reseal(tampered, mine / f"step-{held[-2]:08d}")

    out = run_train(args, check=True)
    text = out.stdout + out.stderr
    assert (stop, "0 of 1 ranks from their local tier, 1 from the shared tier") == _resumed(text), text[-3000:]
    assert f"resumed from {ckpt / 'run' / f'step-{stop:08d}'} " in text
    ahead = rf"^read ahead [\d.]+ of [\d.]+ MiB of {re.escape(str(tampered))} while setting up"
    assert re.search(ahead, text, re.M), text[-3000:]  # it read the tampered copy, which the load then refused
    _refused_once(text, tampered, f"from its record in the shared tier's step {stop}; the rank loads the shared "
                                  "tier's copy instead)")
    single = tmp_path / "single"
    run_train(_args(corpus, single, None), check=True)
    final = f"step-{STEPS:08d}"
    same = check_weights(ckpt / "run" / final, single / "run" / final, "--optimizer", "--tolerance", "0")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(ckpt / "run" / "loss.csv") == loss_rows(single / "run" / "loss.csv")
    assert not _tier(local, ckpt).exists(), "a clean end leaves the local tier empty"


def test_two_ranks_of_one_node_load_a_step_both_tiers_hold_locally_unless_a_copy_differs(tmp_path, corpus,
                                                                                           reference):
    """Two ranks on one node, stopped twice with the stop's step in both tiers:
    1. untouched, both ranks load it from their local tier: rank 1's own file and its node leader's shared pieces
       match the shared tier's records;
    2. rank 1's local copy given its older step's file and resealed: rank 1 loads that step from the shared tier,
       rank 0 from its local tier, one line names rank 1's copy;
    and the run ends bitwise equal to the uninterrupted one."""
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    args, csv = _args(corpus, ckpt, local), ckpt / "run" / "loss.csv"
    first = _stop_at_row(torchrun_cmd(2, args), csv, 5, tmp_path / "first.log")
    second = _stop_at_row(torchrun_cmd(2, args), csv, first + 3, tmp_path / "second.log")
    step, where = _resumed((tmp_path / "second.log").read_text())
    assert (step, where) == (first, "2 of 2 ranks from their local tier"), (step, where)

    mine = _tier(local, ckpt) / "rank-00001"
    held = _local_steps(mine)
    assert held[-1] == second and len(held) == 2, held
    tampered = mine / f"step-{second:08d}"
    _reseal(tampered, mine / f"step-{held[-2]:08d}")
    out = run_torchrun(2, args, check=True)
    text = out.stdout + out.stderr
    assert _resumed(text) == (second, "1 of 2 ranks from their local tier, 1 from the shared tier"), text[-3000:]
    _refused_once(text, tampered, f"rank-00001.pt differs in size or xxh3_64 from its record in the shared tier's "
                                  f"step {second}; the rank loads the shared tier's copy instead)")
    final = f"step-{STEPS:08d}"
    same = check_weights(ckpt / "run" / final, reference / final, "--optimizer", "--tolerance", "0")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(csv) == loss_rows(reference / "loss.csv")


def test_a_local_part_of_a_line_the_run_left_is_never_a_candidate(tmp_path):
    """A node dropped from the job keeps its /dev/shm while the run resumes from an older step (a new line). Its
    parts beyond that step, written by the older generation, name this run in every field, yet are never chosen:
    the run folder records each resume (tier.record_resume), and a part written by an older generation beyond a later
    resume belongs to the line the run left (tier.abandoned). The new line's part of the same step is chosen."""
    from checkpoint import layout, storage
    from checkpoint.backends.base import RankInfo
    from checkpoint.places import tier_root
    from checkpoint.places.tier import FORKS, LocalTier, read_forks, record_resume

    run = tmp_path / "ckpt" / "run"
    run.mkdir(parents=True)
    identity = {"origin": str(run), "lineage": "L1", "job": ""}

    def tier(generation: int) -> LocalTier:
        return LocalTier(tier_root(tmp_path / "local", "run", str(run)), RankInfo(0, 1, 0), leader=0,
                         identity=identity, generation=generation)

    def save(t: LocalTier, step: int, data: bytes) -> None:
        step_dir = t.save_dir(f"g{t.generation}", step)
        (step_dir / "rank-00000.pt").write_bytes(data)
        size, digest = storage.checksum(step_dir / "rank-00000.pt")
        t.commit(step_dir, step, {"rank-00000.pt": {"size": size, "xxh3_64": digest}}, backend="vanilla",
                 run_id=f"g{t.generation}", meta={}, guard=layout.no_guard)

    old = tier(1)
    for step in (20, 22, 24):
        save(old, step, b"line 1")
    record_resume(run, "L1", 1, 0)  # generation 1 started the run
    assert sorted(old.committed(read_forks(run / FORKS, "L1"))) == [20, 22, 24]
    record_resume(run, "L1", 2, 20)  # generation 2 resumed from step 20 while this node was away
    forks = read_forks(run / FORKS, "L1")
    assert forks == [[1, 0], [2, 20]]
    assert sorted(old.committed(forks)) == [20], "a part of the line the run left is a candidate"
    new = tier(2)
    save(new, 22, b"line 2")  # the new line's step 22 replaces the old one's
    assert sorted(new.committed(forks)) == [20, 22]
    assert (new.committed(forks)[22].path / "rank-00000.pt").read_bytes() == b"line 2"
    assert read_forks(run / FORKS, "another lineage") == [], "another lineage's resumes apply to nothing here"
