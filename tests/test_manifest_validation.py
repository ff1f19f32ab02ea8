"""A sealed but malformed manifest or commit marker: one line naming the file, never a traceback.

Each case tampers the newest checkpoint's manifest.json (or COMMITTED) and re-seals it with the right crc32, so only
the structure check can catch it: `verify` fails naming the file, `list` marks it INVALID, `latest` skips it with a
warning and resumes the previous checkpoint. Also: `inspect`/`list` on a missing path or an empty folder.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, env_for_tests, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

EXP = "default"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "checkpoint", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env_for_tests(), timeout=120)


def _committed(exp: Path) -> list[Path]:
    """Committed step folders, oldest first by number (never a hidden staging folder)."""
    found = [p for p in exp.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / "COMMITTED").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """One tiny run with checkpoints at steps 2, 4 and 6; every case tampers a copy of it."""
    ck = tmp_path_factory.mktemp("trained")
    run_train(TINY + ["--dataset", corpus, "--training-steps", "6", "--checkpoint-frequency", "2",
                      "--max-kept-checkpoints", "0", "--checkpoint-dir", str(ck)], check=True)
    assert [p.name for p in _committed(ck / EXP)][-2:] == ["step-00000004", "step-00000006"]
    return ck / EXP


def _seal(step_dir: Path, manifest_bytes: bytes) -> None:
    (step_dir / "manifest.json").write_bytes(manifest_bytes)
    crc = f"{zlib.crc32(manifest_bytes):08x}"
    (step_dir / "COMMITTED").write_text(json.dumps({"manifest_crc32": crc}))


def _set(path: list, value):
    def edit(m: dict):
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return m
    return edit


def _drop_size(m: dict) -> dict:
    del m["files"]["model.pt"]["size"]
    return m


# name -> (how the manifest is changed, the file the error must name, words the message must hold)
CASES = {
    "committed_null": (None, "COMMITTED", "malformed"),
    "manifest_is_list": (lambda m: [m], "manifest.json", "malformed"),
    "file_record_is_string": (_set(["files", "model.pt"], "81dd0c15"), "manifest.json", "model.pt"),
    "file_record_without_size": (_drop_size, "manifest.json", "no size"),
    "step_not_int": (_set(["step"], "six"), "manifest.json", "step"),
    "world_size_zero": (_set(["world_size"], 0), "manifest.json", "world_size"),
    "backend_unknown": (_set(["backend"], "pickle"), "manifest.json", "backend"),
    "files_is_list": (_set(["files"], []), "manifest.json", "files"),
    "format_version_99": (_set(["format_version"], 99), "manifest.json", "format_version 99"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sealed_malformed_checkpoint_is_refused_and_skipped(case, trained, corpus, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck / EXP)
    exp = ck / EXP
    steps = _committed(exp)
    newest, previous = steps[-1], steps[-2]
    tamper, named_file, words = CASES[case]
    if tamper is None:
        (newest / "COMMITTED").write_text("null")
    else:
        _seal(newest, json.dumps(tamper(json.loads((newest / "manifest.json").read_text())), indent=1).encode())
    bad_file = str(newest / named_file)

    out = _cli("verify", str(exp))
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text, text
    lines = [line for line in text.splitlines() if bad_file in line]
    assert lines and all(words in line for line in lines), text
    if case == "format_version_99":
        assert "this PyRecover reads 1" in lines[0] and "upgrade PyRecover" in lines[0], text
    assert f"{previous}: OK" in out.stdout, text

    out = _cli("list", str(exp))
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Traceback" not in text, text
    rows = {int(line.split()[0]): line for line in text.splitlines() if line.split() and line.split()[0].isdigit()}
    assert "INVALID" in rows[6] and bad_file in rows[6], text
    assert "<- latest" in rows[4], text

    if case in ("committed_null", "manifest_is_list"):  # the same check behind every command; two cases suffice
        out = _cli("inspect", str(newest))
        assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
        assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and bad_file in out.stderr, out.stderr

    run = run_train(TINY + ["--dataset", corpus, "--training-steps", "5",
                            "--checkpoint-frequency", "0", "--max-kept-checkpoints", "0", "--checkpoint-dir", str(ck),
                            "--resume-from-checkpoint", "latest"])
    text = run.stdout + run.stderr
    assert run.returncode == 0 and "Traceback" not in text, text[-4000:]
    assert any("skipping" in line and newest.name in line and named_file in line for line in text.splitlines()), text
    assert re.search(rf"resumed from \S*{previous.name} \(step 4\b", text), text


@pytest.mark.parametrize("command", ["inspect", "list"])
@pytest.mark.parametrize("where", ["missing", "empty"])
def test_cli_on_missing_or_empty_path_is_one_error_line(command, where, tmp_path):
    path = tmp_path / "nope" if where == "missing" else tmp_path
    out = _cli(command, str(path))
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and str(path) in out.stderr, out.stderr

