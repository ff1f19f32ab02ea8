"""Flags first, torch later (issue 54): --help, --version and every refusal that needs no tensor -- an unknown flag, a
bad value or combination, a missing file, a bad --config file -- answer before torch is imported, in the real CLI.

Each case runs the program under ``python -X importtime``, which lists on stderr every module the process imported:
no ``torch`` may be among them. A behaviour test, not a timing one (docs/benchmarks.md has the figures)."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from helpers import PY, ROOT, env_for_tests

IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$")


def light(args: list[str], cwd=ROOT) -> tuple[int, str, list[str], set[str]]:
    """(exit code, stdout, stderr's own lines, the top-level modules imported) of ``python -X importtime ARGS``."""
    proc = subprocess.run([PY, "-X", "importtime", *args], capture_output=True, text=True, timeout=120,
                          env=env_for_tests(), cwd=cwd)
    lines, modules = [], set()
    for line in proc.stderr.splitlines():
        if m := IMPORT_LINE.match(line):
            modules.add(m.group(2).split(".")[0])
        elif line.strip() and not line.startswith("import time:"):
            lines.append(line)
    return proc.returncode, proc.stdout, lines, modules


def refused(args: list[str], wanted: str, cwd=ROOT) -> None:
    code, _, lines, modules = light(args, cwd)
    assert code == 2, (code, lines)
    assert len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], lines
    assert "torch" not in modules, f"{args} imported torch before refusing"


def test_train_help_and_version_answer_without_torch():
    code, out, lines, modules = light([str(ROOT / "train.py"), "--help"])
    assert code == 0 and out.startswith("usage: train.py") and "--checkpoint-backend" in out and not lines, lines
    assert "torch" not in modules and "numpy" not in modules
    code, out, lines, modules = light([str(ROOT / "train.py"), "--version"])
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert code == 0 and out.strip() == f"train.py {version}" and not lines, (out, lines)
    assert "torch" not in modules


@pytest.mark.parametrize("args, wanted", [
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--batch-size", "x"], "invalid int value: 'x'"),
    (["--batch-size", "0"], "--batch-size 0 is out of range"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--checkpoint-backend", "nope"], "invalid choice: 'nope'"),
    (["--model-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--signal", "9"], "SIGKILL (9) cannot be caught"),
    (["--walltime", "soon"], "--walltime"),
    (["--parallel", "fsdp"], "--parallel fsdp shards the model over the ranks"),
    (["--experiment_name", ".."], "is not a plain folder name"),
    (["--dataset", "{tmp}/nope.parquet"], "data file {tmp}/nope.parquet does not exist"),
    (["--val-dataset", "{tmp}/nope.parquet"], "--val-dataset {tmp}/nope.parquet does not exist"),
    (["--init-from", "{tmp}/nowhere"], "is not a folder"),
    (["--config", "{tmp}/missing.toml"], "cannot read it"),
    (["--config", "{tmp}/bad.toml"], "is not valid TOML"),
    (["--config", "{tmp}/unknown.toml"], "key 'learnin_rate' is not a flag"),
])
def test_train_refuses_before_importing_torch(tmp_path, args, wanted):
    (tmp_path / "bad.toml").write_text("learning_rate = = 1\n")
    (tmp_path / "unknown.toml").write_text("learnin_rate = 0.1\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    refused([str(ROOT / "train.py"), *args, "--checkpoint-dir", str(tmp_path / "ck")], wanted.replace("{tmp}",
                                                                                                       str(tmp_path)))
    assert not (tmp_path / "ck").exists()


def test_train_rank_above_zero_names_itself(tmp_path):
    proc = subprocess.run([PY, str(ROOT / "train.py"), "--distributed", "--batch-size", "0"], capture_output=True,
                          text=True, timeout=120, env=env_for_tests({"RANK": "1", "WORLD_SIZE": "2"}), cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error (rank 1): --batch-size 0 is out of range; give a number >= 1"], proc.stderr
