"""Hugging Face tokenizers by model id, from the local Hugging Face cache only, and names of tokenizer files.

The cache is a real one in the layout huggingface_hub writes (models--org--name/{blobs, refs/main,
snapshots/<commit>/tokenizer.json -> ../../blobs/<sha>}) holding a real tokenizer.json trained here with the
`tokenizers` library; train.py finds it through HF_HUB_CACHE with HF_HUB_OFFLINE=1, as on a compute node.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, TINY, run_train

sys.path.insert(0, str(ROOT))
import tokenizer as tk  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Shall I compare thee to a summer's day?",
         "In the beginning was the word, and the word was with God.", "To be, or not to be: that is the question."]


def make_tokenizer_json(corpus=TEXTS, vocab_size=300) -> bytes:
    """A real byte-level BPE tokenizer.json with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 5, trainer=trainer)
    return tok.to_str().encode()


def add_to_hf_cache(cache: Path, repo: str, raw: bytes, *, revision: str = "main", commit: str | None = None) -> Path:
    """Put tokenizer.json of ``repo`` into ``cache`` the way `hf download` does; returns the snapshot file."""
    commit = commit or hashlib.sha1(raw + revision.encode()).hexdigest()
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    blob = repo_dir / "blobs" / hashlib.sha256(raw).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(raw)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)
    snap = repo_dir / "snapshots" / commit / "tokenizer.json"
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_CACHE for in-process lookups (huggingface_hub reads it into constants at import, so set both)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_model_id_resolves_from_cache(hf_cache):
    raw = make_tokenizer_json()
    add_to_hf_cache(hf_cache, "acme/Tiny-Tok", raw)
    tok = tk.load_tokenizer("acme/Tiny-Tok")
    assert tok.name.startswith("hf-Tiny-Tok-") and tok.identity.startswith("hf-") and tok.identity[3:11] in tok.name
    assert tok.decode(tok.encode_batch([TEXTS[0]])[0]) == TEXTS[0]
    assert tok.eos_id == 0  # <|endoftext|>

    # @revision follows refs/<revision>; another file under the same name never shares the name (the token cache key)
    other = make_tokenizer_json(["abc abd abe abf"] * 10, vocab_size=270)
    add_to_hf_cache(hf_cache, "acme/Tiny-Tok", other, revision="v2")
    v2 = tk.load_tokenizer("acme/Tiny-Tok@v2")
    assert v2.name.startswith("hf-Tiny-Tok-v2-") and v2.identity != tok.identity

    # a single-name id (like `gpt2`) too
    add_to_hf_cache(hf_cache, "tinygpt", raw)
    assert tk.load_tokenizer("tinygpt").identity == tok.identity  # same content, same identity


def test_local_files_are_named_after_themselves_plus_content_hash(tmp_path):
    a, b = tmp_path / "a" / "my-tok", tmp_path / "b" / "my-tok"
    for folder, corpus in ((a, TEXTS), (b, ["xyz xyy xzz"] * 10)):
        folder.mkdir(parents=True)
        (folder / "tokenizer.json").write_bytes(make_tokenizer_json(corpus, vocab_size=280))
    by_dir, by_file, other = (tk.load_tokenizer(str(p)) for p in (a, a / "tokenizer.json", b))
    assert by_dir.name == by_file.name and by_dir.name.startswith("hf-my-tok-")
    assert other.name.startswith("hf-my-tok-") and other.name != by_dir.name  # same label, other content
    renamed = tmp_path / "weird name!.json"
    renamed.write_bytes((a / "tokenizer.json").read_bytes())
    again = tk.load_tokenizer(str(renamed))
    assert again.name.startswith("hf-weird-name-") and again.identity == by_dir.identity


def test_missing_model_id_is_one_line(hf_cache):
    with pytest.raises(tk.DataError) as e:
        tk.load_tokenizer("meta-llama/Llama-3.2-1B")
    msg = str(e.value)
    assert "\n" not in msg
    assert str(hf_cache / "models--meta-llama--Llama-3.2-1B") in msg
    assert "hf download meta-llama/Llama-3.2-1B tokenizer.json" in msg and "huggingface-cli download" in msg
    # not an id and not a file: the old message
    with pytest.raises(tk.DataError, match="unknown tokenizer"):
        tk.load_tokenizer("./nowhere/tokenizer.json")


def test_train_with_cached_model_id_offline(tmp_path):
    """The real CLI: --tokenizer-name-or-path org/name from HF_HUB_CACHE, offline; 2 steps, then the same id missing."""
    cache = tmp_path / "hub"
    add_to_hf_cache(cache, "acme/tiny-tok", make_tokenizer_json())
    data = tmp_path / "small.parquet"
    pq.write_table(pa.table({"text": [t + f" ({i})" for i in range(60) for t in TEXTS]}), data)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    proc = run_train(TINY + ["--dataset", str(data), "--tokenizer-name-or-path", "acme/tiny-tok",
                             "--training-steps", "2", "--checkpoint-dir", str(tmp_path / "ck")], env=env, check=True)
    assert "tokenizer hf-tiny-tok-" in proc.stderr + proc.stdout
    assert list(tmp_path.glob("small.parquet.hf-tiny-tok-*.tokens.npy"))  # the token cache is labelled too
    assert (tmp_path / "ck" / "default" / "step-00000002").is_dir()

    proc = run_train(TINY + ["--dataset", str(data), "--tokenizer-name-or-path", "acme/not-cached",
                             "--checkpoint-dir", str(tmp_path / "ck2")], env=env, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and str(cache / "models--acme--not-cached") in errors[0] and "hf download" in errors[0]
