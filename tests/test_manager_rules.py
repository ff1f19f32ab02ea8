"""The ordering rules of CheckpointManager and layout, in process, over a fake backend (fast; no training, no torchrun).

The end-to-end tests (test_checkpoint, test_faults, ...) run the real CLI in subprocesses; these pin down, one rule per
test, what the manager and the on-disk layout guarantee about order: what retention may delete and when, that COMMITTED
is written last and `latest` only returns what verifies, how a background error surfaces, what ``wait_staged`` and
``close`` wait for, and what ``open`` / ``follow`` / ``publish`` move, sweep or keep.

The fake backend writes tiny files in the vanilla backend's format (so ``load`` restores them) and returns a payload
handle the test controls through a ``Gate``: its save is not staged until the test says so, not durable until the test
releases it, and may raise an error from its background work. Every synchronisation is an Event, never a sleep.
"""

from __future__ import annotations

import errno
import io
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers import ROOT, LogLines

sys.path.insert(0, str(ROOT))
from checkpoint import layout, storage  # noqa: E402
from checkpoint.backends.base import Backend, CompletedPayload, PayloadHandle, RankInfo  # noqa: E402
from checkpoint.backends.torchfile import load_pieces, payload_pieces  # noqa: E402
from checkpoint.errors import CheckpointError  # noqa: E402
from checkpoint.manager import CheckpointManager  # noqa: E402
from checkpoint.retention import Retention, apply_retention  # noqa: E402
from checkpoint.state import CheckpointState  # noqa: E402

TIMEOUT = 10.0  # an Event the test forgot to set fails the test instead of hanging it
RUN = "run-a"
pytestmark = pytest.mark.timeout(30, method="thread")  # a regression that deadlocks (e.g. an error re-raised forever) fails, not hangs


# --- fakes -----------------------------------------------------------------------------------------------------------


class Value:
    """A tiny Stateful piece."""

    def __init__(self, v: int = 0):
        self.v = v

    def state_dict(self) -> dict:
        return {"v": self.v}

    def load_state_dict(self, state_dict: dict) -> None:
        self.v = state_dict["v"]



def pending(m: CheckpointManager) -> int:
    """Saves in flight whose bytes are not yet committed."""
    return sum(not h.done() for h in m.in_flight)

def make_state(v: int = 0) -> CheckpointState:
    # one shared piece (model.pt) and one per-rank piece (rank-00000.pt)
    return CheckpointState(model=Value(v), dataloader=Value(v))


class Gate:
    """The test's control over one save: ``staged`` (state captured), ``released`` (bytes may become durable), an
    ``error`` to raise from the background instead, and events telling the test where the save has got to."""

    def __init__(self, *, staged: bool = True, error: BaseException | None = None):
        self.staged = threading.Event()
        self.released = threading.Event()
        self.entered_staged = threading.Event()
        self.entered_wait = threading.Event()
        self.finished = threading.Event()
        self.error = error
        if staged:
            self.staged.set()

    def release(self) -> None:
        self.staged.set()
        self.released.set()


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(TIMEOUT):
        raise AssertionError(f"test bug: {what} never happened")


def _in_thread(fn) -> tuple[threading.Thread, threading.Event]:
    """Run ``fn`` in a daemon thread; the Event is set once it returned."""
    returned = threading.Event()

    def run():
        fn()
        returned.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, returned


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_all(step_dir: Path, blobs: dict[str, bytes]) -> dict[str, dict]:
    return {name: storage.write_bytes(step_dir / name, data) for name, data in blobs.items()}


class GatedPayload(PayloadHandle):
    def __init__(self, step_dir: Path, blobs: dict[str, bytes], gate: Gate):
        self.step_dir, self.blobs, self.gate = step_dir, blobs, gate

    def wait_staged(self) -> None:
        self.gate.entered_staged.set()
        _wait(self.gate.staged, "staging")

    def wait(self) -> dict[str, dict]:
        self.gate.entered_wait.set()
        try:
            _wait(self.gate.released, "release")
            if self.gate.error is not None:
                raise self.gate.error
            return _write_all(self.step_dir, self.blobs)
        finally:
            self.gate.finished.set()

    def done(self) -> bool:
        return self.gate.finished.is_set()


