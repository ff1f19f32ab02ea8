"""Sharded datasets (--dataset FOLDER or 'GLOB'), through the real CLI:

* 2 torchrun/gloo ranks tokenize 8 shards between them (rank r: shards i % 2 == r); killed mid-tokenization, a rerun
  finishes and its caches are bitwise those `dataset.py prepare` makes; killed mid-training, the resumed
  run is bitwise the uninterrupted one (weights, optimizer, loss rows);
* a read-only data folder: caches in the per-user cache folder or --data-cache-dir; none writable: one line;
* a corrupt (footer or pages), an empty, a text-less shard: named in one line, exit 2;
* a shard added to the folder mid-run: the resumed run keeps to the recorded shards (one note line); a recorded shard
  gone: refused in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import (ROOT, TINY, check_weights, env_for_tests, kill_run_at_row, kill_tree, loss_rows,
                     run_torchrun, run_train, torchrun_cmd)
from test_data_integrity import dataset_cli, no_traceback, read_only  # noqa: F401 (read_only: a fixture)

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

SHARDS = 8
DOCS_PER_SHARD = 20  # KJV chapters: ~24k tokens a shard, a fraction of a second to tokenize


@pytest.fixture(scope="module")
def shards(corpus, tmp_path_factory) -> Path:
    """A pristine folder of SHARDS parquet shards cut from the embedded corpus (copied, never tokenized in)."""
    table = pq.read_table(corpus, columns=["text"]).slice(300, SHARDS * DOCS_PER_SHARD)
    folder = tmp_path_factory.mktemp("shards")
    for i in range(SHARDS):
        pq.write_table(table.slice(i * DOCS_PER_SHARD, DOCS_PER_SHARD), folder / f"part-{i:03d}.parquet")
    return folder


def copy_shards(src: Path, dst: Path, names: list[str] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*.parquet")):
        if names is None or p.name in names:
            shutil.copy2(p, dst / p.name)
    return dst


def caches(folder: Path) -> dict[str, bytes]:
    """shard name -> its token cache's bytes."""
    return {p.name.split(".parquet.")[0]: p.read_bytes() for p in folder.glob("*.tokens.npy")}


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error")]


# ----------------------------------------------------------------------------------------------------------------------
# 2 ranks: tokenize together, killed mid-tokenization and mid-training, bitwise resume
# ----------------------------------------------------------------------------------------------------------------------


