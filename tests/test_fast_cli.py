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
    (["--async-checkpoint"], "--async-checkpoint is for --checkpoint-backend dcp"),  # the backends' table
    (["--checkpoint-dir", "s3://bucket/runs"], "--checkpoint-dir s3://bucket/runs is object storage"),
    (["--experiment_name", ".."], "is not a plain folder name"),
    (["--dataset", "{tmp}/nope.parquet"], "data file {tmp}/nope.parquet does not exist"),
    (["--dataset", "{tmp}/train.parquet", "--val-dataset", "{tmp}/nope.parquet"],  # only their names are looked at
     "--val-dataset {tmp}/nope.parquet does not exist"),
    (["--init-from", "{tmp}/nowhere"], "is not a folder"),
    (["--config", "{tmp}/missing.toml"], "cannot read it"),
    (["--config", "{tmp}/bad.toml"], "is not valid TOML"),
    (["--config", "{tmp}/unknown.toml"], "key 'learnin_rate' is not a flag"),
])
def test_train_refuses_before_importing_torch(tmp_path, args, wanted):
    (tmp_path / "bad.toml").write_text("learning_rate = = 1\n")
    (tmp_path / "unknown.toml").write_text("learnin_rate = 0.1\n")
    (tmp_path / "train.parquet").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    refused([str(ROOT / "train.py"), "--checkpoint-dir", str(tmp_path / "ck"), *args],
            wanted.replace("{tmp}", str(tmp_path)))
    assert not (tmp_path / "ck").exists()


def test_train_rank_above_zero_names_itself(tmp_path):
    proc = subprocess.run([PY, str(ROOT / "train.py"), "--distributed", "--batch-size", "0"], capture_output=True,
                          text=True, timeout=120, env=env_for_tests({"RANK": "1", "WORLD_SIZE": "2"}), cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error (rank 1): --batch-size 0 is out of range; give a number >= 1"], proc.stderr


# The other programs parse their command lines before torch too: `python -m checkpoint` (its package loads its names
# on first use), evaluation.py, hf.py and dataset.py (each parses at its top, then imports torch).
@pytest.mark.parametrize("program", [["-m", "checkpoint"], [str(ROOT / "evaluation.py")], [str(ROOT / "hf.py")],
                                     [str(ROOT / "dataset.py")]], ids=["checkpoint", "evaluation", "hf", "dataset"])
def test_the_other_programs_help_without_torch(program, tmp_path):
    code, out, lines, modules = light([*program, "--help"], cwd=tmp_path)
    assert code == 0 and out.startswith("usage: ") and not lines, (out, lines)
    assert "torch" not in modules
    code, _, lines, modules = light([*program, "nope"], cwd=tmp_path)  # not a subcommand: argparse's usage, exit 2
    assert code == 2 and "invalid choice: 'nope'" in lines[-1] and "torch" not in modules, lines


@pytest.mark.parametrize("args, wanted", [
    (["-m", "checkpoint", "list", "{tmp}/nowhere"], "{tmp}/nowhere does not exist"),
    (["-m", "checkpoint", "verify", "{tmp}/nowhere"], "{tmp}/nowhere does not exist"),
    (["evaluation.py", "validate", "{tmp}/nowhere"], "{tmp}/nowhere does not exist"),
    (["evaluation.py", "sample", "{tmp}", "--top-k", "0"], "--top-k 0 is out of range"),
    (["hf.py", "export", "{tmp}/nowhere", "{tmp}/out", "--to", "hf"], "{tmp}/nowhere does not exist"),
    (["hf.py", "export", "{tmp}", "{tmp}/out", "--to", "hf", "--max-shard-size", "big"], "'big' is not a size"),
    (["dataset.py", "prepare", "--dataset", "{tmp}/nope.parquet"], "data file {tmp}/nope.parquet does not exist"),
    (["dataset.py", "prepare", "--workers", "0"], "--workers 0 is invalid"),
])
def test_the_other_programs_refuse_before_importing_torch(tmp_path, args, wanted):
    args = [str(ROOT / a) if a.endswith(".py") else a.replace("{tmp}", str(tmp_path)) for a in args]
    refused(args, wanted.replace("{tmp}", str(tmp_path)), cwd=tmp_path)


def test_the_cli_benchmark_runs():
    """`make bench-cli` (benchmarks/cli.py), one round: every command exits as it should, and the table is printed."""
    proc = subprocess.run([PY, "-m", "benchmarks.cli", "--quick"], capture_output=True, text=True, timeout=300,
                          env=env_for_tests(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| `train.py --bogus-flag` |" in proc.stdout and "x `import torch`" in proc.stdout, proc.stdout
