"""checkpoint/naming.py: the package's messages name its settings, and train.py's command line maps them to its flags
(flags.SETTING_FLAGS), so the library spells no front end's flags and a train.py user still reads what they typed."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import flags
from checkpoint import naming
from checkpoint.errors import CheckpointError
from checkpoint.places import Places
from checkpoint.policy import When
from checkpoint.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
#: names the package's messages use besides Settings/When fields: train.py's own choices they point the user to
EXTRA_NAMES = {"resume", "model", "max_async"}
#: flags of other programs that a message may name: docker's (more /dev/shm), the submit script's (resubmit a run)
OTHER_PROGRAMS = {"--shm-size", "--continue"}


def test_the_library_names_its_settings():
    assert naming.setting("local_dir") == "local_dir"
    assert naming.setting("local_dir", "/dev/shm/x") == "local_dir=/dev/shm/x"
    assert naming.setting("when.requeue", False) == "when.requeue=False"
    with pytest.raises(CheckpointError, match="^peer=True needs local_dir"):
        Places.of(Settings(checkpoint_dir="/tmp/x", peer=True))
    with pytest.raises(CheckpointError, match="^local_dir must differ from checkpoint_dir"):
        Places.of(Settings(checkpoint_dir="/tmp/x", local_dir="/tmp/x"))


def test_train_py_reads_its_flags(train_spelling):
    assert naming.setting("local_dir", "/dev/shm/x") == "--local-checkpoint-dir /dev/shm/x"
    assert naming.setting("peer", True) == "--peer-checkpoint"  # a switch that is on: its flag alone
    assert naming.setting("when.requeue", False) == "--no-requeue"  # ... off: its own flag
    assert naming.setting("sharded", True) == "--parallel fsdp"
    assert naming.setting("backend", "dcp") == "--checkpoint-backend dcp (or --use-torch-distributed-ckpt)"
    assert naming.setting("backend", "vanilla") == "--checkpoint-backend vanilla"
    with pytest.raises(CheckpointError, match="^--local-checkpoint-dir must differ from --checkpoint-dir"):
        Places.of(Settings(checkpoint_dir="/tmp/x", local_dir="/tmp/x"))
    with pytest.raises(CheckpointError, match="^--checkpoint-frequency 10 must be a multiple of "
                                              "--local-checkpoint-frequency 3"):
        Places.of(Settings(checkpoint_dir="/tmp/x", local_dir="/tmp/shm", local_every=3, when=When(every_steps=10)))


def test_every_mapped_setting_exists_and_every_flag_is_train_pys():
    fields = {f.name for f in dataclasses.fields(Settings)} | {f"when.{f.name}" for f in dataclasses.fields(When)}
    names = set(flags.SETTING_FLAGS) | {name for name, _ in flags.SETTING_VALUES}
    assert names - fields <= EXTRA_NAMES, names - fields - EXTRA_NAMES
    accepted = set(flags.build_parser()._option_string_actions)
    spelled = list(flags.SETTING_FLAGS.values()) + list(flags.SETTING_VALUES.values())
    unknown = {f for s in spelled for f in re.findall(r"--[a-z][a-z0-9_-]+", s)} - accepted
    assert not unknown, unknown


def _message_flags(path: Path) -> list[tuple[int, str]]:
    """The --flag spellings in a module's string literals, docstrings aside (they document, to a developer)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, f) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            for f in re.findall(r"--[a-z][a-z0-9_-]{2,}", n.value) if f not in OTHER_PROGRAMS]


def test_no_message_of_the_package_spells_a_flag():
    """The package's own command line (checkpoint/__main__.py) spells its flags; nothing else in it does."""
    package = ROOT / "checkpoint"
    found = {f"{p.relative_to(ROOT)}:{line}": flag for p in sorted(package.rglob("*.py"))
             if p.name != "__main__.py" for line, flag in _message_flags(p)}
    assert not found, found
