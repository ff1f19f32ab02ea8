"""`concurrent`: snapshot the state into reusable host buffers, persist it in the background (CheckFreq / PCcheck style).

    save()        plans the files (pickles the small Python parts NOW), takes a free buffer set from the pool, writes the
                  zip headers into it and starts two threads; returns in milliseconds.
    copier        copies every tensor into the buffer set, in file order, in chunks (pinned host memory + a side
                  stream on CUDA). It runs while forward/backward of the next step runs: the model parameters and the
                  AdamW moments/step counts only change inside ``optimizer.step()``, and train.py calls
                  ``manager.wait_staged()`` right before that, so the copy is consistent. (state_dict() tensors alias
                  the live parameters and optimizer state; tests/test_concurrent.py checks both facts.)
    writer        streams each file to disk chunk by chunk as soon as the copier has filled that chunk (chunk i is
                  hashed and written while chunk i+1 is copied), through ``fsio.atomic_write`` (tmp name, O_DIRECT
                  where the filesystem takes it, fsync, rename), then fsyncs the folder and returns the file records;
                  the manager then writes the part record and rank 0 commits, exactly as for every other backend.

Memory: ``max_async`` (N) buffer sets, each allocated once (lazily, when N saves are first in flight at once) and reused;
host memory is at most N x the staged state size and is reported. The manager never lets more than N saves be in flight,
so training blocks only (a) before ``optimizer.step()`` while the snapshot copy is still running, or (b) when N saves
are already persisting.

Files: the same ``<key>.pt`` / ``rank-NNNNN.pt`` as vanilla, in torch.save's zip format (stored entries, 64-byte aligned
data, data descriptors, zip64 when large). torchzip.py lays each file out in the buffer set exactly as it will be on
disk, starting on a page boundary, so each byte is copied once (live tensor -> buffer), hashed once (xxh3, by the
writer, from the buffer: nothing is read back) and handed to the disk with O_DIRECT from the buffer itself, with no
page-cache copy. Tensors of one dtype in one file share one storage record (views at 64-byte aligned offsets), which
``torch.load(weights_only=True)`` reads back as views. Loading goes through ``torchfile.load_pieces``.

Writers are threads, not processes: every heavy step (memcpy, xxh3, write, fsync) releases the GIL, and a process
would need the state in shared memory plus its own cleanup on SIGKILL (an orphaned writer must never write into a
folder a restarted run has reused); `python -m benchmarks.backends` measures the training-throughput dip of both.

Errors in the background (ENOSPC, EIO) are re-raised by ``wait()``; the manager turns them into one CheckpointError
line at the next step's ``poll()``. Test-only hooks (knobs.py): fault points ``concurrent_persist_begin``,
``concurrent_write_chunk`` and ``concurrent_persist_half``, and ``PYRECOVER_TEST_PERSIST_DELAY_S`` (a slow disk).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..fsio import PAGE, MiB, ChecksumWriter, atomic_write, fsync_dir
from ..knobs import fault_point, persist_delay_s
from ..naming import setting
from ..state import CheckpointState
from .base import ASYNC_ALWAYS, Backend, PayloadHandle, RankInfo
from .torchzip import FilePlan, Plan, plan_pieces
from .torchfile import files_read, load_pieces, parse_file, payload_pieces, read_section

_log = logging.getLogger(__name__)

DEFAULT_CHUNK = 16 * MiB


# --- the buffer pool ------------------------------------------------------------------------------------------------
class BufferSet:
    """One contiguous, page-aligned host buffer holding one staged checkpoint (pinned when CUDA is in use)."""

    def __init__(self, nbytes: int, pin: bool):
        raw = torch.zeros(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)  # zeroed once: touches every page now
        skip = -raw.data_ptr() % PAGE  # O_DIRECT writes straight from here
        self.tensor = raw[skip:skip + nbytes]
        self.array = self.tensor.numpy()
        self.nbytes = nbytes
        self.pinned = pin


class BufferPool:
    """At most ``max_sets`` buffer sets, each allocated once and reused. ``acquire`` blocks while all are in use."""

    def __init__(self, max_sets: int):
        self.max_sets = max_sets
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
            _log.info(f"concurrent checkpointing: allocated host buffer set {len(self.sets)}/{self.max_sets} "
                     f"({nbytes / MiB:.1f} MiB{', pinned' if pin else ''}) for {what}; pool {self.nbytes / MiB:.1f} MiB")
            return chosen

    def release(self, buf: BufferSet) -> None:
        with self._cond:
            if buf in self.sets:
                self.free.append(buf)
            self._cond.notify_all()


# --- one save in flight ---------------------------------------------------------------------------------------------
class _Snapshot(PayloadHandle):
    def __init__(self, backend: "ConcurrentBackend", step_dir: Path, plan: Plan, buf: BufferSet, spares=None):
        self.spares = spares  # files this save may overwrite (Backend.save)
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
        for fp in plan.files:  # headers and the pickled structure: final now, before any thread reads the buffer
            for off, part in fp.parts:
                buf.array[off:off + len(part)] = np.frombuffer(part, dtype=np.uint8)
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
    def _lower_priority(self) -> None:
        if self.backend.writer_nice:
            try:  # Linux: a thread is a task with its own nice value; the training threads keep the CPU first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.backend.writer_nice)
            except (AttributeError, OSError):
                pass

    def _write(self) -> None:
        self._lower_priority()
        try:
            fault_point("concurrent_persist_begin", self.step_dir)
            if not self.backend.pipeline:
                self._wait_copied(self.plan.nbytes)  # write only once the whole snapshot is staged
            spares = self.spares
            for fp in self.plan.files:
                path = self.step_dir / fp.name
                self.files[fp.name] = atomic_write(path, lambda w, fp=fp, path=path: self._fill(w, fp, path),
                                                   fsync_parent=False,
                                                   reuse=spares.take(fp.size) if spares is not None else None)
            fsync_dir(self.step_dir)
            self.durable_s = time.perf_counter() - self._t0
        except BaseException as e:  # noqa: BLE001 - re-raised in the training process by wait()
            self.write_error = e
        finally:
            self._copier.join()  # never hand the buffer to the next save while this one still copies into it
            self.backend._finished(self)

    def _fill(self, out: ChecksumWriter, fp: FilePlan, path: Path) -> None:
        """Write one file image from the buffer, each chunk as soon as the copier has filled it. Chunks start on page
        boundaries of the buffer and of the file, so O_DIRECT takes them as they are."""
        view = memoryview(self.buf.array)
        end = fp.base + fp.size
        for a in range(fp.base, end, self.backend.chunk):
            b = min(a + self.backend.chunk, end)
            self._wait_copied(b)
            fault_point("concurrent_write_chunk", path)
            if not self._halfway_hit and self._written + (b - a) >= self.plan.nbytes // 2:
                self._halfway_hit = True  # once per save: a crash in the middle of a background persist
                fault_point("concurrent_persist_half", path)
            out.write(view[a:b])
            self._written += b - a
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
    # capabilities (base.Backend; = backends.CAPABILITIES["concurrent"]): full state from rank 0, local only, and every
    # save persists in the background by design (no --async-checkpoint to ask for it)
    asynchronous = ASYNC_ALWAYS
    reuses_files = True  # its writer overwrites a spare in place (fsio.atomic_write's ``reuse``)
    read_section = staticmethod(read_section)  # vanilla's files, in the same zip format
    parse_file = staticmethod(parse_file)
    files_read = staticmethod(files_read)

    def __init__(self, rank: RankInfo, max_async: int = 2, chunk_mib: float = DEFAULT_CHUNK / MiB,
                 pipeline: bool = True, writer_nice: int = 0):
        super().__init__(rank)
        # Opt-in: run the writer threads at this nice value (never the copier: it is on the critical path before
        # optimizer.step()). Off by default: on the shared benchmark machine it did not reliably shrink the training
        # dip and it stretched time-to-durable several-fold whenever other processes competed for the cores.
        self.writer_nice = writer_nice
        self.pipeline = pipeline  # False: the writer starts after the copy (less CPU/memory contention with the copy)
        if int(max_async) < 1:
            raise ValueError(f"{setting('max_async')} must be at least 1, got {max_async}")
        if chunk_mib <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk_mib} MiB")
        self.max_in_flight = int(max_async)
        self.chunk = max(PAGE, int(chunk_mib * MiB) // PAGE * PAGE)
        self.pool = BufferPool(self.max_in_flight)
        # Test-only: called by the writer after each payload file's bytes (before its fsync). The knob simulates a slow
        # disk so that the CLI tests can watch several saves in flight.
        self.after_file: Callable[[Path], None] | None = None
        delay = persist_delay_s()
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

    def save(self, step_dir: Path, state: CheckpointState, *, shared: bool | None = None,
             spares=None) -> PayloadHandle:
        self.check_state(state)
        t0 = time.perf_counter()
        plan = plan_pieces(payload_pieces(state, self.rank.rank, shared=self.rank.is_main if shared is None else shared))
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t, _ in plan.copies)
        with self._lock:
            in_flight = sum(1 for s in self._active if not s.done()) + 1
        if in_flight > self.peak_in_flight:
            self.peak_in_flight = in_flight
            if in_flight > 1:
                _log.info(f"concurrent checkpointing: {step_dir.name} started while {in_flight - 1} earlier save(s) "
                         f"still persisting ({in_flight} in flight, max {self.max_in_flight})")
        buf = self.pool.acquire(plan.nbytes, pin, f"a {plan.nbytes / MiB:.1f} MiB state")
        self.state_bytes = max(self.state_bytes, plan.nbytes)
        try:
            snap = _Snapshot(self, step_dir, plan, buf, spares)
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

    def load(self, step_dir: Path, manifest: dict, state: CheckpointState, *, verified: dict | None = None) -> None:
        load_pieces(step_dir, manifest, state, self.rank.rank, verified)


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
            _log.info(self.memory_report())
        self.pool = BufferPool(self.max_in_flight)  # free the host memory
