"""What a restart reads ahead while it sets up (Session.prepare), in process, through the real Session lifecycle
and the vanilla backend over a tiny state: the step the load will take, from the tier it will take it from, and
nothing that is not a regular file inside the step folder. The CLI test (test_resume_and_interrupt, Ctrl-C) shows the
line through train.py and that the resumed run ends bitwise.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, LogLines

sys.path.insert(0, str(ROOT))
from checkpoint import CheckpointState, Session, Settings, When  # noqa: E402
from checkpoint.backends.base import RankInfo  # noqa: E402
from checkpoint.errors import CheckpointError  # noqa: E402
from checkpoint.storage import ReadAhead  # noqa: E402
from checkpoint.places import tier_root  # noqa: E402

pytestmark = pytest.mark.timeout(60, method="thread")  # a read-ahead that waits on a file fails, not hangs


class Value:
    """A Stateful piece with a MiB of tensor bytes."""

    def __init__(self, v: int = 0):
        self.v, self.w = v, torch.zeros(1 << 18)

    def state_dict(self) -> dict:
        return {"v": self.v, "w": self.w}

    def load_state_dict(self, state_dict: dict) -> None:
        self.v, self.w = state_dict["v"], state_dict["w"]


def _session(ck: Path, local: Path | None = None, *, every: int, local_every: int = 0, steps: int = 100,
             resume: str | None = None) -> Session:
    settings = Settings(checkpoint_dir=str(ck), when=When(every_steps=every, final_step=steps), resume=resume,
                        local_dir=str(local) if local else None, local_every=local_every)
    return Session(settings, RankInfo(), agree=lambda v: v)


def _prepared(session: Session):
    """The read-ahead started (train.py: as soon as the session exists, before the rest of the setup), and waited for:
    here nothing sets up in between, so what it read is known when the load comes."""
    reading = session.prepare().reading
    assert reading is None or reading.wait(timeout=30)
    session.take()
    return reading


def _run(session: Session, last: int) -> tuple[int | None, Value]:
    """Load ``settings.resume``, train to step ``last`` saving as the settings say, and stop as if killed: the saves
    are committed, nothing is cleared. Returns the resumed step and the state."""
    model = Value()
    _prepared(session)
    step = session.load(CheckpointState(model=model, dataloader=Value())).step
    session.start()
    for s in range((step or 0) + 1, last + 1):
        model.v = s
        session.step_boundary(s, describe=lambda rushed: {})
    _killed(session)
    return step, model


def _killed(session: Session) -> None:
    """Every save committed, and no close(): a killed run requeues nothing and clears no local tier. The lease is
    released, as the next start of a killed run would find it (its holder dead)."""
    session.manager.close()
    session._release()


_LINE = r"read ahead ([\d.]+) of ([\d.]+) MiB of (\S+) while setting up(?:, (\d+) files verified and parsed)?"


def _read_ahead(logs: LogLines) -> list[tuple[float, float, str]]:
    """(MiB read, MiB to read, step folder) of each read-ahead line."""
    found = [re.fullmatch(_LINE, m) for m in logs]
    return [(float(m.group(1)), float(m.group(2)), m.group(3)) for m in found if m]


def _parsed_ahead(logs: LogLines) -> list[int]:
    """How many files each read-ahead verified and parsed for the load."""
    return [int(m.group(4) or 0) for m in (re.fullmatch(_LINE, m) for m in logs) if m]


def _mib(step_dir: Path) -> float:
    """What a one-rank load of ``step_dir`` reads: all its payload files."""
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    return round(sum(r["size"] for r in files.values()) / 2 ** 20, 1)


def test_a_restart_reads_ahead_the_step_it_loads(tmp_path):
    ck = tmp_path / "ck"
    _run(_session(ck, every=4), 10)  # steps 4 and 8
    logs = LogLines()
    step, state = _run(_session(ck, every=4, resume="latest"), 10)
    eight, four = ck / "default" / "step-00000008", ck / "default" / "step-00000004"
    assert (step, state.v) == (8, 10)
    assert _read_ahead(logs) == [(_mib(eight), _mib(eight), str(eight))] and _mib(eight) >= 1, list(logs)
    assert _parsed_ahead(logs) == [2], list(logs)  # model.pt and rank-00000.pt, handed to the load

    logs = LogLines()
    step, _ = _run(_session(ck, every=4, resume="4"), 5)  # an explicit step: that one
    assert step == 4 and _read_ahead(logs) == [(_mib(four), _mib(four), str(four))], list(logs)

    logs = LogLines()  # a file of the step folder, as --resume-from-checkpoint PATH takes it: its folder
    step, _ = _run(_session(ck, every=4, resume=str(four / "manifest.json")), 5)
    assert step == 4 and _read_ahead(logs) == [(_mib(four), _mib(four), str(four))], list(logs)


def test_a_step_the_local_tier_holds_is_read_ahead_from_there_not_from_the_shared_tier(tmp_path):
    ck, local = tmp_path / "ck", tmp_path / "local"
    _run(_session(ck, local, every=4, local_every=2), 7)  # shared: 4; local: 4 and 6
    logs = LogLines()
    step, state = _run(_session(ck, local, every=4, local_every=2, resume="latest"), 8)
    assert (step, state.v) == (6, 8) and logs.has("from their local tier"), list(logs)
    six = tier_root(local, "default", str(ck / "default")) / "rank-00000" / "step-00000006"
    assert _read_ahead(logs) == [(_mib(six), _mib(six), str(six))] and _parsed_ahead(logs) == [2], list(logs)


def _damage(path: Path) -> None:
    """Flip a byte in the middle of ``path``, in place: same size, same inode, another checksum."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_the_load_takes_what_the_read_ahead_verified_and_never_what_failed(tmp_path):
    """What the read-ahead verified against the manifest is what the load gets, even if the file changes after; a
    file that failed there is read again by the load, which refuses it as always."""
    ck = tmp_path / "ck"
    _run(_session(ck, every=4), 8)
    eight = ck / "default" / "step-00000008"
    expected = Value().w.clone()  # as saved; the byte flipped below is one of its

    session = _session(ck, every=4, resume="latest")
    assert _prepared(session) is not None
    _damage(eight / "model.pt")  # after it was verified: the load does not read it again
    model = Value()
    assert session.load(CheckpointState(model=model, dataloader=Value())).step == 8
    assert model.v == 8 and torch.equal(model.w, expected)
    _killed(session)

    logs = LogLines()  # damaged before the read-ahead: not kept there, and the load skips the step
    step, model = _run(_session(ck, every=4, resume="latest"), 9)
    assert step == 4 and model.v == 9 and logs.has(f"skipping {eight}"), list(logs)
    assert _parsed_ahead(logs) == [1], list(logs)  # its rank file verified; model.pt did not