class FakeBackend(Backend):
    """Writes the vanilla backend's files (``name`` is "vanilla": a manifest only names known backends, and `load`
    picks the loader by that name). A save of a step with a gate registered is gated; any other completes at once."""

    name = "vanilla"

    def __init__(self, max_in_flight: int = 1):
        super().__init__(RankInfo())
        self.max_in_flight = max_in_flight
        self.gates: dict[int, Gate] = {}
        self.used: list[Gate] = []
        self.closed = False
        self.unfinished_at_close: list[Gate] | None = None

    def gate(self, step: int, **kw) -> Gate:
        self.gates[step] = Gate(**kw)
        return self.gates[step]

    def save(self, step_dir: Path, state: CheckpointState) -> PayloadHandle:
        step = int(layout.STEP_DIR_RE.match(step_dir.name).group(1))
        # The state is captured (serialised) now, as a real backend's staging copy would be.
        blobs = {name: _torch_bytes(obj) for name, obj in payload_pieces(state, self.rank.rank).items()}
        gate = self.gates.pop(step, None)
        if gate is None:
            return CompletedPayload(_write_all(step_dir, blobs))
        self.used.append(gate)
        return GatedPayload(step_dir, blobs, gate)

    def load(self, step_dir: Path, manifest: dict, state: CheckpointState, *, verified: dict | None = None) -> None:
        load_pieces(step_dir, manifest, state, self.rank.rank, verified)

    def close(self) -> None:
        self.closed = True
        self.unfinished_at_close = [g for g in self.used if not g.finished.is_set()]

    def release_all(self) -> None:
        for g in [*self.used, *self.gates.values()]:
            g.release()


@pytest.fixture
def root(tmp_path) -> Path:
    r = tmp_path / "run"
    r.mkdir()
    return r


@pytest.fixture
def make_manager(root):
    made: list[FakeBackend] = []

    def make(*, keep: int = 0, keep_every: int = 0, max_in_flight: int = 1, run_id: str = RUN) -> CheckpointManager:
        backend = FakeBackend(max_in_flight)
        m = CheckpointManager(root, backend, RankInfo(), run_id=run_id,
                              retention=Retention(keep=keep, keep_every=keep_every))
        m.logs = LogLines()
        made.append(backend)
        return m

    yield make
    for backend in made:  # no background commit is left blocked on a gate
        backend.release_all()
    for t in threading.enumerate():
        if t.name.startswith("ckpt-commit-"):
            t.join(TIMEOUT)


def settle(handle) -> None:
    """Let a released save's background commit run to its end, without consuming its outcome (that is the manager's)."""
    for t in threading.enumerate():
        if t.name == f"ckpt-commit-{handle.step}":
            t.join(TIMEOUT)
    assert handle.done()


# --- helpers over the layout -----------------------------------------------------------------------------------------


def commit_step(root: Path, step: int, data: bytes | None = None, *, folder: Path | None = None) -> Path:
    """A committed checkpoint written directly through layout (one payload file)."""
    step_dir = folder or root / layout.step_dir_name(step)
    step_dir.mkdir(parents=True)
    rec = storage.write_bytes(step_dir / "model.pt", data if data is not None else f"step {step}".encode())
    layout.commit(step_dir, step, 1, "vanilla", [{"rank": 0, "files": {"model.pt": rec}}])
    return step_dir


def committed(root: Path) -> list[int]:
    return [i.step for i in layout.list_checkpoints(root) if i.committed]


def present(root: Path) -> list[int]:
    return [i.step for i in layout.list_checkpoints(root)]


def latest(root: Path, warnings: list[str] | None = None) -> int | None:
    lines = LogLines()
    info = layout.resolve(root, "latest")
    if warnings is not None:
        warnings.extend(lines)
    return None if info is None else info.step


def staged_dir(root: Path, step: int, run_id: str = RUN) -> Path:
    return layout.staging_dir(root, run_id, step)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# --- retention (retention.apply_retention) ------------------------------------------------------------------------------


def test_retention_orders_steps_by_number_not_by_name(root):
    steps = [99_999_998, 99_999_999, 100_000_000, 100_000_001]
    for s in steps:
        commit_step(root, s)
    names = sorted(p.name for p in root.iterdir())
    assert names[0] == layout.step_dir_name(100_000_000)  # by name, the 9-digit steps sort first
    assert present(root) == steps

    assert apply_retention(root, 2) == [99_999_998, 99_999_999]
    assert present(root) == [100_000_000, 100_000_001]
    assert latest(root) == 100_000_001


