"""The node-local places after audit IV (issue 53, items 1, 3 and 4), through the real CLI: torchrun/gloo ranks, real
SIGKILLs of the whole job, real files, a real second user.

1. a restart whose peer copy fails its checksum chooses again, an older step, as the local tier alone does;
3. a tier folder removed while the run goes on is made again 0700 and this user's, with one line;
4. a backend that never reuses a retired payload file (vanilla, the default) keeps none, so the space check holds.

Two ranks on this one host stand for two nodes (PYRECOVER_TEST_RANKS_PER_NODE=1, knobs.py), as in test_tiered.py. One
killed two-node run is shared by the tests that only read or restart it (``killed``). A test that plays another user
of the node runs that part as `nobody` (setpriv, so it needs root); under CI=true it fails rather than skips.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (PY, ROOT, TINY, csv_rows, env_for_tests, in_ci, kill_run_at_row, kill_tree, run_torchrun,
                     run_train, torchrun_cmd)

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

TWO_NODES = {"PYRECOVER_TEST_RANKS_PER_NODE": "1"}
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
LOCAL_EVERY, KEEP = 2, 3


def _need(ok: bool, why: str) -> None:
    if not ok:
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)


def _args(corpus: str, ckpt: Path, local: Path, *, steps: int, every: int = LOCAL_EVERY, keep: int = KEEP,
          shared_every: int = 40) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ckpt), "--experiment_name", "run",
                   "--training-steps", str(steps), "--checkpoint-frequency", str(shared_every), "--log-loss-to-csv",
                   "--resume-from-checkpoint", "latest", "--local-checkpoint-dir", str(local),
                   "--local-checkpoint-frequency", str(every), "--local-checkpoint-keep", str(keep)]


def _tier(local: Path, ckpt: Path) -> Path:
    from checkpoint.places import tier_root

    return tier_root(local, "run", str(ckpt / "run"))


def _steps(folder: Path) -> set[int]:
    return {int(p.name[5:]) for p in folder.glob("step-*") if (p / "COMMITTED").exists()}


def _resumed(output: str) -> tuple[int, str]:
    m = re.search(r"resumed from (\S+) \(step (\d+), \w+ backend; ([^,]+(?:, \d+ from the shared tier)?)", output)
    assert m, output[-3000:]
    return int(m.group(2)), m.group(3)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, corpus):
    """Two emulated nodes with --peer-checkpoint, the default backend, the local tier every 2 steps keeping 3 and no
    shared step yet: the whole job SIGKILLed once every part of three local steps is on both nodes. Returns (args,
    ckpt, local, snapshot): ``snapshot`` holds the run's folders as the kill left them (a test that restarts the run
    puts them back first)."""
    base = tmp_path_factory.mktemp("killed")
    ckpt, local = base / "ckpt", base / "local"
    args = _args(corpus, ckpt, local, steps=30) + ["--peer-checkpoint"]
    mine = _tier(local, ckpt)

    def full() -> bool:  # three steps of which every part is committed on both nodes
        folders = [mine / "rank-00000", mine / "rank-00001", mine / "peer" / "rank-00000", mine / "peer" / "rank-00001"]
        return len(set.intersection(*(_steps(f) for f in folders))) >= KEEP

    kill_run_at_row(torchrun_cmd(2, args), ckpt / "run" / "loss.csv", 2 * KEEP * LOCAL_EVERY - 1,
                    env=env_for_tests({**TWO_NODES, "PYRECOVER_STEP_SLEEP": "0.3"}), ready=full)
    assert not list((ckpt / "run").glob("step-*")), "no shared step was meant to be saved before the kill"
    snapshot = base / "snapshot"
    for folder in (ckpt, local):
        shutil.copytree(folder, snapshot / folder.name, symlinks=True)
    return args, ckpt, local, snapshot


# --- 4. retired payload files pile up only where a save reuses them ------------------------------------------------


def test_the_default_backend_keeps_no_spares_of_retired_local_steps(killed):
    """vanilla writes every file anew: a retired local step's files are deleted, not kept in the tier's `.spare/` (where
    16 of them filled a tmpfs the space check had passed)."""
    _, ckpt, local, snapshot = killed
    mine = snapshot / "local" / _tier(local, ckpt).name
    for rank in ("rank-00000", "rank-00001"):
        held = _steps(mine / rank)
        assert len(held) == KEEP and min(held) > LOCAL_EVERY, f"{rank} retired no step: {held}"
        spares = sorted(p.name for p in (mine / rank).rglob("*") if ".spare" in p.parts)
        assert spares == [], f"{rank} keeps the files of retired steps no save reuses: {spares}"


def test_a_tmpfs_that_passes_the_space_check_holds_the_whole_run(corpus, killed, tmp_path):
    """A tmpfs sized for the local tier's keep + 1 parts and a half (what the space check asks for, and no more): the
    run saves locally at every step and ends cleanly; no retired step's files hold space there."""
    _need(os.geteuid() == 0 and shutil.which("mount") is not None, "needs root to mount a small tmpfs")
    _, ckpt, local, snapshot = killed
    sample = max((snapshot / "local" / _tier(local, ckpt).name / "rank-00000").glob("step-*"))
    part = sum(p.stat().st_size for p in sample.iterdir())
    keep = 2
    small = tmp_path / "small"
    small.mkdir()
    size = (keep + 1) * part + part // 2
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)], capture_output=True,
                          text=True)
    _need(done.returncode == 0, f"cannot mount a tmpfs ({done.stderr.strip()}); needs root")
    try:
        ckpt = tmp_path / "small-run"
        proc = run_train(_args(corpus, ckpt, small, steps=8, every=1, keep=keep, shared_every=4))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert (ckpt / "run" / "step-00000008" / "COMMITTED").exists()
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


