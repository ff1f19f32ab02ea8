"""The checkpoint layer's door, as a training loop meets it: six Session calls in one order (a call out of order is
a clear error, not a run that goes wrong later), their results, and the places record through which `python -m
checkpoint` finds a run's places without importing train.py. In process, through the real Session and the vanilla
backend; then the tool as a subprocess, its imports traced."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PY, ROOT, env_for_tests

sys.path.insert(0, str(ROOT))
from checkpoint import CheckpointState, Outcome, RunInfo, Session, Settings, When  # noqa: E402
from checkpoint.backends.base import RankInfo  # noqa: E402


class Value:
    def __init__(self, v: int = 0):
        self.v, self.w = v, torch.zeros(8)

    def state_dict(self) -> dict:
        return {"v": self.v, "w": self.w}

    def load_state_dict(self, state_dict: dict) -> None:
        self.v, self.w = state_dict["v"], state_dict["w"]


def _state(value: Value) -> CheckpointState:
    return CheckpointState(run_info=RunInfo(), model=value)


def _session(ck: Path, *, resume: str | None = None, mirror: Path | None = None, steps: int = 4) -> Session:
    settings = Settings(checkpoint_dir=str(ck), experiment="run", resume=resume, mirror_dir=str(mirror) if mirror
                        else None, when=When(every_steps=2, final_step=steps, requeue=False))
    return Session(settings, RankInfo(), agree=lambda v: v)


def test_the_six_calls_in_order_train_save_and_resume(tmp_path):
    session = _session(tmp_path / "ck")
    preview = session.prepare()
    assert preview.root == tmp_path / "ck" / "run" and preview.log_dir == preview.root and preview.found is None
    session.take()
    value = Value()
    checked = []
    loaded = session.load(_state(value), check=checked.append, records={"note.txt": b"kept\n"})
    assert loaded.step is None and checked == [loaded] and (preview.root / "note.txt").read_bytes() == b"kept\n"
    session.start()
    for step in range(1, 5):
        value.v = step
        assert not session.step_boundary(step, lambda rushed: {})
    ending = session.close(4, run_seconds=1.0)
    assert ending.outcome == Outcome.FINISHED and ending.line == "" and "2 saves" in ending.summary
    assert [r.step for r in loaded.history] == [2, 4]  # the live history the metrics read

    again = _session(tmp_path / "ck", resume="latest", steps=6)
    found = again.prepare().found
    assert found is not None and found.step == 4
    again.take()
    value = Value()
    loaded = again.load(_state(value))
    assert loaded.step == 4 and value.v == 4 and loaded.scheduled and loaded.info.step == 4


@pytest.mark.parametrize("calls", [["load"], ["prepare", "load"], ["prepare", "take", "start"],
                                   ["prepare", "take", "load", "close"], ["prepare", "prepare"],
                                   ["prepare", "take", "load", "step_boundary"]])
def test_a_call_out_of_order_is_a_clear_error(tmp_path, calls):
    session = _session(tmp_path / "ck")
    do = {"prepare": session.prepare, "take": session.take, "load": lambda: session.load(_state(Value())),
          "start": session.start, "close": lambda: session.close(0),
          "step_boundary": lambda: session.step_boundary(1, lambda rushed: {})}
    for name in calls[:-1]:
        do[name]()
    with pytest.raises(RuntimeError, match=rf"Session\.{calls[-1]}\(\) called .*: (the order is prepare, take, load, "
                                           r"start|it comes between start\(\) and close\(\))"):
        do[calls[-1]]()
    session._release()


def test_a_refused_load_releases_the_lease_and_moves_nothing(tmp_path):
    session = _session(tmp_path / "ck")
    session.prepare(), session.take()
    session.load(_state(Value())), session.start()
    for step in (1, 2):
        session.step_boundary(step, lambda rushed: {})
    session.close(2)

    again = _session(tmp_path / "ck", resume="latest")
    again.prepare(), again.take()

    def refuse(loaded):
        raise ValueError(f"not step {loaded.step}")

    with pytest.raises(ValueError, match="not step 2"):
        again.load(_state(Value()), check=refuse)
    third = _session(tmp_path / "ck", resume="latest")  # the lease was released: no waiting, no force
    third.prepare(), third.take()
    assert third.load(_state(Value())).step == 2


def test_python_m_checkpoint_finds_the_places_the_run_recorded_and_imports_no_front_end(tmp_path):
    mirror = tmp_path / "mirror"
    session = _session(tmp_path / "ck", mirror=mirror)
    session.prepare(), session.take()
    session.load(_state(Value())), session.start()
    for step in (1, 2):
        session.step_boundary(step, lambda rushed: {})
    session.close(2)
    record = json.loads((tmp_path / "ck" / "run" / "places.json").read_text())
    assert record["places"]["mirror_dir"] == str(mirror) and record["spelled"]["mirror_dir"] == "mirror_dir"

    out = subprocess.run([PY, "-X", "importtime", "-m", "checkpoint", "list", str(tmp_path / "ck" / "run")],
                         capture_output=True, text=True, cwd=ROOT, env=env_for_tests(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"mirror  {mirror / 'run'}  (mirror_dir {mirror} in places.json)" in out.stdout, out.stdout
    imported = {m.group(1) for m in re.finditer(r"\|\s+([\w.]+)\s*$", out.stderr, re.M)}
    assert "checkpoint.naming" in imported and not imported & {"flags", "train", "preflight", "dataset"}, imported


def test_train_py_stays_on_the_narrow_side_of_the_door():
    """Architecture fitness: train.py reaches the checkpoint layer through at most six Session calls and eight names
    of the package; no module reaches into the manager's privates; the library imports no front-end module."""
    import ast

    train = (ROOT / "train.py").read_text()
    assert len(set(re.findall(r"\bsession\.([a-z_]+)", train))) <= 6
    names = [a.name for node in ast.walk(ast.parse(train)) if isinstance(node, ast.ImportFrom)
             and (node.module or "").split(".")[0] == "checkpoint" for a in node.names]
    assert len(names) <= 8, names
    roots = {p.stem for p in ROOT.glob("*.py")}
    for path in (ROOT / "checkpoint").rglob("*.py"):
        text = path.read_text()
        if path.name != "manager.py":
            assert not re.search(r"\b(m|manager|self\.manager)\._[a-z]", text), path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not {m.split(".")[0] for m in mods} & roots, (path, mods)
