"""`concurrent`: snapshot the state into reusable host buffers, persist it in the background (CheckFreq / PCcheck style).

    save()        plans the files (pickles the small Python parts NOW), takes a free buffer set from the pool and starts
                  two threads; returns in milliseconds.
    copier        copies every tensor into the buffer set, in file order, in chunks (pinned host memory + a side
                  stream on CUDA). It runs while forward/backward of the next step runs: the model parameters and the
                  AdamW moments/step counts only change inside ``optimizer.step()``, and train.py calls
                  ``manager.wait_staged()`` right before that, so the copy is consistent. (state_dict() tensors alias
                  the live parameters and optimizer state; tests/test_concurrent.py checks both facts.)
    writer        streams each file to disk chunk by chunk as soon as the copier has filled that chunk (chunk i is
                  written while chunk i+1 is copied), through ``fsio.atomic_write`` (tmp name, fsync, rename), then
                  fsyncs the folder and returns the file records; the manager then writes the part record and rank 0
                  commits, exactly as for every other backend.

Memory: ``max_async`` (N) buffer sets, each allocated once (lazily, when N saves are first in flight at once) and reused;
host memory is at most N x the staged state size and is reported. The manager never lets more than N saves be in flight,
so training blocks only (a) before ``optimizer.step()`` while the snapshot copy is still running, or (b) when N saves
are already persisting.

Files: the same ``<key>.pt`` / ``rank-NNNNN.pt`` as vanilla, in torch.save's zip format (stored entries, 64-byte aligned
data, data descriptors, zip64 when large), written by our own streaming writer so no byte is copied twice and no CRC is
computed twice: the manifest's whole-file crc32 comes from fsio's ChecksumWriter, and each zip entry's crc32 is derived
from it (crc32 "un-combine"). Tensors of one dtype in one file share one storage record (views at 64-byte aligned
offsets), which ``torch.load(weights_only=True)`` reads back as views. Loading goes through ``vanilla.load_pieces``.

Writers are threads, not processes: every heavy step (memcpy, crc32, write, fsync) releases the GIL, and a process
would need the state in shared memory plus its own cleanup on SIGKILL (an orphaned writer must never write into a
folder a restarted run has reused); `python -m checkpoint.bench` measures the training-throughput dip of both.

Errors in the background (ENOSPC, EIO) are re-raised by ``wait()``; the manager turns them into one CheckpointError
line at the next step's ``poll()``. Test-only hooks: fault points ``concurrent_persist_begin`` (once per save, as its
writer starts), ``concurrent_write_chunk`` (before every data chunk) and ``concurrent_persist_half`` (once per save,
halfway through its tensor bytes) for PYRECOVER_FAULT, plus
PYRECOVER_TEST_PERSIST_DELAY_S=<seconds> which makes each payload file take that much longer (a slow disk).
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import CheckpointError
from ..fsio import ChecksumWriter, atomic_write, fault_point, fsync_dir
from ..state import CheckpointState
from .base import Backend, PayloadHandle, RankInfo
from .vanilla import load_pieces, payload_pieces

MiB = 1 << 20
ALIGN = 64  # torch.save's storage alignment: every tensor starts on a 64-byte boundary, in the file and in the buffer
DEFAULT_CHUNK = 16 * MiB

# --- CRC-32 arithmetic --------------------------------------------------------------------------------------------
# zlib.crc32(A + B) == _crc_mul(_x_pow_8n(len(B)), crc32(A)) ^ crc32(B). The writer knows crc32 of the whole file
# so far (ChecksumWriter.crc) before and after a zip entry's data, so the entry's own crc32 follows without a second
# pass over the data. Polynomials are bit-reflected as in zlib (bit 31 is x^0).
_CRC_POLY = 0xEDB88320


def _crc_mul(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial."""
    product = 0
    for bit in range(31, -1, -1):
        if a & (1 << bit):
            product ^= b
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return product


_X_POW_2K = [1 << 30]  # x^(2^k) mod P; x^1 is bit 30
for _ in range(63):
    _X_POW_2K.append(_crc_mul(_X_POW_2K[-1], _X_POW_2K[-1]))


