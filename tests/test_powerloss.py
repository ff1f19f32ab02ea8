"""Power loss: the recording filesystem's self-tests (it must catch the classic durability bugs, and the project's
own protocol must survive it), the regression test of each bug it found, and a quick campaign over real training.
The long campaign over every backend and the mirror is `make powerloss` (tests/powerloss/campaign.py).

Runs as root with /dev/fuse, fusermount3 (apt fuse3) and mfusepy (test extra); CI has all three, elsewhere the
tests skip with the reason."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers import in_ci

from checkpoint import fsio
from tests.powerloss import campaign, model
from tests.powerloss.recorder import Mount, _mounted, fuse_problem

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

OLD, NEW = b"old " * 3000, b"new " * 5000  # more than a page, so a torn write shows


@pytest.fixture
def mount(tmp_path):
    if problem := fuse_problem():
        if in_ci():
            pytest.fail(f"the recording filesystem cannot run: {problem}")
        pytest.skip(f"the recording filesystem cannot run here: {problem}")
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "data").write_bytes(OLD)  # there before the mount: durable
    with Mount(backing, tmp_path / "mnt", tmp_path / "log") as m:
        yield m
    m.ops = model.load(tmp_path / "log")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _contents(m: Mount, name: str, profiles=model.PROFILES, variants: int = 3) -> dict:
    """Every crash state's bytes of ``name`` (None: missing), per profile, and the state after the last operation."""
    seen = {}
    for profile in profiles:
        for k, v, state, _ in model.states(m.ops, profile, variants=variants, seed=7):
            if name not in state:
                seen.setdefault(profile, set()).add(None)
                continue
            out = m.log_dir.parent / f"s-{profile}-{k}-{v}"
            model.materialize({name: state[name]}, m.ops, m.log_dir, out)
            seen.setdefault(profile, set()).add((out / name).read_bytes())
    return seen


def _final(m: Mount, name: str, profile: str) -> bytes | None:
    state = model.state_at(m.ops, len(m.ops), profile)
    if name not in state:
        return None
    out = m.log_dir.parent / f"final-{profile}"
    model.materialize({name: state[name]}, m.ops, m.log_dir, out)
    return (out / name).read_bytes()


# --- the layer catches what it must -----------------------------------------------------------------------------------
def test_write_and_rename_without_fsync_loses_the_file_under_posix_not_under_ext4(mount):
    mnt = mount.mountpoint
    (mnt / "data.tmp").write_bytes(NEW)  # no fsync of the data
    os.replace(mnt / "data.tmp", mnt / "data")
    _fsync(mnt)
    mount.unmount()
    assert (mount.backing / "data").read_bytes() == NEW  # what the process saw
    mount.ops = model.load(mount.log_dir)
    # strict POSIX: the rename is durable, its data is not: the file is empty -- neither old nor new
    assert _final(mount, "data", "posix") == b""
    # ext4's auto_da_alloc flushes the data of a file renamed over another one: this exact bug is hidden there
    assert all(c in (OLD, NEW) for c in _contents(mount, "data", ["ext4"])["ext4"])


def test_a_missing_directory_fsync_loses_the_rename(mount):
    mnt = mount.mountpoint
    (mnt / "data.tmp").write_bytes(NEW)
    _fsync(mnt / "data.tmp")
    os.replace(mnt / "data.tmp", mnt / "data")  # the caller would now report "saved": but the folder is not fsynced
    mount.unmount()
    mount.ops = model.load(mount.log_dir)
    for profile in model.PROFILES:
        assert _final(mount, "data", profile) == OLD, profile
    mount.crash("posix")  # the same, as files: the backing folder now holds only what survived
    assert sorted(os.listdir(mount.backing)) == ["data"] and (mount.backing / "data").read_bytes() == OLD


def test_a_commit_marker_written_before_the_data_is_durable_commits_garbage(mount):
    mnt = mount.mountpoint
    (mnt / "step").mkdir()
    (mnt / "step" / "payload").write_bytes(NEW)  # never fsynced
    fsio.atomic_write_bytes(mnt / "step" / "COMMITTED", b"1")
    _fsync(mnt)
    mount.unmount()
    mount.ops = model.load(mount.log_dir)
    state = model.state_at(mount.ops, len(mount.ops), "posix")
    assert "step/COMMITTED" in state
    out = mount.log_dir.parent / "final"
    model.materialize(state, mount.ops, mount.log_dir, out)
    assert (out / "step" / "payload").read_bytes() != NEW  # committed, and the payload did not survive