def test_the_local_tiers_load_takes_what_the_read_ahead_verified(tmp_path):
    """The verified files travel with the load (Session.open hands them to the manager, which hands them to the
    tier's verify): a local file damaged after the read-ahead checked it is not read again, so step 6 still loads
    from the local tier instead of failing its checksum there and falling back to the shared step 4."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    _run(_session(ck, local, every=4, local_every=2), 7)  # shared: 4; local: 4 and 6
    six = tier_root(local, "default", str(ck / "default")) / "rank-00000" / "step-00000006"
    session = _session(ck, local, every=4, local_every=2, resume="latest")
    assert _prepared(session) is not None
    _damage(six / "model.pt")
    logs, model = LogLines(), Value()
    assert session.load(CheckpointState(model=model, dataloader=Value())).step == 6, list(logs)
    assert model.v == 6 and torch.equal(model.w, Value().w) and logs.has("from their local tier"), list(logs)
    session._release()  # killed here: step 6's drain (its model.pt damaged since) never runs


@pytest.mark.parametrize("name", ["model.pt", "COMMITTED"])
def test_a_fifo_in_the_step_folder_is_not_waited_on(tmp_path, name):
    """A FIFO where a payload or the commit marker was: reading it would wait for a writer forever. The read-ahead's
    choice, its reader and the load's verify pass it by: the restart skips the step and loads the one before."""
    ck = tmp_path / "ck"
    _run(_session(ck, every=4), 8)
    newest = ck / "default" / "step-00000008"
    (newest / name).unlink()
    os.mkfifo(newest / name)
    logs = LogLines()
    step, _ = _run(_session(ck, every=4, resume="latest"), 9)
    assert step == 4 and logs.has(f"skipping {newest}"), list(logs)
    # a payload FIFO: the step was chosen and its other files read; a marker FIFO: the step could not be chosen
    assert [r[2] for r in _read_ahead(logs)] == ([str(newest)] if name == "model.pt" else []), list(logs)


def test_the_reader_reads_regular_files_only_never_through_a_link_never_waiting_on_a_fifo(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x" * 5000)
    (tmp_path / "outside.pt").write_bytes(b"y" * 7000)
    (tmp_path / "link.pt").symlink_to(tmp_path / "outside.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    files = [(tmp_path / n, 7000) for n in ("fifo.pt", "link.pt", "missing.pt")] + [(tmp_path / "a.pt", 5000)]
    ahead = ReadAhead(lambda: ("here", files))
    assert ahead.wait(timeout=30) and ahead.stop() == 5000 and ahead.nbytes == 26000


def test_a_linked_step_folder_is_not_read_through(tmp_path):
    """`--resume-from-checkpoint 8` where step-00000008 is a link to a checkpoint elsewhere: the load refuses it
    (layout.resolve), and the read-ahead reads nothing through it."""
    ck = tmp_path / "ck"
    _run(_session(ck, every=4), 8)
    run = ck / "default"
    elsewhere = tmp_path / "elsewhere"
    (run / "step-00000008").rename(elsewhere)
    (run / "step-00000008").symlink_to(elsewhere)
    session = _session(ck, every=4, resume="8")
    ahead = _prepared(session)
    assert ahead.label == "" and ahead.bytes_read == 0
    with pytest.raises(CheckpointError, match="symbolic link"):
        session.load(CheckpointState(model=Value(), dataloader=Value()))
