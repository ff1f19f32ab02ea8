"""`dcp`: torch.distributed.checkpoint — every rank writes its own shard in parallel; loads at any world size.

Files in a step folder (local or ``s3://``):

    __<rank>_0.distcp      this rank's share of model + optimizer. FSDP ranks write their own shards (DTensors); for
                           DDP, DCP de-duplicates the replicated tensors and spreads them over the ranks.
    .metadata              DCP's index (rank 0). A pickle: read back with an allow-list unpickler (below).
    lr_scheduler.pt train_state.pt run_info.pt [grad_scaler.pt]   rank 0; rank-NNNNN.pt: each rank's RNG + data
                           position. Small, non-tensor or per-rank: written and read with torchfile's helpers.
    part-rank-*.json, manifest.json, COMMITTED   layout.py, exactly as for every backend: DCP's `.metadata` is not
                           a commit (no directory fsync, no checksums, nothing about the non-tensor state).

Every file a rank writes goes through a checksumming wrapper around DCP's storage writer, so the part record gets the
checksum of the bytes as they were written (nothing is read back). Writers: ``FileSystemWriter(sync_files=True)``
locally (+ a directory fsync here), s3torchconnector's ``S3StorageWriter`` for ``s3://`` (region/endpoint from
``AWS_*``).

Saving takes the model/optimizer pieces in sharded mode (state.py: ``ModelState(model, sharded=True)``, the mode
``DCPBackend.sharded`` asks for): DTensor shards under FSDP, plain tensors otherwise. Loading builds the destination
from the *current* model and optimizer the same way, lets DCP fill it — DCP reshards, so a checkpoint saved by N ranks
loads on M — then ``set_state_dict`` applies it, which restores the AdamW moments and step counts in full. A vanilla
checkpoint (full tensors) also loads into an FSDP model: the sharded-mode pieces scatter full tensors into shards.

Nothing in a checkpoint can run code on load: DCP's ``.metadata`` is unpickled with an allow-list of DCP's own
metadata classes, non-tensor values (optimizer hyper-parameters) with ``torch.load(weights_only=True)``.

``--async-checkpoint``: ``dcp.async_save`` on a dedicated gloo process group (created once, at the first save, on every
rank) so the background save's collectives never interleave with training's; a ``DefaultStager`` (pinned memory and a
side stream on CUDA) copies the state in a background thread while forward/backward of the next step runs, and
``PayloadHandle.wait_staged`` (called by train.py right before ``optimizer.step()``) blocks until that copy is done.
The stager reuses its staging buffers, which is safe because at most one save is in flight (``max_in_flight = 1``).

``--async-checkpoint process``: the same, but DCP runs the save in its own background process (``async_save`` with
``AsyncCheckpointerType.PROCESS``), so serializing and checksumming take no GIL time from training. DCP spawns that
process at the first save (one per rank; they form their own gloo group) and keeps it; every save pickles the storage
writer and the staged state to it -- staged in shared memory, so tensors travel as handles -- and its save plans are
cached there. The checksumming wrapper then runs in that process: it leaves this rank's file records in a small JSON
file (``.dcp-records-rank-N.json`` in the step folder; for ``s3://`` in a local temporary folder), which
``PayloadHandle.wait`` reads and removes once DCP reports success; errors there (ENOSPC, EIO) come back through DCP
and are raised by ``wait`` as in thread mode. A single-process run gets a 1-rank gloo group for DCP to start that
process with. Its logging is silenced in ``checkpoint/__init__.py``.

The save process never commits: it writes payload files only; part records, manifest and COMMITTED are the training
process's (after ``wait``). ``close`` stops it (train.py also terminates it on an error exit, since os._exit skips
multiprocessing's exit handler that would); if the training process is killed, it finishes at most the file it is
writing -- it starts and renames no file once its parent is gone -- and exits when its pipe to the training process
closes. Anything it left is in an uncommitted staging folder, never loaded and swept by the next incarnation.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from .. import layout, storage
from ..errors import CheckpointError, first_line
from ..fsio import ChecksumWriter, MemoryFile, real_io_errors
from ..knobs import fault_point
from ..state import TENSOR_SECTIONS as TENSOR_KEYS, CheckpointState, check_compatible
from .base import ASYNC_OPTIONAL, Backend, CompletedPayload, PayloadHandle, RankInfo
from .torchfile import load_file, load_pieces, load_weights_only, payload_pieces, save_pieces

METADATA = ".metadata"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


# DCP warns on every call without a process group ("torch.distributed is disabled ... assuming the intent is to save
# in a single process"), also from the background thread of an async save: that is the intent here (one process, or a
# tool reading a checkpoint), so say nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# --- writing: DCP's storage writer with a checksumming filesystem ---------------------------------------------------


class _RecordingStream(ChecksumWriter):
    """fsio's ChecksumWriter plus what DCP's writer calls on a stream (fileno for fsync, close)."""

    def fileno(self) -> int:
        # DCP asks for the descriptor only to fsync it, and fsyncs without flushing its buffered stream first
        # (torch/distributed/checkpoint/filesystem.py: `_write_files_from_queue` and `FileSystemWriter.finish` call
        # os.fsync(stream.fileno()) on an open(path, "wb") stream), so a tail still in Python's buffer would miss the
        # fsync: flush it into the kernel here. tests/test_powerloss.py shows the difference on a .metadata file.
        self._raw.flush()
        return self._raw.fileno()  # AttributeError on S3: DCP then skips the fsync (S3 writers do not fsync)

    def close(self) -> None:
        self._raw.close()


class _ChecksumFS:
    """Wraps the ``fs`` of a DCP FileSystemWriter/S3StorageWriter: every file written through it gets a record
    (``ChecksumWriter.record``: size and checksum), keyed by file name, once its stream has been closed
    (= durable/uploaded).

    ``records_file`` (process mode): this object is pickled into DCP's save process and writes there, so ``records``
    fill up in that process; it also leaves them in this local JSON file after every file, for the training process
    to read once the save has succeeded (:meth:`_AsyncPayload.wait`)."""

    def __init__(self, fs, records_file: str | None = None):
        self._fs = fs
        self.records: dict[str, dict] = {}
        self._records_file = records_file
        self._trainer_pid = os.getpid() if records_file else None

    def __getattr__(self, name):
        if name.startswith("__") or name == "_fs":  # unpickling probes the class before _fs is set
            raise AttributeError(name)
        return getattr(self._fs, name)

    def create_stream(self, path, mode):
        if mode != "wb":
            return self._fs.create_stream(path, mode)

        @contextlib.contextmanager
        def recording():
            self._check_trainer_alive(path)
            fault_point("dcp_write_file", path)  # test-only hook (knobs.py): kill or fail inside a DCP save
            with self._fs.create_stream(path, mode) as raw, real_io_errors(_RecordingStream(raw)) as stream:
                yield stream  # DCP's torch.save would mask ENOSPC; real_io_errors re-raises it
            self.records[os.path.basename(str(path))] = stream.record()
            self._leave_records()

        return recording()

    def rename(self, path, new_path) -> None:  # .metadata.tmp -> .metadata
        self._check_trainer_alive(new_path)
        self._fs.rename(path, new_path)
        rec = self.records.pop(os.path.basename(str(path)), None)
        if rec is not None:
            self.records[os.path.basename(str(new_path))] = rec
            self._leave_records()

    def _check_trainer_alive(self, path) -> None:
        """In DCP's save process: start no file and rename none once the training process is gone (the save process is
        then an orphan, re-parented to another process). What it wrote is harmless anyway -- the commit is the training
        process's, so an orphaned folder is never COMMITTED -- but this stops it from writing into a run directory
        another incarnation may already own."""
        if self._trainer_pid is not None and os.getppid() != self._trainer_pid:
            raise CheckpointError(f"not writing {path}: the training process {self._trainer_pid} is gone")

    def _leave_records(self) -> None:
        """Replace the records file (atomically, so the reader never sees half a file). Not fsynced: the training
        process reads it right after the save and puts the records into its part record, which is durable; a crash
        before that leaves an uncommitted folder, never loaded."""
        if self._records_file is None:
            return
        tmp = f"{self._records_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.records, f)
        os.replace(tmp, self._records_file)


def _writer(step_dir, records_file: str | None = None):
    writer = storage.medium(step_dir).dcp_writer(step_dir)
    writer.fs = _ChecksumFS(writer.fs, records_file)
    return writer


# --- reading: no code execution -------------------------------------------------------------------------------------

_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                       "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load {self.where}: its DCP {METADATA} references {module}.{name}, which is "
                              "not part of DCP's metadata; the checkpoint was tampered with")


class _SafeMetadata:
    """Mixin for DCP storage readers: ``.metadata`` through the allow-list unpickler instead of ``pickle.load``, and
    every file it points DCP at must be one the (verified) manifest records: a resealed ``.metadata`` naming
    ``../../elsewhere.distcp`` is refused before DCP opens anything."""

    manifest: dict
    step_dir: Any

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        metadata = _MetadataUnpickler(data, str(path)).load()
        for info in (metadata.storage_data or {}).values():
            layout.member(self.step_dir, str(getattr(info, "relative_path", "")), self.manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _VerifiedFiles:
    """DCP's filesystem for reading, over a checkpoint's manifest: a file is opened only through layout.member (listed,
    inside the folder, no link) and served from bytes checked against its record (the ones verify() just read, or
    read and checked now) -- DCP never reads an unverified byte."""

    def __init__(self, fs, step_dir: Path, manifest: dict, verified: dict[str, memoryview] | None):
        self._fs, self._step_dir, self._manifest, self._verified = fs, Path(step_dir), manifest, verified

    def __getattr__(self, name):
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "r" not in mode or any(c in mode for c in "wa+"):
            raise CheckpointError(f"{self._step_dir}: a load does not write ({path}, mode {mode!r})")
        name = os.path.relpath(os.fspath(path), self._step_dir)
        where = layout.member(self._step_dir, name, self._manifest)
        record = self._manifest["files"][name]
        yield MemoryFile(layout.take_verified(where, record, self._manifest["checksum"], self._verified))


def _reader(step_dir, manifest: dict, verified: dict[str, memoryview] | None = None):
    """A DCP storage reader for a verified checkpoint. A filesystem: every byte DCP reads is served from a verified
    read. S3: the names are checked against the manifest (verify() read and checked every object just before); the
    bytes come from s3torchconnector's own reads."""
    medium = storage.medium(step_dir)
    reader = medium.dcp_reader(step_dir, _SafeMetadata)
    reader.step_dir, reader.manifest = step_dir, manifest
    if medium.filesystem:
        reader.fs = _VerifiedFiles(reader.fs, step_dir, manifest, verified)
    return reader