def _x_pow_8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P."""
    result, k, n = 1 << 31, 0, 8 * nbytes
    while n:
        if n & 1:
            result = _crc_mul(_X_POW_2K[k], result)
        n >>= 1
        k += 1
    return result


def crc32_of_suffix(crc_all: int, crc_prefix: int, suffix_len: int) -> int:
    """crc32(B) from crc32(A + B), crc32(A) and len(B)."""
    return crc_all ^ _crc_mul(_x_pow_8n(suffix_len), crc_prefix)


# --- torch.save's container, written as a stream --------------------------------------------------------------------
_ZIP64_LIMIT = 0xFFFFFFFF  # tests lower this to run the zip64 records on small files
_FLAGS = 0x0808  # bit 3: sizes and crc follow the data (data descriptor); bit 11: UTF-8 names — as torch.save writes


class TorchZipWriter:
    """The zip archive torch.save produces (``archive/data.pkl``, ``archive/data/<key>`` ...), written sequentially onto
    a ChecksumWriter: stored (uncompressed) entries whose data start on 64-byte boundaries (an ``FB`` padding extra
    field, like torch's), a data descriptor after each entry, zip64 records where sizes or offsets need them."""

    def __init__(self, out: ChecksumWriter, archive: str = "archive"):
        self.out = out
        self.archive = archive
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, header offset, size, crc32

    def begin(self, name: str) -> tuple[bytes, int, int, int]:
        encoded = f"{self.archive}/{name}".encode()
        offset = self.out.size
        pad = -(offset + 30 + len(encoded) + 4) % ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        self.out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), len(extra))
                       + encoded + extra)
        return encoded, offset, self.out.crc, self.out.size

    def end(self, begun: tuple[bytes, int, int, int], crc: int | None = None) -> None:
        encoded, offset, crc_before, start = begun
        size = self.out.size - start
        if crc is None:
            crc = crc32_of_suffix(self.out.crc, crc_before, size)
        if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
            self.out.write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        else:
            self.out.write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self.entries.append((encoded, offset, size, crc))

    def add(self, name: str, data: bytes) -> None:
        begun = self.begin(name)
        self.out.write(data)
        self.end(begun, zlib.crc32(data))

    def close(self) -> None:
        cd_offset = self.out.size
        records = []
        for encoded, offset, size, crc in self.entries:
            sizes, header_offset, z64 = size, offset, []
            if size >= _ZIP64_LIMIT:
                sizes, z64 = 0xFFFFFFFF, [size, size]
            if offset >= _ZIP64_LIMIT:
                header_offset = 0xFFFFFFFF
                z64.append(offset)
            extra = struct.pack(f"<HH{len(z64)}Q", 1, 8 * len(z64), *z64) if z64 else b""
            version = 45 if z64 else 20
            records.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, _FLAGS, 0, 0, 0, crc, sizes,
                                       sizes, len(encoded), len(extra), 0, 0, 0, 0, header_offset) + encoded + extra)
        directory = b"".join(records)
        self.out.write(directory)
        n, cd_size = len(self.entries), len(directory)
        if n >= 0xFFFF or cd_offset >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
            eocd64 = self.out.size
            self.out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_offset))
            self.out.write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
            self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_offset, 0))


# --- planning: which bytes of which tensor go where -----------------------------------------------------------------
_STORAGE_CLASS = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


class _StorageRef:
    """One zip data record: all tensors of one dtype in one file, as one storage. Pickled as torch's persistent id."""

    __slots__ = ("key", "dtype", "offset", "nbytes")

    def __init__(self, key: str, dtype: torch.dtype, offset: int):
        self.key, self.dtype, self.offset, self.nbytes = key, dtype, offset, 0


@dataclass
class _FilePlan:
    name: str
    pickle: bytes = b""
    records: list[_StorageRef] = field(default_factory=list)