def test_retention_keep_every_milestones_survive(root):
    for s in range(2, 13, 2):
        commit_step(root, s)
    logs = LogLines()
    assert apply_retention(root, 2, keep_every=4) == [2, 6]
    assert committed(root) == [4, 8, 10, 12]  # the newest 2, plus every multiple of 4
    assert logs == ["retention: removed step-00000002", "retention: removed step-00000006"]
    # keep=0 means keep everything (milestones or not)
    assert apply_retention(root, 0) == []
    assert committed(root) == [4, 8, 10, 12]


def test_retention_spares_in_flight_and_newest_and_newer_partials(root):
    """An in-place save in flight (object storage) may be an uncommitted folder, or a committed one it is replacing;
    neither is touched, nor the newest committed checkpoint, nor an uncommitted folder newer than it."""
    for s in (1, 2, 4):
        commit_step(root, s)
    (root / layout.step_dir_name(3)).mkdir()  # uncommitted, older than the newest commit
    (root / layout.step_dir_name(5)).mkdir()  # uncommitted, newer than the newest commit

    assert apply_retention(root, 1, in_flight={1, 3}) == [2]
    assert present(root) == [1, 3, 4, 5]
    # Once nothing is in flight: 1 goes (beyond keep), 3 is a stale partial; 4 (newest) and 5 (newer) stay.
    assert apply_retention(root, 1) == [1, 3]
    assert present(root) == [4, 5] and committed(root) == [4]
    assert latest(root) == 4


def test_retention_sweeps_dead_staging_and_trash_only(root):
    commit_step(root, 1)
    commit_step(root, 2)
    other = root / ".staging-run-dead"
    (other / layout.step_dir_name(3)).mkdir(parents=True)
    own = root / f".staging-{RUN}"
    (own / layout.step_dir_name(4)).mkdir(parents=True)  # our own save in flight
    trash = root / ".trash-step-00000001-x"
    trash.mkdir()

    assert apply_retention(root, 0, own_staging=own.name) == []
    assert committed(root) == [1, 2]
    assert not other.exists() and not trash.exists()
    assert (own / layout.step_dir_name(4)).is_dir()


# --- commit order, `latest` ------------------------------------------------------------------------------------------


def test_committed_is_written_last_and_published_after(root, make_manager, monkeypatch):
    m = make_manager()
    target = root / layout.step_dir_name(7)
    writes: list[tuple[str, bool]] = []
    real = storage.write_bytes

    def recording(path, data):
        writes.append((Path(str(path)).name, target.exists()))
        return real(path, data)

    monkeypatch.setattr(storage, "write_bytes", recording)
    m.save(7, make_state(7))
    m.wait()

    names = [n for n, _ in writes]
    assert names[-3:] == [layout.part_record_name(0), layout.MANIFEST, layout.COMMITTED]
    assert set(names[:-3]) == {"model.pt", "rank-00000.pt"}
    assert not any(published for _, published in writes)  # nothing is visible as step-7 while it is written
    assert committed(root) == [7] and latest(root) == 7


def test_latest_never_returns_a_folder_without_committed(root, monkeypatch):
    commit_step(root, 2)

    def crash(name, where=""):
        if name == "after_manifest_before_commit":
            raise OSError(errno.EIO, "crash between manifest and COMMITTED")

    monkeypatch.setattr(layout, "fault_point", crash)
    with pytest.raises(OSError):
        commit_step(root, 4)
    assert (root / layout.step_dir_name(4) / layout.MANIFEST).is_file()
    assert not (root / layout.step_dir_name(4) / layout.COMMITTED).exists()
    (root / layout.step_dir_name(6)).mkdir()  # payload only, not even a manifest

    warnings: list[str] = []
    assert latest(root, warnings) == 2
    assert len(warnings) == 2 and all("not committed" in w for w in warnings)
    assert layout.step_dir_name(6) in warnings[0] and layout.step_dir_name(4) in warnings[1]
    with pytest.raises(CheckpointError, match="not committed"):  # asked for by number: an error, never another one
        layout.resolve(root, "4")


