"""JSON Lines data and --text-column, through the real CLI:

* a folder of .jsonl / .jsonl.gz shards read through --text-column content: 2 torchrun/gloo ranks, killed mid-training
  and resumed, end bitwise the uninterrupted run (weights, optimizer, loss rows); a resume with another --text-column
  is refused in one line;
* a bad line (not JSON, not an object, no such key, not a string, not UTF-8), a missing column, a folder that mixes
  formats: one line naming the file (and line); a glob over the shards ignores their token caches.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, TINY, check_weights, kill_run_at_row, loss_rows, run_torchrun, run_train, torchrun_cmd

sys.path.insert(0, str(ROOT))
import dataset  # noqa: E402
import readers  # noqa: E402

DOCS_PER_SHARD = 20  # KJV chapters: ~24k tokens a shard


@pytest.fixture(scope="module")
def jsonl_shards(corpus, tmp_path_factory) -> Path:
    """Three shards cut from the embedded corpus, one plain and two gzip: the document under `content`, and a `text`
    key that is not a string (reading the default column would be refused)."""
    docs = pq.read_table(corpus, columns=["text"]).slice(300, 3 * DOCS_PER_SHARD).column("text").to_pylist()
    folder = tmp_path_factory.mktemp("jsonl")
    for i, name in enumerate(["part-000.jsonl", "part-001.jsonl.gz", "part-002.jsonl.gz"]):
        lines = "".join(json.dumps({"id": i * DOCS_PER_SHARD + k, "text": k, "content": doc,
                                    "upper": doc.upper()}) + "\n"
                        for k, doc in enumerate(docs[i * DOCS_PER_SHARD:(i + 1) * DOCS_PER_SHARD]))
        with (gzip.open(folder / name, "wt") if name.endswith(".gz") else open(folder / name, "w")) as f:
            f.write(lines)
    return folder


def test_jsonl_shards_with_a_text_column_resume_bitwise_on_two_ranks(tmp_path, jsonl_shards):
    ck = tmp_path / "ck"
    args = TINY + ["--dataset", str(jsonl_shards), "--text-column", "content", "--checkpoint-dir", str(ck),
                   "--training-steps", "8", "--checkpoint-frequency", "4", "--log-loss-to-csv"]
    whole = run_torchrun(2, args + ["--experiment_name", "whole"], timeout=240)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert whole.stderr.count("[dataset] tokenized") == 3, whole.stderr  # one cache per shard, the ranks together

    csv = ck / "killed" / "loss.csv"
    kill_run_at_row(torchrun_cmd(2, args + ["--experiment_name", "killed"]), csv, 6)
    resumed = run_torchrun(2, args + ["--experiment_name", "killed", "--resume-from-checkpoint", "latest"],
                           timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[dataset] tokenized" not in resumed.stderr  # the caches of the `content` column are reused
    same = check_weights(ck / "whole" / "step-00000008", ck / "killed" / "step-00000008")
    assert same.returncode == 0, same.stdout + same.stderr
    assert loss_rows(ck / "whole" / "loss.csv") == loss_rows(csv)

    # another column of the same files is other data: refused by the flag check, before the fingerprint compares
    other = run_train(args + ["--experiment_name", "killed", "--resume-from-checkpoint", "latest", "--text-column",
                              "upper", "--training-steps", "10"], timeout=120)
    errors = [ln for ln in other.stderr.splitlines() if ln.startswith("error")]
    assert other.returncode == 2 and len(errors) == 1, other.stdout[-2000:] + other.stderr[-2000:]
    assert "--text-column upper differs from the checkpoint's content" in errors[0], errors[0]
    assert "Traceback" not in other.stderr


def _error(path: Path, column: str = "content") -> str:
    with pytest.raises(dataset.DataError) as e:
        dataset.load_tokens(path, dataset.load_tokenizer(dataset.DEFAULT_TOKENIZER), verbose=False, column=column)
    return str(e.value)


def test_bad_lines_and_missing_columns_are_one_line(tmp_path, jsonl_shards):
    good = '{"content": "a document"}\n'
    for body, said in [(good + "not json\n", "line 2: not JSON"),
                       (good + "\n[1, 2]\n", "line 3: a JSON list, not an object"),
                       (good + '{"title": "t"}\n', "line 2: no 'content' key (keys: title)"),
                       (good + '{"content": 5}\n', "line 2: 'content' is a JSON int, not a string")]:
        path = tmp_path / "bad.jsonl"
        path.write_text(body)
        line = _error(path)
        assert line.startswith(f"{path} {said}") and "\n" not in line, line
    (tmp_path / "latin1.jsonl.gz").write_bytes(gzip.compress(good.encode() + b'{"content": "caf\xe9"}\n'))
    assert _error(tmp_path / "latin1.jsonl.gz").startswith(f"{tmp_path / 'latin1.jsonl.gz'} line 2: not UTF-8")
    # a missing column names the columns (keys) there are
    assert "has no 'body' key (keys in line 1: id, text, content, upper)" in _error(jsonl_shards / "part-000.jsonl",
                                                                                   "body")
    pq.write_table(pa.table({"text": ["x"], "source": ["y"]}), tmp_path / "p.parquet")
    assert "has no 'content' column (columns: text, source)" in _error(tmp_path / "p.parquet")
    # one format a folder; a glob over the shards leaves their token caches (made by the test above) alone
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(good)
    pq.write_table(pa.table({"content": ["x"]}), mixed / "b.parquet")
    with pytest.raises(dataset.DataError, match="mixes JSON Lines and parquet shards"):
        readers.list_shards(mixed)
    _, paths = readers.list_shards(f"{jsonl_shards}/part-*")
    assert [p.name for p in paths] == ["part-000.jsonl", "part-001.jsonl.gz", "part-002.jsonl.gz"]