@dataclass
class _Plan:
    files: list[_FilePlan]
    copies: list[tuple[torch.Tensor, int]]  # (source tensor, byte offset in the buffer set), ascending offsets
    nbytes: int  # staged bytes (tensor bytes + alignment padding)
    tensor_bytes: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """Pickles a piece exactly the way torch.save does (protocol 2, ``_rebuild_tensor_v2`` over persistent storage ids),
    except that each tensor is described by where it will be staged, not by its live storage. Only the description is
    written here; tensor bytes are copied later by the copier."""

    def __init__(self, file, place: Callable[[torch.Tensor], tuple[_StorageRef, int]]):
        super().__init__(file, protocol=2)
        self._place = place

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            ref, element_offset = self._place(obj)
            return (torch._utils._rebuild_tensor_v2,
                    (ref, element_offset, tuple(obj.shape), _contiguous_stride(obj.shape), False, collections.OrderedDict()))
        return NotImplemented

    def persistent_id(self, obj):
        if type(obj) is _StorageRef:
            numel = obj.nbytes // obj.dtype.itemsize
            return ("storage", getattr(torch, _STORAGE_CLASS[obj.dtype]), obj.key, "cpu", numel)
        return None


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _check_stageable(t: torch.Tensor, where: str) -> None:
    if t.layout != torch.strided or t.dtype not in _STORAGE_CLASS or type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(f"the concurrent backend cannot stage a {type(t).__name__} ({t.dtype}, {t.layout}) in {where}; "
                        "use --checkpoint-backend vanilla for this state")


def plan_pieces(pieces: dict[str, dict]) -> _Plan:
    """Lay every tensor of ``pieces`` out in one buffer (file by file, dtype record by record, 64-byte aligned) and
    pickle each file's structure. Python values (step counters, learning rates, ...) are captured here, at save time;
    tensor bytes are not read."""
    files, copies, cursor = [], [], 0
    for name, obj in pieces.items():
        records: dict[torch.dtype, _StorageRef] = {}
        slots: dict[tuple, tuple[_StorageRef, int, torch.Tensor]] = {}  # alias -> (record, byte offset in it, tensor)

        def place(t: torch.Tensor) -> tuple[_StorageRef, int]:
            key = _alias_key(t)
            if key not in slots:  # memory seen twice (e.g. tied weights) is staged and stored once, as torch.save does
                _check_stageable(t, name)
                if t.dtype not in records:
                    records[t.dtype] = _StorageRef(str(len(records)), t.dtype, 0)
                ref = records[t.dtype]
                start = _align(ref.nbytes)
                ref.nbytes = start + t.numel() * t.element_size()
                slots[key] = (ref, start, t)
            ref, start, _ = slots[key]
            return ref, start // t.element_size()

        _Pickler(_NullSink(), place).dump(obj)  # pass 1: find the tensors and size the records
        for ref in records.values():
            ref.offset = cursor = _align(cursor)
            cursor += ref.nbytes
        copies += [(t, ref.offset + start) for ref, start, t in slots.values()]
        data = io.BytesIO()
        _Pickler(data, place).dump(obj)  # pass 2: same placement, final record sizes in the storage ids
        files.append(_FilePlan(name, data.getvalue(), list(records.values())))
    copies.sort(key=lambda c: c[1])
    tensor_bytes = sum(t.numel() * t.element_size() for t, _ in copies)
    return _Plan(files, copies, _align(cursor), tensor_bytes)


class _NullSink:
    def write(self, data) -> int:
        return len(data)


# --- the buffer pool ------------------------------------------------------------------------------------------------
class BufferSet:
    """One contiguous host buffer holding one staged checkpoint (pinned when CUDA is in use)."""

    def __init__(self, nbytes: int, pin: bool):
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)  # zeroed once: touches every page now
        self.array = self.tensor.numpy()
        self.nbytes = nbytes
        self.pinned = pin