class _WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor values via ``torch.load(weights_only=True)`` (DCP uses False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_weights_only(value, repr(read_item.dest_index.fqn), map_location=None)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _LoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class _TemplateFreePlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


def _leaf_errors(e: BaseException) -> list[BaseException]:
    failures = getattr(e, "failures", None) or {}
    return [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())] or [e]


def _save_error(e: BaseException, step_dir) -> BaseException:
    """A failed DCP save as what the manager reports in one line: OSError (disk full, S3 errors) or CheckpointError."""
    leaves = _leaf_errors(e)
    for leaf in leaves:
        if isinstance(leaf, (OSError, CheckpointError)):
            return leaf
        if (error := storage.medium(step_dir).os_error(leaf, step_dir)) is not None:
            return error
    return CheckpointError(f"saving {step_dir} with DCP failed: {first_line(leaves[0], 200, typed=True)}")


def _load_error(e: BaseException, step_dir) -> CheckpointError:
    leaf = _leaf_errors(e)[0]
    if isinstance(leaf, CheckpointError):
        return leaf
    leaf = storage.medium(step_dir).os_error(leaf, step_dir) or leaf
    if isinstance(leaf, OSError):
        return CheckpointError(f"cannot read {leaf.filename or step_dir}: {leaf.strerror or leaf}")
    return CheckpointError(f"loading {step_dir} with DCP failed: {first_line(leaf, 200, typed=True)}")