# --- 1. a peer copy that fails its checksum: the ranks choose again ------------------------------------------------


def test_a_peer_copy_that_fails_its_checksum_gives_way_to_an_older_step_every_rank_holds(killed):
    """Node 1 is lost (its own parts and the copy of node 0 it kept); node 0's copy of rank 1's newest step has one
    byte flipped. There is no shared step. The restart must not start fresh (and then retire node 0's intact steps as
    'newer than step 0'): the copy is refused on both ends and removed, and the ranks take the step before it, rank 1
    from node 0's copy of it."""
    args, ckpt, local, snapshot = killed
    for folder in (ckpt, local):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(snapshot / folder.name, folder, symlinks=True)
    mine = _tier(local, ckpt)
    common = sorted(_steps(mine / "rank-00000") & _steps(mine / "peer" / "rank-00001"))
    assert len(common) >= 2, common
    shutil.rmtree(mine / "rank-00001")  # node 1 is lost
    shutil.rmtree(mine / "peer" / "rank-00000")
    damaged = mine / "peer" / "rank-00001" / f"step-{common[-1]:08d}" / "rank-00001.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    out = run_torchrun(2, args, env=TWO_NODES)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "starting fresh" not in text, text[-4000:]
    step, where = _resumed(text)
    assert (step, where) == (common[-2], "2 of 2 ranks from their local tier (1 from a peer copy)"), text[-4000:]
    assert f"warning: peer copy: step {common[-1]} of rank 1 not restored" in text, text[-4000:]
    assert f"peer copy: removed {damaged.parent}: not usable (" in text, text[-4000:]
    assert f"peer copy: step {common[-2]} for rank(s) 1 from a copy on another node" in text, text[-4000:]
    assert (ckpt / "run" / f"step-{common[-2]:08d}" / "COMMITTED").exists(), "the restored step was not drained"
    assert (ckpt / "run" / "step-00000030" / "COMMITTED").exists()


# --- 3. a tier folder removed while the run goes on ----------------------------------------------------------------


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60)


def _wait(condition, proc: subprocess.Popen, log: Path, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_tier_folder_removed_while_the_run_goes_on_is_made_again_private(corpus, node_tmp, tmp_path, nodes):
    """The whole --local-checkpoint-dir is removed between two local saves (a clean-up of /dev/shm): the next save
    makes it again 0700 and this user's, its run folder too, and says in one line per rank that it had disappeared,
    with the steps it held; on two emulated nodes with --peer-checkpoint, the peer copies' folders are made again
    inside it, one line each. `nobody` can neither list the run folder nor read a step or a peer copy."""
    _need(os.geteuid() == 0 and shutil.which("setpriv") is not None,
          "playing another user needs root and setpriv (util-linux)")
    local, ckpt = node_tmp / "tier", tmp_path / "ckpt"
    every = 4
    run_dir = _tier(local, ckpt)
    ranks = [f"rank-0000{r}" for r in range(nodes)]
    folders = [run_dir / r for r in ranks] + ([run_dir / "peer" / r for r in ranks] if nodes > 1 else [])
    args = _args(corpus, ckpt, local, steps=40, every=every, keep=2) + (["--peer-checkpoint"] if nodes > 1 else [])
    cmd = torchrun_cmd(nodes, args) if nodes > 1 else [PY, str(ROOT / "train.py"), *args]
    log = tmp_path / "run.log"
    with open(log, "w") as f:  # a file, not a pipe: nothing blocks the run while the test waits
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env=env_for_tests({**(TWO_NODES if nodes > 1 else {}), "PYRECOVER_STEP_SLEEP": "0.3"}))
    try:
        # right after step 4 is everywhere (the next save comes 3 steps, about a second, later)
        _wait(lambda: all(every in _steps(f) for f in folders) and csv_rows(ckpt / "run" / "loss.csv") > every,
              proc, log, "step 4")
        time.sleep(0.1)  # the peer thread notes what it keeps, right after it commits
        shutil.rmtree(local)
        _wait(lambda: all(2 * every in _steps(f) for f in folders), proc, log, "the next local save")
        for folder in (local, run_dir):
            st = folder.stat()
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), (folder, oct(st.st_mode))
        step = folders[-1] / f"step-{2 * every:08d}"
        for target, code in [(run_dir, "os.listdir(sys.argv[1])"), (folders[-1], "os.listdir(sys.argv[1])"),
                             (step / "model.pt", "open(sys.argv[1], 'rb').read(1)")]:
            peek = _as_nobody("/usr/bin/python3", "-c", f"import os, sys; {code}", str(target))
            assert peek.returncode != 0 and "Permission denied" in peek.stderr, (target, peek.stderr)
    finally:
        kill_tree(proc)
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if "had disappeared" in ln]
    # each rank says it once: the run folder (whoever came first to make it again) or its own folder in it
    said = f"had disappeared while the run went on, with this rank's steps {every}; made again"
    tier_lines = {f"warning: local tier: {run_dir} {said}, this user's alone (0700)"} | {
        f"warning: local tier: {run_dir / r} {said}" for r in ranks}
    assert len([ln for ln in lines if ln in tier_lines]) == nodes, text[-3000:]
    assert f"warning: local tier: {run_dir} {said}, this user's alone (0700)" in lines, text[-3000:]
    assert sorted(ln for ln in lines if ln not in tier_lines) == [
        f"warning: peer copy: {run_dir / 'peer' / r} had disappeared while the run went on, with the copies of rank "
        f"{int(r[5:])}'s steps {every}; made again" for r in (ranks if nodes > 1 else [])], text[-3000:]