class BufferPool:
    """At most ``max_sets`` buffer sets, each allocated once and reused. ``acquire`` blocks while all are in use."""

    def __init__(self, max_sets: int, log: Callable[[str], None]):
        self.max_sets = max_sets
        self.log = log
        self.sets: list[BufferSet] = []
        self.free: list[BufferSet] = []
        self.allocations = 0
        self.allocation_s = 0.0
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)

    def acquire(self, nbytes: int, pin: bool, what: str) -> BufferSet:
        with self._cond:
            while not self.free and len(self.sets) >= self.max_sets:
                self._cond.wait()
            fitting = [s for s in self.free if s.nbytes >= nbytes and s.pinned == pin]
            if fitting:
                chosen = min(fitting, key=lambda s: s.nbytes)
                self.free.remove(chosen)
                return chosen
            if self.free:  # the state grew (or changed device): replace a free set, never add one beyond max_sets
                old = self.free.pop()
                self.sets.remove(old)
            t0 = time.perf_counter()
            chosen = BufferSet(nbytes, pin)
            self.allocation_s += time.perf_counter() - t0
            self.sets.append(chosen)
            self.allocations += 1
            self.log(f"concurrent checkpointing: allocated host buffer set {len(self.sets)}/{self.max_sets} "
                     f"({nbytes / MiB:.1f} MiB{', pinned' if pin else ''}) for {what}; pool {self.nbytes / MiB:.1f} MiB")
            return chosen

    def release(self, buf: BufferSet) -> None:
        with self._cond:
            if buf in self.sets:
                self.free.append(buf)
            self._cond.notify_all()