def read_metadata(step_dir, manifest: dict, verified: dict[str, memoryview] | None = None):
    try:
        return _reader(step_dir, manifest, verified).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _load_error(e, step_dir) from None


def check_files(step_dir, manifest: dict) -> None:
    """``DCPBackend.check_files``: the ``.metadata`` (verified bytes, allow-list unpickler) names only manifest-listed
    files inside the folder (_SafeMetadata). So `verify` and `latest` refuse a resealed one, as the load would."""
    if METADATA not in manifest["files"]:
        raise CheckpointError(f"{step_dir}: manifest says backend dcp but lists no {METADATA}")
    read_metadata(step_dir, manifest)


def _check_fits(metadata, expected_model: dict[str, torch.Tensor]) -> None:
    """The model in the checkpoint vs this run's, BEFORE DCP's wall of size-mismatch messages: one clear line."""
    found = {k[len("model."):]: torch.empty(v.size, device="meta") for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    check_compatible(expected_model, found)


def read_section(step_dir, manifest: dict, section: str) -> dict[str, Any]:
    """One section (model / optimizer) of a DCP checkpoint as full tensors, in this process, without a process group
    and without a model (the structure is rebuilt from DCP's metadata). ``DCPBackend.read_section``."""
    if section not in TENSOR_KEYS:
        name = f"{section}.pt"
        if name not in manifest["files"]:
            raise CheckpointError(f"{step_dir} holds no {section} state")
        return load_file(step_dir, manifest, name)
    planner = _TemplateFreePlanner(keys={section})
    try:
        dcp.load({}, storage_reader=_reader(step_dir, manifest), planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        raise _load_error(e, step_dir) from None
    if section not in planner.original_state_dict:
        raise CheckpointError(f"{step_dir} holds no {section} state")
    return planner.original_state_dict[section]


def write_sections(step_dir, sections: dict[str, dict]) -> dict[str, dict]:
    """Write full state dicts ``{section: state_dict}`` (model, optimizer) as a one-rank DCP checkpoint in ``step_dir``
    (local or s3://; loads at any world size), from this process alone; return the file records. For conversion
    (convert.py) into this format. ``DCPBackend.write_sections``."""
    writer = _writer(step_dir)
    try:
        dcp.save(sections, storage_writer=writer, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise _save_error(e, step_dir) from None
    storage.sync_dir(step_dir)
    return dict(writer.fs.records)


# --- the backend ----------------------------------------------------------------------------------------------------


def _take_records(path: str) -> dict[str, dict]:
    """The file records DCP's save process left in ``path`` (process mode); the file is removed, so a committed folder
    holds only what its manifest lists. No file: that process wrote no file for this rank."""
    try:
        with open(path) as f:
            records = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise CheckpointError(f"{path}: unreadable file records from DCP's save process ({e})") from None
    os.unlink(path)
    return records


class _AsyncPayload(PayloadHandle):
    def __init__(self, response, fs: _ChecksumFS, files: dict[str, dict], step_dir, records_file: str | None = None):
        self._staged = getattr(response, "staging_completion", None)  # AsyncSaveResponse, or a plain Future
        self._upload = getattr(response, "upload_completion", response)
        self._fs = fs
        self._files = files
        self._step_dir = step_dir
        self._records_file = records_file  # process mode: the records come back in this file, not in self._fs

    def wait_staged(self) -> None:
        if self._staged is None:
            return
        try:
            self._staged.result()
        except Exception as e:  # noqa: BLE001
            raise _save_error(e, self._step_dir) from None

    def wait(self) -> dict[str, dict]:
        try:
            self._upload.result()
        except (Exception, CheckpointException) as e:
            raise _save_error(e, self._step_dir) from None
        records = self._fs.records if self._records_file is None else _take_records(self._records_file)
        storage.sync_dir(self._step_dir)
        return {**self._files, **records}

    def done(self) -> bool:
        return self._upload.done()


ASYNC_MODES = ("thread", "process")


def _stop_save_process() -> None:
    """End DCP's save process (if one was started) the way its own finalizer does -- a terminate request, then SIGTERM
    after 5 s -- now rather than at interpreter exit: train.py ends with os._exit, which skips that."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if process is not None:
        process.__del__()


class DCPBackend(Backend):
    """``async_save``: False (synchronous ``dcp.save``), True or "thread" (``dcp.async_save`` in a background thread),
    "process" (in DCP's background save process). See the module docstring."""

    name = "dcp"
    max_in_flight = 1  # the stager reuses its staging buffers: the next save starts after the previous is durable
    # capabilities (base.Backend; = backends.CAPABILITIES["dcp"]): every rank saves its own shard, local or s3://,
    # in the background when asked (async_save / --async-checkpoint)
    sharded = True
    remote_ok = True
    asynchronous = ASYNC_OPTIONAL
    read_section = staticmethod(read_section)
    write_sections = staticmethod(write_sections)
    check_files = staticmethod(check_files)

    def __init__(self, rank: RankInfo, *, async_save: bool | str = False):
        super().__init__(rank)
        mode = "thread" if async_save is True else async_save or None
        if mode is not None and mode not in ASYNC_MODES:
            raise ValueError(f"async_save must be False, True or one of {ASYNC_MODES}, got {async_save!r}")
        self.async_mode: str | None = mode
        self.async_save = mode is not None
        self._group = None
        self._stager = None
        self._solo_group = False  # process mode without a process group: this backend made a 1-rank one
        self._records_dir: str | None = None

    # -- save --
    def _write_rest(self, step_dir, state: CheckpointState) -> dict[str, dict]:
        """Every piece but model/optimizer, with torchfile's helpers (what goes in which file, and how it is written)."""
        rest = CheckpointState({k: v for k, v in state.items() if k not in TENSOR_KEYS})
        pieces = payload_pieces(rest, self.rank.rank)
        return save_pieces(step_dir, pieces, self.rank.rank)

    def _checkpoint_group(self):
        """A gloo group for the background save's collectives, created on every rank at the first async save (all
        ranks call save() in the same order), so they never interleave with the training group's."""
        if self._group is None and _dist() and self.rank.world_size > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _async_stager(self):
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            # process mode: the staged copy is handed to the save process with every save; in shared memory that is
            # a handle per tensor, not a copy of the bytes
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                        use_shared_memory=self.async_mode == "process",
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
        return self._stager

    def _ensure_process_group(self) -> None:
        """DCP starts its save process through a process group even for one rank (rank 0 picks the save processes'
        rendezvous port and broadcasts it). A single-process run has none: give it a 1-rank gloo group on an
        in-memory store; the save process's own group then meets on this host."""
        if not _dist():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._solo_group = True

    def _records_file(self, step_dir) -> str:
        """Where DCP's save process leaves this rank's file records: in the step folder when it is local (a run that
        dies mid-save leaves it in an uncommitted folder, swept with it), else in a private local folder."""
        name = f".dcp-records-rank-{self.rank.rank:05d}.json"
        if storage.medium(step_dir).filesystem:
            return str(Path(step_dir) / name)
        if self._records_dir is None:
            self._records_dir = tempfile.mkdtemp(prefix="pyrecover-dcp-")
        path = os.path.join(self._records_dir, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a failed earlier save's: never mistaken for this one's
        return path

    def _async_save(self, tensors: dict, step_dir, files: dict[str, dict]) -> PayloadHandle:
        if self.async_mode == "thread":
            writer = _writer(step_dir)
            response = dcp.async_save(tensors, storage_writer=writer, process_group=self._checkpoint_group(),
                                      async_stager=self._async_stager(), no_dist=not _dist())
            return _AsyncPayload(response, writer.fs, files, step_dir)
        # Process mode. DCP pickles the writer (with its _ChecksumFS) and the staged state into its save process,
        # spawned at the first save and kept for the run; the records come back through the records file. Save plans
        # are cached (DCP skips re-planning when nothing changed): the cache lives in that process, used by these
        # saves only.
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._ensure_process_group()
        records_file = self._records_file(step_dir)
        writer = _writer(step_dir, records_file)
        response = dcp.async_save(tensors, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True),
                                  process_group=self._checkpoint_group(),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self._async_stager(), no_dist=False)
        return _AsyncPayload(response, writer.fs, files, step_dir, records_file)

    def save(self, step_dir: Path, state: CheckpointState, *, shared: bool | None = None,
             spares=None) -> PayloadHandle:  # noqa: ARG002 - refused with the local tier: rank 0 writes the rest
        self.check_state(state)
        tensors = {k: state[k].state_dict() for k in TENSOR_KEYS if k in state}
        files = self._write_rest(step_dir, state)
        try:
            if self.async_mode is not None:
                return self._async_save(tensors, step_dir, files)
            writer = _writer(step_dir)
            dcp.save(tensors, storage_writer=writer, no_dist=not _dist())
        except (Exception, CheckpointException) as e:
            raise _save_error(e, step_dir) from None
        storage.sync_dir(step_dir)  # the names of this rank's files (and rank 0's renamed .metadata) are durable
        return CompletedPayload({**files, **writer.fs.records})

    # -- load --
    def load(self, step_dir: Path, manifest: dict, state: CheckpointState, *, verified: dict | None = None) -> None:
        if METADATA not in manifest["files"]:
            raise CheckpointError(f"{step_dir}: manifest says backend dcp but lists no {METADATA}")
        tensors = {k: state[k].state_dict() for k in TENSOR_KEYS if k in state}
        if "model" in tensors:
            _check_fits(read_metadata(step_dir, manifest, verified), tensors["model"])
        try:
            dcp.load(tensors, storage_reader=_reader(step_dir, manifest, verified), planner=_LoadPlanner(),
                     no_dist=not _dist())
        except (Exception, CheckpointException) as e:
            raise _load_error(e, step_dir) from None
        for key, value in tensors.items():
            state[key].load_state_dict(value)
        rest = CheckpointState({k: v for k, v in state.items() if k not in TENSOR_KEYS})
        load_pieces(step_dir, manifest, rest, self.rank.rank, verified)


    def close(self) -> None:
        if self.async_mode == "process":
            _stop_save_process()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._records_dir is not None:
            shutil.rmtree(self._records_dir, ignore_errors=True)
            self._records_dir = None
        if self._solo_group:
            dist.destroy_process_group()
            self._solo_group = False