@pytest.mark.parametrize("damage", ["checksum", "size"])
def test_latest_skips_a_corrupted_checkpoint_with_a_warning(root, damage):
    for s in (1, 2, 3):
        commit_step(root, s)
    payload = root / layout.step_dir_name(3) / "model.pt"
    if damage == "checksum":
        flip_last_byte(payload)  # same size: only the checksum can tell
    else:
        payload.write_bytes(payload.read_bytes()[:-1])

    warnings: list[str] = []
    assert latest(root, warnings) == 2
    assert len(warnings) == 1 and layout.step_dir_name(3) in warnings[0]
    assert ("checksum" if damage == "checksum" else "manifest says") in warnings[0]
    with pytest.raises(CheckpointError):
        layout.resolve(root, "3")


def test_load_latest_falls_back_to_the_next_older_verified(root, make_manager):
    m = make_manager()
    for s in (1, 2, 3):
        m.save(s, make_state(s * 10))
    m.wait()
    flip_last_byte(root / layout.step_dir_name(3) / "model.pt")
    (root / layout.step_dir_name(2) / layout.MANIFEST).write_text("{}")  # no longer matches its COMMITTED marker

    state = make_state(0)
    assert m.load("latest", state) == 1
    assert state["model"].v == 10 and state["dataloader"].v == 10
    skipped = [line for line in m.logs if line.startswith("warning: skipping")]
    assert len(skipped) == 2
    assert layout.step_dir_name(3) in skipped[0] and layout.step_dir_name(2) in skipped[1]


# --- saves in flight and retention (manager) ---------------------------------------------------------------------------


def test_keep1_last_committed_stays_until_the_newer_save_commits(root, make_manager):
    m = make_manager(keep=1)
    m.save(1, make_state(1))
    gate = m.backend.gate(2)
    h = m.save(2, make_state(2))

    _wait(gate.entered_wait, "the background commit of step 2")
    assert pending(m) == 1 and not h.done()
    assert committed(root) == [1] and latest(root) == 1
    assert staged_dir(root, 2).is_dir() and not (staged_dir(root, 2) / layout.COMMITTED).exists()

    gate.release()
    m.wait()
    assert committed(root) == [2] and latest(root) == 2
    assert "retention: removed step-00000001" in m.logs
    assert not staged_dir(root, 2).exists()


def test_retention_of_another_commit_spares_the_save_in_flight(root, make_manager):
    """Step 1 is being re-saved (in flight) when step 3 commits and runs retention with keep=2: the committed step-1 is
    spared because its step is in flight, and the in-flight save's staging folder is untouched."""
    m = make_manager(keep=2, max_in_flight=2)
    m.save(1, make_state(1))
    m.save(2, make_state(2))
    assert committed(root) == [1, 2]
    gate = m.backend.gate(1)
    m.save(1, make_state(100))
    _wait(gate.entered_wait, "the background commit of the re-save")
    m.save(3, make_state(3))  # commits at once; retention runs with step 1 in flight

    assert committed(root) == [1, 2, 3]
    assert not any("removed" in line for line in m.logs)
    assert staged_dir(root, 1).is_dir()

    gate.release()
    m.wait()
    assert committed(root) == [2, 3]  # once committed, the re-saved step 1 is the oldest of three: beyond keep=2
    assert latest(root) == 3


def test_resaving_a_step_keeps_the_old_copy_until_the_new_one_is_published(root, make_manager):
    m = make_manager()
    m.save(3, make_state(1))
    gate = m.backend.gate(3)
    m.save(3, make_state(2))
    _wait(gate.entered_wait, "the background commit of the re-save")

    state = make_state(0)
    assert m.load("latest", state) == 3 and state["model"].v == 1  # the old copy, intact, while the new one is written

    gate.release()
    m.wait()
    assert m.load("latest", state) == 3 and state["model"].v == 2
    assert [p.name for p in root.iterdir() if p.name.startswith(layout.TRASH_PREFIX)] == []


# --- background errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("surface", ["poll", "wait", "close", "save"])
def test_background_error_surfaces_once_and_previous_stays_latest(root, make_manager, surface):
    m = make_manager(keep=1)
    m.save(1, make_state(1))
    gate = m.backend.gate(2, error=OSError(errno.EIO, "disk on fire", "model.pt"))
    h = m.save(2, make_state(2))
    m.poll()  # still in flight: nothing to report yet
    gate.release()
    settle(h)

    with pytest.raises(CheckpointError, match=r"saving step 2 .* failed: disk on fire"):
        if surface == "save":
            m.save(3, make_state(3))
        else:
            getattr(m, surface)()

    # Exactly once: every later call is quiet.
    m.poll()
    m.wait()
    m.close()
    assert m.backend.closed
    assert latest(root) == 1 and committed(root) == [1]
    assert not staged_dir(root, 2).exists()  # the failed attempt's folder was removed
    assert not any("removed step-00000001" in line for line in m.logs)