# --- one save in flight ---------------------------------------------------------------------------------------------
class _Snapshot(PayloadHandle):
    def __init__(self, backend: "ConcurrentBackend", step_dir: Path, plan: _Plan, buf: BufferSet):
        self.backend = backend
        self.step_dir = step_dir
        self.plan = plan
        self.buf = buf
        self.copied = 0  # bytes of the buffer set that hold their final value (monotonic, in buffer order)
        self.copy_error: BaseException | None = None
        self.write_error: BaseException | None = None
        self.files: dict[str, dict] = {}
        self._written = 0
        self._halfway_hit = False
        self.staged_s = 0.0
        self.durable_s = 0.0
        self._t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._cuda_events: dict[int, torch.cuda.Event] = {}
        self._enqueue_device_copies()
        self._copier = threading.Thread(target=self._copy, name=f"ckpt-copy-{step_dir.name}", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"ckpt-write-{step_dir.name}", daemon=True)
        self._copier.start()
        self._writer.start()

    # copy -----------------------------------------------------------------------------------------------------------
    def _dest(self, t: torch.Tensor, offset: int) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        return self.buf.tensor[offset:offset + nbytes].view(t.dtype).view(t.shape)

    def _enqueue_device_copies(self) -> None:
        """Device tensors: one async device-to-host copy per tensor into the pinned buffer on a side stream, issued now
        (after the work that produced the state) and waited for by the copier."""
        device_copies = [(t, off) for t, off in self.plan.copies if t.device.type == "cuda"]
        if not device_copies:
            return
        stream = self.backend.copy_stream(device_copies[0][0].device)
        stream.wait_stream(torch.cuda.current_stream(device_copies[0][0].device))
        with torch.cuda.stream(stream):
            for t, off in device_copies:
                self._dest(t, off).copy_(t.detach(), non_blocking=True)
                t.record_stream(stream)  # the allocator must not hand this memory out before the copy has read it
                event = torch.cuda.Event(blocking=True)  # the copier sleeps on it instead of spinning a core
                event.record(stream)
                self._cuda_events[off] = event

    def _advance(self, upto: int) -> None:
        with self._cond:
            self.copied = upto
            self._cond.notify_all()

    def _copy(self) -> None:
        chunk = self.backend.chunk
        try:
            for t, off in self.plan.copies:
                nbytes = t.numel() * t.element_size()
                if off in self._cuda_events:
                    self._cuda_events[off].synchronize()
                elif t.is_contiguous() and t.device.type == "cpu":
                    # numpy's copy is a single-threaded memcpy that releases the GIL: the training thread keeps both
                    # the interpreter and torch's intra-op threads.
                    src = t.detach().reshape(-1).view(torch.uint8).numpy()
                    dst = self.buf.array[off:off + nbytes]
                    for a in range(0, nbytes, chunk):
                        np.copyto(dst[a:a + chunk], src[a:a + chunk])
                        self._advance(off + min(a + chunk, nbytes))
                else:
                    self._dest(t, off).copy_(t.detach())
                self._advance(off + nbytes)
            self.plan.copies = []  # drop the references to the live tensors
            self.staged_s = time.perf_counter() - self._t0
            self._advance(self.plan.nbytes)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait_staged()/wait()
            with self._cond:
                self.copy_error = e
                self._cond.notify_all()

    def _wait_copied(self, upto: int) -> None:
        with self._cond:
            while self.copied < upto and self.copy_error is None:
                self._cond.wait()
            if self.copy_error is not None:
                raise self.copy_error

    # write ----------------------------------------------------------------------------------------------------------
    def _write(self) -> None:
        if self.backend.writer_nice:
            try:  # Linux: a thread is a task with its own nice value; the training threads keep the CPU first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.backend.writer_nice)
            except (AttributeError, OSError):
                pass
        try:
            fault_point("concurrent_persist_begin", self.step_dir)
            if not self.backend.pipeline:
                self._wait_copied(self.plan.nbytes)  # write only once the whole snapshot is staged
            for fp in self.plan.files:
                path = self.step_dir / fp.name
                self.files[fp.name] = atomic_write(path, lambda w, fp=fp, path=path: self._fill(w, fp, path),
                                                   fsync_parent=False)
            fsync_dir(self.step_dir)
            self.durable_s = time.perf_counter() - self._t0
        except BaseException as e:  # noqa: BLE001 - re-raised in the training process by wait()
            self.write_error = e
        finally:
            self._copier.join()  # never hand the buffer to the next save while this one still copies into it
            self.backend._finished(self)

    def _fill(self, out: ChecksumWriter, fp: _FilePlan, path: Path) -> None:
        chunk = self.backend.chunk
        view = memoryview(self.buf.array)
        zw = TorchZipWriter(out)
        zw.add("data.pkl", fp.pickle)
        zw.add(".format_version", b"1")
        zw.add(".storage_alignment", str(ALIGN).encode())
        zw.add("byteorder", sys.byteorder.encode())
        for ref in fp.records:
            begun = zw.begin(f"data/{ref.key}")
            end = ref.offset + ref.nbytes
            for a in range(ref.offset, end, chunk):
                b = min(a + chunk, end)
                self._wait_copied(b)
                fault_point("concurrent_write_chunk", path)
                if not self._halfway_hit and self._written + (b - a) >= self.plan.tensor_bytes // 2:
                    self._halfway_hit = True  # once per save: a crash in the middle of a background persist
                    fault_point("concurrent_persist_half", path)
                out.write(view[a:b])
                self._written += b - a
            zw.end(begun)
        zw.add("version", b"3\n")
        zw.add(".data/serialization_id", str(uuid.uuid4().int).encode())
        zw.close()
        if self.backend.after_file is not None:
            self.backend.after_file(path)  # test-only hook: a slow disk, or a gate held by a unit test

    # PayloadHandle --------------------------------------------------------------------------------------------------
    def wait_staged(self) -> None:
        self._copier.join()
        if self.copy_error is not None:
            raise self.copy_error

    def wait(self) -> dict[str, dict]:
        self._writer.join()
        if self.copy_error is not None:
            raise self.copy_error
        if self.write_error is not None:
            raise self.write_error
        return self.files

    def done(self) -> bool:
        return not self._writer.is_alive()

    def staged(self) -> bool:
        return not self._copier.is_alive()


