"""Tampered checkpoints, by class, through the real CLI: nothing outside a checkpoint's folder is ever read, nothing
PyRecover did not write is ever deleted, and no sealed value is trusted unchecked.

"Resealed" = the manifest rewritten and its checksum in COMMITTED recomputed, as anyone with write access could. Each
test is named by its class:
- outside_folder: a resealed manifest (or DCP .metadata) naming a file outside the step folder, every backend;
- symlinked_shard: a payload file that is a symbolic link to an identical file elsewhere;
- special_file: a payload file replaced by a FIFO (nothing may wait on it);
- symlinked_step_folder: a step folder that is a link to a checkpoint elsewhere (neither loaded nor deleted through);
- absurd_sealed_value: values no run writes (step 10**400, world size 10**30, a step that is not the folder's, a card
  that is a list);
- foreign_files: `convert` and `hf.py export --force` over folders holding the user's files;
- nothing_valid: `--resume-from-checkpoint latest` when every committed checkpoint fails verification.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import xxhash

from helpers import PY, ROOT, TINY, env_for_tests, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

EXP = "default"
BACKENDS = ("vanilla", "concurrent", "dcp")
STEPS = 20


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "checkpoint", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=env_for_tests(), timeout=300)


def _hf_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "hf.py"), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=env_for_tests(), timeout=300)


def _train(corpus: str, ck: Path, backend: str, *extra: str) -> subprocess.CompletedProcess:
    return run_train(TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", "5",
                             "--checkpoint-backend", backend, "--checkpoint-dir", str(ck), *extra])


def _step(exp: Path, n: int) -> Path:
    return exp / f"step-{n:08d}"


def _reseal(step_dir: Path, manifest: dict) -> None:
    raw = json.dumps(manifest, indent=1).encode()
    (step_dir / "manifest.json").write_bytes(raw)
    (step_dir / "COMMITTED").write_text(json.dumps({"manifest_xxh3_64": xxhash.xxh3_64_hexdigest(raw)}))


def _manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def _no_traceback(proc: subprocess.CompletedProcess) -> str:
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text[-4000:]
    return text


def _resumes_from(corpus: str, ck: Path, backend: str, step: int, *extra: str) -> str:
    """Resume `latest` to the end: exits 0, from ``step`` (the tampered newer one skipped)."""
    proc = _train(corpus, ck, backend, "--resume-from-checkpoint", "latest", *extra)
    text = _no_traceback(proc)
    assert proc.returncode == 0, text[-4000:]
    assert re.search(rf"resumed from \S*step-{step:08d} \(step {step}\b", text), text[-4000:]
    return text


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, Path]:
    """T per backend: checkpoints at 10, 15, 20 (the default keeps 3). Each case tampers a copy."""
    out = {}
    for backend in BACKENDS:
        ck = tmp_path_factory.mktemp(f"run-{backend}")
        proc = _train(corpus, ck, backend)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[backend] = ck
    return out


def _copy(runs: dict, backend: str, tmp_path: Path) -> tuple[Path, Path]:
    ck = tmp_path / "ck"
    shutil.copytree(runs[backend], ck, symlinks=True)
    return ck, ck / EXP


# --- outside_folder ----------------------------------------------------------------------------------------------


def _point_outside(step_dir: Path, outside: Path, backend: str) -> Path:
    """Move the model's bytes outside the folder and reseal the checkpoint to read them there. Returns that file."""
    outside.mkdir(parents=True)
    if backend == "dcp":  # the payload names its files inside .metadata, which the manifest covers by checksum
        target = outside / "outside.distcp"
        shutil.copy(step_dir / "__0_0.distcp", target)
        metadata = pickle.loads((step_dir / ".metadata").read_bytes())
        for info in metadata.storage_data.values():
            info.relative_path = os.path.relpath(target, step_dir)
        raw = pickle.dumps(metadata)
        (step_dir / ".metadata").write_bytes(raw)
        manifest = _manifest(step_dir)
        manifest["files"][".metadata"] = {"size": len(raw), "xxh3_64": xxhash.xxh3_64_hexdigest(raw)}
    else:  # vanilla and concurrent read the files the manifest names
        target = outside / "model.pt"
        shutil.move(step_dir / "model.pt", target)
        manifest = _manifest(step_dir)
        manifest["files"][os.path.relpath(target, step_dir)] = manifest["files"].pop("model.pt")
    _reseal(step_dir, manifest)
    return target


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_folder_resealed_manifest_is_refused_by_verify_and_skipped_by_latest(backend, runs, corpus, tmp_path):
    ck, exp = _copy(runs, backend, tmp_path)
    outside = _point_outside(_step(exp, 20), tmp_path / "elsewhere", backend)
    out = _cli("verify", _step(exp, 20))
    text = _no_traceback(out)
    assert out.returncode == 1 and "FAILED" in text and ("unsafe path" in text or "does not list" in text), text
    with open(outside, "r+b") as f:  # not even a corrupted outside file may be read
        f.seek(os.path.getsize(outside) // 2)
        f.write(b"\xff\xff\xff\xff")
    text = _resumes_from(corpus, ck, backend, 15)
    assert any("skipping" in line and "step-00000020" in line for line in text.splitlines()), text[-4000:]


# --- symlinked_shard ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_symlinked_shard_is_refused_even_with_identical_bytes(backend, runs, corpus, tmp_path):
    ck, exp = _copy(runs, backend, tmp_path)
    shard = _step(exp, 20) / ("__0_0.distcp" if backend == "dcp" else "model.pt")
    outside = tmp_path / "elsewhere" / shard.name
    outside.parent.mkdir()
    shutil.move(shard, outside)
    shard.symlink_to(outside)  # the same bytes: size and checksum match, only the place is wrong
    out = _cli("verify", _step(exp, 20))
    text = _no_traceback(out)
    assert out.returncode == 1 and "symbolic link" in text and shard.name in text, text
    if backend == "dcp":  # one resume per class suffices: the three backends share the check (layout.member)
        _resumes_from(corpus, ck, backend, 15)


# --- special_file ------------------------------------------------------------------------------------------------


def test_special_file_a_payload_replaced_by_a_fifo_is_skipped_without_waiting_on_it(runs, corpus, tmp_path):
    """A FIFO where a payload file was (the manifest untouched): opening it for reading would wait for a writer that
    never comes. Neither the restart's read-ahead nor its verify waits on it (the run's timeout): `latest` skips the
    step, and the warning says what the file is -- a FIFO, not a missing file."""
    ck, exp = _copy(runs, "vanilla", tmp_path)
    shard = _step(exp, 20) / "model.pt"
    shard.unlink()
    os.mkfifo(shard)
    text = _resumes_from(corpus, ck, "vanilla", 15)
    skipped = [line for line in text.splitlines() if "skipping" in line and "step-00000020" in line]
    assert len(skipped) == 1, text[-4000:]
    assert f"{shard} is a FIFO, not a regular file" in skipped[0] and "missing" not in skipped[0], skipped


# --- symlinked_step_folder ---------------------------------------------------------------------------------------


def test_symlinked_step_folder_is_neither_loaded_nor_deleted_through(runs, corpus, tmp_path):
    ck, exp = _copy(runs, "vanilla", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # An older step moved out and linked back: retention of the run below must not delete through the link.
    shutil.move(_step(exp, 10), elsewhere / "step-00000010")
    _step(exp, 10).symlink_to(elsewhere / "step-00000010")
    # A newer one, a valid checkpoint elsewhere: `latest` must not load it, and saving step 25 puts the link aside.
    newer = elsewhere / "step-00000025"
    shutil.copytree(_step(exp, 20), newer)
    _reseal(newer, _manifest(newer) | {"step": 25})
    _step(exp, 25).symlink_to(newer)
    before = {d: sorted(p.name for p in d.iterdir()) for d in (elsewhere / "step-00000010", newer)}

    text = _resumes_from(corpus, ck, "vanilla", 20, "--training-steps", "30", "--max-kept-checkpoints", "1")
    assert "skipping" in text and "symbolic link" in text, text[-4000:]
    assert {d: sorted(p.name for p in d.iterdir()) for d in before} == before  # COMMITTED included
    assert _step(exp, 10).is_symlink() and not _step(exp, 25).is_symlink()
    assert [p.resolve() for p in exp.glob("step-00000025.link-*")] == [newer]
    out = _cli("verify", exp)  # the tools do not follow the links either
    assert "step-00000025" not in out.stdout and "step-00000030: OK" in out.stdout, out.stdout + out.stderr


# --- absurd_sealed_value -----------------------------------------------------------------------------------------

ABSURD = {
    "step_10_400": (lambda m: m | {"step": 10**400}, "step"),
    "world_size_10_30": (lambda m: m | {"world_size": 10**30}, "world_size"),
    "step_not_the_folders": (lambda m: m | {"step": 15}, "step-00000020"),
    "card_is_a_list": (lambda m: m | {"meta": m["meta"] | {"card": [1, 2]}}, "meta.card"),
    "eval_loss_is_a_string": (lambda m: m | {"meta": {"card": m["meta"]["card"] | {"eval": {"eval_loss": "low"}}}},
                              "meta.card.eval.eval_loss"),
}


@pytest.mark.parametrize("case", list(ABSURD))
def test_absurd_sealed_value_is_one_line_everywhere(case, runs, tmp_path):
    _, exp = _copy(runs, "vanilla", tmp_path)
    tamper, words = ABSURD[case]
    _reseal(_step(exp, 20), tamper(_manifest(_step(exp, 20))))
    out = _cli("verify", exp)
    text = _no_traceback(out)
    assert out.returncode == 1 and "step-00000015: OK" in text, text
    assert any("step-00000020" in line and "malformed" in line and words in line for line in text.splitlines()), text
    out = _cli("list", exp)
    text = _no_traceback(out)
    assert out.returncode == 0 and re.search(r"^\s+20 .*INVALID", text, re.M), text
    out = _cli("inspect", _step(exp, 20))
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "malformed" in _no_traceback(out), out.stderr


def test_absurd_card_on_an_older_checkpoint_does_not_stop_keep_best_retention(runs, corpus, tmp_path):
    ck, exp = _copy(runs, "vanilla", tmp_path)
    _reseal(_step(exp, 10), _manifest(_step(exp, 10)) | {"meta": {"card": [1, 2]}})
    _resumes_from(corpus, ck, "vanilla", 20, "--training-steps", "30", "--keep-best", "2")


# --- foreign_files -----------------------------------------------------------------------------------------------


def test_foreign_files_convert_never_deletes_what_it_did_not_write(runs, tmp_path):
    src = _step(runs["vanilla"] / EXP, 20)
    dst = tmp_path / "U"
    thesis = dst / "step-00000020" / "thesis.tex"
    thesis.parent.mkdir(parents=True)
    thesis.write_text("x")
    out = _cli("convert", src, dst, "--to", "dcp")
    text = _no_traceback(out)
    assert out.returncode != 0 and "thesis.tex" in text and "did not write" in text, text
    assert thesis.read_text() == "x" and not (thesis.parent / "COMMITTED").exists()
    # The leftover of an interrupted convert holds only names PyRecover writes: that one is replaced.
    thesis.unlink()
    (thesis.parent / "__0_0.distcp").write_bytes(b"partial")
    (thesis.parent / ".model.pt.tmp-0123abcd").write_bytes(b"partial")
    out = _cli("convert", src, dst, "--to", "dcp")
    assert out.returncode == 0 and "committed" in _no_traceback(out), out.stdout + out.stderr
    assert "OK" in _cli("verify", thesis.parent).stdout
    # A DST step folder that is not the source's step is refused, not filled with a mismatched checkpoint.
    out = _cli("convert", src, tmp_path / "V" / "step-00000005", "--to", "dcp")
    assert out.returncode != 0 and "step 20" in _no_traceback(out), out.stdout + out.stderr


def test_foreign_files_export_force_replaces_only_an_export(runs, tmp_path):
    src = _step(runs["vanilla"] / EXP, 20)
    out_dir = tmp_path / "hf"
    assert _hf_cli("export", src, out_dir, "--to", "hf").returncode == 0
    (out_dir / "NOTES.txt").write_text("mine")
    (out_dir / "eval_results").mkdir()
    (out_dir / "eval_results" / "mmlu.json").write_text("{}")
    out = _hf_cli("export", src, out_dir, "--to", "hf", "--force")
    text = _no_traceback(out)
    assert out.returncode != 0 and "NOTES.txt" in text and "eval_results/" in text, text
    assert (out_dir / "NOTES.txt").read_text() == "mine" and (out_dir / "eval_results" / "mmlu.json").exists()
    (out_dir / "NOTES.txt").unlink()
    shutil.rmtree(out_dir / "eval_results")
    out = _hf_cli("export", src, out_dir, "--to", "hf", "--force")  # an export alone: replaced
    assert out.returncode == 0, out.stdout + out.stderr
    assert (out_dir / "config.json").exists() and not list(tmp_path.glob(".hf.*"))


# --- nothing_valid -----------------------------------------------------------------------------------------------


def test_nothing_valid_explicit_resume_stops_and_changes_nothing(runs, corpus, tmp_path):
    ck, exp = _copy(runs, "vanilla", tmp_path)
    for n in (10, 15, 20):
        with open(_step(exp, n) / "model.pt", "r+b") as f:
            f.seek(100)
            f.write(b"\x00\x01\x02\x03")
    before = sorted(p.name for p in exp.iterdir())
    proc = _train(corpus, ck, "vanilla", "--resume-from-checkpoint", "latest")
    text = _no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1 and "none of the 3 committed" in errors[0], text[-4000:]
    assert "starting fresh" not in text
    assert sorted(p.name for p in exp.iterdir()) == before  # nothing retired, nothing written