def test_two_background_errors_raise_the_first_and_log_the_other(root, make_manager):
    m = make_manager(max_in_flight=2)
    m.save(1, make_state(1))
    gates = {s: m.backend.gate(s, error=OSError(errno.EIO, f"bad block {s}")) for s in (2, 3)}
    handles = [m.save(s, make_state(s)) for s in (2, 3)]
    for g in gates.values():
        g.release()
    for h in handles:
        settle(h)

    with pytest.raises(CheckpointError, match="saving step 2 .*bad block 2"):
        m.wait()
    warnings = [line for line in m.logs if line.startswith("warning:")]
    assert len(warnings) == 1 and "saving step 3" in warnings[0] and "bad block 3" in warnings[0]
    m.wait()  # both reported: nothing left
    assert pending(m) == 0 and latest(root) == 1


# --- wait_staged, close --------------------------------------------------------------------------------------------------


def test_wait_staged_blocks_until_every_save_in_flight_is_staged(root, make_manager):
    m = make_manager(max_in_flight=2)
    g2 = m.backend.gate(2, staged=False)
    g3 = m.backend.gate(3, staged=False)
    h2 = m.save(2, make_state(2))
    h3 = m.save(3, make_state(3))
    t, returned = _in_thread(m.wait_staged)
    _wait(g2.entered_staged, "wait_staged asking step 2")
    assert not returned.is_set()
    g2.staged.set()
    _wait(g3.entered_staged, "wait_staged asking step 3")  # step 2 staged is not enough
    assert not returned.is_set()
    g3.staged.set()
    t.join(TIMEOUT)
    assert returned.is_set()

    # Staged is not durable: both saves are still in flight, nothing is committed.
    assert not h2.done() and not h3.done() and pending(m) == 2
    assert committed(root) == []
    g2.release()
    g3.release()
    m.wait()
    assert committed(root) == [2, 3]


def test_close_waits_for_everything_in_flight_then_closes_the_backend(root, make_manager):
    m = make_manager(max_in_flight=2)
    gates = [m.backend.gate(s) for s in (1, 2)]
    for s in (1, 2):
        m.save(s, make_state(s))
    t, closed = _in_thread(m.close)
    t.join(0.05)  # a bounded look, not a synchronisation: close cannot return while the saves are gated
    assert not closed.is_set() and not m.backend.closed
    for g in gates:
        g.release()
    t.join(TIMEOUT)
    assert closed.is_set()
    assert m.backend.closed and m.backend.unfinished_at_close == []
    assert committed(root) == [1, 2] and pending(m) == 0
    assert not (root / f".staging-{RUN}").exists()  # our staging folder, empty once every save is published


# --- open and follow: sweep, retire -----------------------------------------------------------------------------------


def test_follow_retires_newer_checkpoints_instead_of_deleting_them(root, make_manager):
    old = make_manager()
    for s in (2, 4, 6):
        old.save(s, make_state(s))
    old.close()
    (root / "loss.csv").write_text("step,loss\n")
    (root / layout.step_dir_name(8)).mkdir()  # an interrupted save of the abandoned line: retired too

    m = make_manager(run_id="run-b")
    state = make_state(0)
    assert m.open("4", state) == 4
    m.follow(4, keep_files=("loss.csv",))
    assert state["model"].v == 4
    assert present(root) == [2, 4] and latest(root) == 4

    (retired,) = (root / layout.RETIRED_DIR).iterdir()
    assert retired.name.endswith("-after-step-4")
    assert sorted(p.name for p in retired.iterdir()) == ["loss.csv", layout.step_dir_name(6), layout.step_dir_name(8)]
    assert layout.verify(retired / layout.step_dir_name(6))["step"] == 6  # moved whole, still a valid checkpoint
    assert (root / "loss.csv").is_file()
    assert any("moved the newer checkpoints" in line for line in m.logs)