def test_the_projects_atomic_write_survives_every_crash_state(mount):
    fsio.atomic_write_bytes(mount.mountpoint / "data", NEW)
    mount.unmount()
    mount.ops = model.load(mount.log_dir)
    seen = _contents(mount, "data")
    for profile in model.PROFILES:
        assert seen[profile] <= {OLD, NEW}, profile  # never torn, empty or missing
        assert _final(mount, "data", profile) == NEW, profile  # and durable once it returned


def test_new_folders_are_durable_once_make_dirs_returns(mount):
    """Regression (found by the campaign): the run folder was made with mkdir -p and never fsynced into its parent,
    so under strict POSIX a power cut could lose the whole run folder, every reported checkpoint in it."""
    mnt = mount.mountpoint
    (mnt / "plain" / "run").mkdir(parents=True)
    fsio.atomic_write_bytes(mnt / "plain" / "run" / "f", NEW)
    fsio.make_dirs(mnt / "ck" / "run")
    fsio.atomic_write_bytes(mnt / "ck" / "run" / "f", NEW)
    mount.unmount()
    mount.ops = model.load(mount.log_dir)
    state = model.state_at(mount.ops, len(mount.ops), "posix")
    assert "plain/run/f" not in state  # the bug, as the layer shows it
    assert "ck/run/f" in state  # the fix


def test_the_mount_is_gone_after_a_failure_inside_it(tmp_path):
    if problem := fuse_problem():
        pytest.fail(problem) if in_ci() else pytest.skip(problem)
    m = Mount(tmp_path / "b", tmp_path / "m", tmp_path / "log")
    with pytest.raises(RuntimeError, match="inside"):
        with m:
            (tmp_path / "m" / "x").write_bytes(b"x")
            raise RuntimeError("a failure inside the mount")
    assert not _mounted(tmp_path / "m")
    assert m.proc.poll() is not None
    assert subprocess.run(["grep", "-c", str(tmp_path / "m"), "/proc/mounts"], capture_output=True,
                          text=True).stdout.strip() == "0"


# --- a quick campaign over real training ------------------------------------------------------------------------------
def test_quick_campaign_vanilla_strict_posix(tmp_path):
    """Every crash point of a real fresh run under strict POSIX (the lease, the token cache, three saves, two
    retentions, the end), each distinct durable state resumed to the end and compared bitwise. `make powerloss` adds
    the dcp and concurrent backends, the mirror, the start-up sweep and retirement traces, the ext4 and NFS profiles,
    seeded variants and the export's swap. Compared with the traced run itself (uninterrupted, the same flags): the
    crash states before its first checkpoint resume from nothing on the plain disk, so a traced run that the recording
    filesystem had changed would not match them; `make powerloss` compares with a run of its own."""
    if problem := fuse_problem():
        pytest.fail(problem) if in_ci() else pytest.skip(problem)
    r = campaign.campaign("vanilla", tmp_path, ["posix"], variants=0, max_runs=0, seed=0, jobs=2, scenarios=("run",),
                          trace_as_reference=True)
    assert r["reported"] == {"run": [2, 4, 6]}
    assert r["tried"] == r["ops"]["run"]  # every crash point after the (empty) mount-time state
    assert r["ran"] == r["distinct"] >= 10 and r["checked"] == r["tried"]  # every distinct state resumed
    assert r["lost"] == [] and r["mismatched"] == [], r["lost"] + r["mismatched"]


def _unsynced_tails(ops: list) -> list[tuple[str, str]]:
    """(folder, file) of every file whose last write came after its last fsync: a tail no fsync covered."""
    names, last_write, last_fsync = {0: ""}, {}, {}
    parent = {}
    for i, op in enumerate(ops):
        if op[0] in ("create", "mkdir"):
            names[op[4]], parent[op[4]] = op[3], op[2]
        elif op[0] in ("write", "truncate"):
            last_write[op[2]] = i
        elif op[0] == "fsync":
            last_fsync[op[2]] = i
    return sorted((names[parent[n]], names[n]) for n, w in last_write.items() if last_fsync.get(n, -1) < w)