def test_two_ranks_tokenize_shards_survive_kills_and_resume_bitwise(tmp_path, shards):
    ref = copy_shards(shards, tmp_path / "ref")
    proc = dataset_cli("prepare", "--dataset", str(ref), "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr
    assert f"{SHARDS} shards" in proc.stdout, proc.stdout
    want = caches(ref)
    assert len(want) == SHARDS

    data = copy_shards(shards, tmp_path / "data")
    ck = tmp_path / "ck"
    args = TINY + ["--dataset", str(data), "--checkpoint-dir", str(ck), "--training-steps", "8",
                   "--checkpoint-frequency", "4", "--log-loss-to-csv"]

    # SIGKILL (torchrun and both ranks) while the caches are being written: each one is slowed down to 1 s
    slow = env_for_tests({"PYRECOVER_TOKENIZE_DELAY_S": "1"})
    run = subprocess.Popen(torchrun_cmd(2, args + ["--experiment_name", "whole"]), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=slow, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(data.glob("*.tokens.npy")):
            assert run.poll() is None, f"run ended (rc {run.returncode}) before any cache was written"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)  # the next shards' caches are under their temporary names now
    finally:
        kill_tree(run)
    partial = caches(data)
    assert 0 < len(partial) < SHARDS, sorted(partial)
    assert all(want[name] == blob for name, blob in partial.items())  # a cache is complete or absent

    # the rerun reuses the finished caches, builds the others, and trains; nothing half-written is left
    whole = run_torchrun(2, args + ["--experiment_name", "whole"], timeout=240)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert caches(data) == want
    assert not [p.name for p in data.iterdir() if ".tmp-" in p.name or p.name.endswith(".lock")]
    assert whole.stderr.count("[dataset] tokenized") == SHARDS - len(partial), whole.stderr

    # killed mid-training, resumed from its latest checkpoint: bitwise the uninterrupted run
    csv = ck / "killed" / "loss.csv"
    kill_run_at_row(torchrun_cmd(2, args + ["--experiment_name", "killed"]), csv, 6)
    resumed = run_torchrun(2, args + ["--experiment_name", "killed", "--resume-from-checkpoint", "latest"],
                           timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[dataset] tokenized" not in resumed.stderr
    same = check_weights(ck / "whole" / "step-00000008", ck / "killed" / "step-00000008")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(ck / "whole" / "loss.csv") == loss_rows(csv)
    card = json.loads((ck / "whole" / "step-00000008" / "manifest.json").read_text())["meta"]["card"]["data"]
    assert [name for name, _ in card["shards"]] == [f"part-{i:03d}.parquet" for i in range(SHARDS)]


# ----------------------------------------------------------------------------------------------------------------------
# Read-only data folder
# ----------------------------------------------------------------------------------------------------------------------


def test_read_only_shard_folder(tmp_path, shards, read_only):
    view = read_only(copy_shards(shards, tmp_path / "src", [f"part-{i:03d}.parquet" for i in range(4)]))
    xdg = tmp_path / "xdg"
    env = {"XDG_CACHE_HOME": str(xdg), "PYRECOVER_CACHE_DIR": ""}

    # beside the data cannot be: the per-user cache folder takes the caches
    proc = dataset_cli("prepare", "--dataset", str(view / "*.parquet"), "--workers", "2", "--seq-len", "32", env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(list((xdg / "pyrecover" / "tokens").glob("*.tokens.npy"))) == 4

    # --data-cache-dir: that folder, for train.py
    mine = tmp_path / "mine"
    run = run_train(TINY + ["--dataset", str(view), "--data-cache-dir", str(mine), "--training-steps", "2",
                            "--checkpoint-frequency", "0", "--checkpoint-dir", str(tmp_path / "ck")], env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(list(mine.glob("*.tokens.npy"))) == 4

    # no folder can take them: one line naming a folder to pass, exit 2
    nowhere = {"XDG_CACHE_HOME": str(view / "xdg"), "PYRECOVER_CACHE_DIR": str(view / "cache")}
    proc = dataset_cli("prepare", "--dataset", str(view), "--seq-len", "32", env=nowhere)
    no_traceback(proc)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: cannot write the token cache of") and "--data-cache-dir" in line, line
    assert "Read-only file system" in line, line


# ----------------------------------------------------------------------------------------------------------------------
# Bad shards
# ----------------------------------------------------------------------------------------------------------------------


def _truncated(path: Path) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])


def _garbled(path: Path) -> None:
    """Its footer intact, its pages not: found only when the text is read."""
    table = pq.read_table(path)
    pq.write_table(table, path, row_group_size=5, compression="zstd")
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 3: len(blob) // 3 + 2000] = bytes(range(256)) * 7 + bytes(208)
    path.write_bytes(bytes(blob))


def _empty(path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)


def _no_text(path: Path) -> None:
    pq.write_table(pa.table({"body": ["some text"]}), path)


@pytest.mark.parametrize("damage, says", [(_truncated, "is not a readable parquet file"),
                                          (_garbled, "is corrupt: its 'text' column cannot be read"),
                                          (_empty, "contains no tokens"),
                                          (_no_text, "has no 'text' column")])
def test_bad_shard_is_named_in_one_line(tmp_path, shards, damage, says):
    data = copy_shards(shards, tmp_path / "data", ["part-000.parquet", "part-001.parquet", "part-002.parquet"])
    damage(data / "part-001.parquet")
    proc = run_train(TINY + ["--dataset", str(data / "part-*.parquet"), "--training-steps", "2",
                             "--checkpoint-dir", str(tmp_path / "ck")])
    no_traceback(proc)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert str(data / "part-001.parquet") in line and says in line, line


# ----------------------------------------------------------------------------------------------------------------------
# A shard added mid-run: the resumed run keeps to the recorded shards
# ----------------------------------------------------------------------------------------------------------------------


def test_shard_added_mid_run_is_ignored_on_resume_and_a_removed_one_refused(tmp_path, shards):
    data = copy_shards(shards, tmp_path / "data", [f"part-{i:03d}.parquet" for i in range(3)])
    ck = tmp_path / "ck"
    args = TINY + ["--dataset", str(data), "--checkpoint-dir", str(ck), "--checkpoint-frequency", "3"]
    run_train(args + ["--training-steps", "3"], check=True)

    shutil.copy2(shards / "part-005.parquet", data / "part-005.parquet")
    resumed = run_train(args + ["--training-steps", "6", "--resume-from-checkpoint", "latest"], check=True)
    notes = [line for line in resumed.stderr.splitlines() if "added to" in line]
    assert len(notes) == 1 and "part-005.parquet" in notes[0] and "ignored" in notes[0], resumed.stderr
    card = json.loads((ck / "default" / "step-00000006" / "manifest.json").read_text())["meta"]["card"]["data"]
    assert [name for name, _ in card["shards"]] == [f"part-{i:03d}.parquet" for i in range(3)]

    (data / "part-001.parquet").unlink()
    refused = run_train(args + ["--training-steps", "9", "--resume-from-checkpoint", "latest"])
    no_traceback(refused)
    assert refused.returncode == 2
    (line,) = error_lines(refused)
    assert "part-001.parquet" in line and "no longer in --dataset" in line, line