class ConcurrentBackend(Backend):
    """See the module docstring. ``max_async``: saves in flight at once (= host buffer sets); ``chunk_mib``: pipeline
    granularity; ``log``: where allocation/overlap/summary lines go (rank 0 prints by default); ``pipeline``: write
    chunk i while chunk i+1 is copied (default) or only after the whole snapshot is staged; ``writer_nice``: scheduling priority of
    the writer threads (0 = same as training, the default)."""

    name = "concurrent"

    def __init__(self, rank: RankInfo, max_async: int = 2, chunk_mib: float = DEFAULT_CHUNK / MiB,
                 log: Callable[[str], None] | None = None, pipeline: bool = True, writer_nice: int = 0):
        super().__init__(rank)
        # Opt-in: run the writer threads at this nice value (never the copier: it is on the critical path before
        # optimizer.step()). Off by default: on the shared benchmark machine it did not reliably shrink the training
        # dip and it stretched time-to-durable several-fold whenever other processes competed for the cores.
        self.writer_nice = writer_nice
        self.pipeline = pipeline  # False: the writer starts after the copy (less CPU/memory contention with the copy)
        if int(max_async) < 1:
            raise ValueError(f"--max-async must be at least 1, got {max_async}")
        if chunk_mib <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk_mib} MiB")
        self.max_in_flight = int(max_async)
        self.chunk = max(ALIGN, int(chunk_mib * MiB) // ALIGN * ALIGN)
        self.log = log if log is not None else (print if rank.is_main else (lambda m: None))
        self.pool = BufferPool(self.max_in_flight, self.log)
        # Test-only: called by the writer after each payload file's bytes (before its fsync). The env knob simulates a
        # slow disk so that the CLI tests can watch several saves in flight.
        self.after_file: Callable[[Path], None] | None = None
        delay = float(os.environ.get("PYRECOVER_TEST_PERSIST_DELAY_S", "0") or 0)
        if delay > 0:
            self.after_file = lambda path: time.sleep(delay)
        self.saves = 0
        self.peak_in_flight = 0
        self.state_bytes = 0  # largest staged state seen
        self.plan_s = 0.0  # time spent in save() (planning + pickling + starting threads), summed
        self._active: list[_Snapshot] = []
        self._lock = threading.Lock()
        self._streams: dict[torch.device, object] = {}

    def copy_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def save(self, step_dir: Path, state: CheckpointState) -> PayloadHandle:
        t0 = time.perf_counter()
        plan = plan_pieces(payload_pieces(state, self.rank.rank))
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t, _ in plan.copies)
        with self._lock:
            in_flight = sum(1 for s in self._active if not s.done()) + 1
        if in_flight > self.peak_in_flight:
            self.peak_in_flight = in_flight
            if in_flight > 1:
                self.log(f"concurrent checkpointing: {step_dir.name} started while {in_flight - 1} earlier save(s) "
                         f"still persisting ({in_flight} in flight, max {self.max_in_flight})")
        buf = self.pool.acquire(plan.nbytes, pin, f"a {plan.nbytes / MiB:.1f} MiB state")
        self.state_bytes = max(self.state_bytes, plan.nbytes)
        try:
            snap = _Snapshot(self, step_dir, plan, buf)
        except BaseException:
            self.pool.release(buf)
            raise
        with self._lock:
            self._active.append(snap)
        self.saves += 1
        self.plan_s += time.perf_counter() - t0
        return snap

    def _finished(self, snap: _Snapshot) -> None:
        with self._lock:
            if snap in self._active:
                self._active.remove(snap)
        self.pool.release(snap.buf)

    def load(self, step_dir: Path, manifest: dict, state: CheckpointState) -> None:
        load_pieces(step_dir, manifest, state, self.rank.rank)

    @staticmethod
    def owns(manifest: dict) -> bool:
        return manifest.get("backend") == "concurrent"

    def memory_report(self) -> str:
        bound = self.max_in_flight * self.state_bytes
        return (f"concurrent checkpointing: {self.saves} saves, peak {self.peak_in_flight} in flight (max "
                f"{self.max_in_flight}); host buffers {self.pool.nbytes / MiB:.1f} MiB in {len(self.pool.sets)} set(s), "
                f"{self.pool.allocations} allocation(s) in {self.pool.allocation_s:.2f}s, bound {self.max_in_flight} x "
                f"{self.state_bytes / MiB:.1f} MiB = {bound / MiB:.1f} MiB")

    def close(self) -> None:
        with self._lock:
            active = list(self._active)
        for snap in active:  # the manager already waited for these; a direct user may not have
            snap._writer.join()
        if self.saves:
            self.log(self.memory_report())
        self.pool = BufferPool(self.max_in_flight, self.log)  # free the host memory