def test_dcp_files_are_flushed_before_dcp_fsyncs_them(mount):
    """Regression, of torch's writer: FileSystemWriter(sync_files=True) fsyncs a buffered stream without flushing it
    (upstream torch/distributed/checkpoint/filesystem.py, FileSystemWriter.finish: pickle.dump into
    open(path, "wb"), then os.fsync(stream.fileno())), so a small .metadata reaches the kernel only at close, after
    its fsync: a power cut keeps a committed-looking name over missing bytes. Our stream flushes before DCP fsyncs."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from checkpoint.backends.dcp import _writer

    state = {"w": torch.arange(10.0)}
    dcp.save(state, storage_writer=FileSystemWriter(mount.mountpoint / "torch", sync_files=True), no_dist=True)
    dcp.save(state, storage_writer=_writer(mount.mountpoint / "ours"), no_dist=True)
    mount.unmount()
    tails = _unsynced_tails(model.load(mount.log_dir))
    assert ("torch", ".metadata.tmp") in tails  # the upstream gap, as the layer records it
    assert [t for t in tails if t[0] == "ours"] == []  # every byte our writer wrote was fsynced


def test_replacing_an_export_keeps_out_whole_in_every_crash_state(mount):
    """Regression (found by the campaign): `hf.py export --force` renamed OUT aside and then the new export in; a
    power cut between the two (both pending until one folder fsync) could leave no OUT at all. Now the two swap in
    one RENAME_EXCHANGE."""
    import hf

    mnt = mount.mountpoint
    for name, content in (("out", OLD), (".out.export-x", NEW)):
        (mnt / name).mkdir()
        for f in ("config.json", "model.safetensors"):
            fsio.atomic_write_bytes(mnt / name / f, content)
    _fsync(mnt)
    begin = time.monotonic_ns()
    hf._publish(mnt / ".out.export-x", mnt / "out")
    mount.unmount()
    mount.ops = model.load(mount.log_dir)
    start = sum(1 for op in mount.ops if op[1] < begin)  # crash points from the swap on
    old = {"config.json": OLD, "model.safetensors": OLD}
    new = {"config.json": NEW, "model.safetensors": NEW}
    for profile in model.PROFILES:
        for k, v, state, _ in model.states(mount.ops, profile, start=start, variants=3, seed=3):
            assert model.files(state, mount.ops, mount.log_dir, "out") in (old, new), (profile, k, v)
        assert model.files(model.state_at(mount.ops, len(mount.ops), profile), mount.ops, mount.log_dir, "out") == new


def test_a_torn_loss_csv_tail_is_dropped_on_resume(mount):
    """Regression (found by the campaign, mirror configuration, ext4): rows appended after the last sync survived as
    zeros, and the resume died on int('\\x00...'). Rows up to the synced checkpoint must survive whole; the rest go."""
    from metrics import LossCSV

    path = mount.mountpoint / "e" / "loss.csv"
    log = LossCSV(path, None)
    for step in (1, 2, 3, 4):
        log.row(step=step, loss=repr(1.0 / step), lr="0.001", tokens_seen=128 * step, wall_time="0", restart=0)
        if step == 2:
            log.sync()  # the checkpoint of step 2
            begin = time.monotonic_ns()
    log.file.close()
    mount.unmount()
    ops = model.load(mount.log_dir)
    start = sum(1 for op in ops if op[1] < begin)
    torn = 0
    for profile in model.PROFILES:
        for k, v, state, _ in model.states(ops, profile, start=start, variants=4, seed=5):
            out = mount.log_dir.parent / f"csv-{profile}-{k}-{v}"
            model.materialize(state, ops, mount.log_dir, out)
            torn += b"\0" in (out / "e" / "loss.csv").read_bytes()
            kept = LossCSV(out / "e" / "loss.csv", 2)
            kept.file.close()
            with open(out / "e" / "loss.csv") as f:
                assert [line.split(",")[0] for line in f.read().splitlines()] == ["step", "1", "2"], (profile, k, v)
    assert torn  # the layer did produce torn tails here