def test_open_moves_nothing_until_follow(root, make_manager):
    """A caller that refuses what open() loaded (another --model, other data) stops before follow(): nothing moved."""
    old = make_manager()
    for s in (2, 4):
        old.save(s, make_state(s))

    m = make_manager(run_id="run-b")
    assert m.open("2", make_state(0)) == 2
    assert present(root) == [2, 4] and not (root / layout.RETIRED_DIR).exists()


def test_follow_fresh_start_retires_every_checkpoint(root, make_manager):
    old = make_manager()
    old.save(2, make_state(2))
    m = make_manager(run_id="run-b")
    assert m.open(None, make_state(0)) is None
    m.follow(None)
    assert present(root) == [] and latest(root) is None
    (retired,) = (root / layout.RETIRED_DIR).iterdir()
    assert layout.verify(retired / layout.step_dir_name(2))["step"] == 2


def test_open_sweeps_what_a_crashed_incarnation_left(root, make_manager):
    old = make_manager()
    old.save(2, make_state(2))
    dead = root / ".staging-run-crashed"
    partial = dead / layout.step_dir_name(4)
    partial.mkdir(parents=True)
    (partial / "model.pt").write_bytes(b"half a save")
    trash = root / ".trash-step-00000002-run-crashed"
    trash.mkdir()

    m = make_manager(run_id="run-b")
    assert m.open("latest", make_state(0)) == 2
    assert not dead.exists() and not trash.exists()
    assert present(root) == [2]
    assert any("removed what interrupted saves left" in line and partial.name in line for line in m.logs)


# --- publish ---------------------------------------------------------------------------------------------------------


def test_publish_replacing_a_step_keeps_the_old_one_until_the_new_one_is_in_place(root, monkeypatch):
    commit_step(root, 5, b"old")
    staged = commit_step(root, 5, b"new!", folder=staged_dir(root, 5))
    seen: dict = {}

    def between(name, where=""):
        if name == "between_replace_renames":
            (trash,) = [p for p in root.iterdir() if p.name.startswith(layout.TRASH_PREFIX)]
            seen["target_exists"] = (root / layout.step_dir_name(5)).exists()
            seen["old_manifest"] = layout.verify(trash)
            seen["old_bytes"] = (trash / "model.pt").read_bytes()
            seen["staged_committed"] = (staged / layout.COMMITTED).exists()

    monkeypatch.setattr(layout, "fault_point", between)
    assert layout.publish(staged, root, 5, tag=RUN) == root / layout.step_dir_name(5)

    assert seen["old_bytes"] == b"old" and seen["old_manifest"]["step"] == 5  # the old copy: whole and committed
    assert seen["staged_committed"] and not seen["target_exists"]
    assert (root / layout.step_dir_name(5) / "model.pt").read_bytes() == b"new!"
    assert latest(root) == 5 and not staged.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(layout.TRASH_PREFIX)] == []


def test_publish_failure_puts_the_old_checkpoint_back(root):
    commit_step(root, 5, b"old")
    with pytest.raises(OSError):
        layout.publish(staged_dir(root, 5), root, 5, tag=RUN)  # the staged folder is missing: its rename fails
    assert (root / layout.step_dir_name(5) / "model.pt").read_bytes() == b"old"
    assert latest(root) == 5
    assert [p.name for p in root.iterdir() if p.name.startswith(layout.TRASH_PREFIX)] == []


def test_crash_between_replace_renames_is_finished_at_the_next_start(root, monkeypatch):
    commit_step(root, 5, b"old")
    staged = commit_step(root, 5, b"new!", folder=staged_dir(root, 5))

    def crash(name, where=""):
        if name == "between_replace_renames":
            raise KeyboardInterrupt  # stands for SIGKILL: nothing after this point runs

    monkeypatch.setattr(layout, "fault_point", crash)
    with pytest.raises(KeyboardInterrupt):
        layout.publish(staged, root, 5, tag=RUN)
    assert latest(root) is None  # step-5 is in neither place `latest` looks; both copies are committed elsewhere
    monkeypatch.undo()

    logs = LogLines()
    layout.recover(root, own_staging=".staging-run-b")
    assert (root / layout.step_dir_name(5) / "model.pt").read_bytes() == b"new!"
    assert latest(root) == 5
    assert sorted(p.name for p in root.iterdir()) == [layout.step_dir_name(5)]  # trash and staging swept
    assert any("published step-00000005" in line for line in logs)
