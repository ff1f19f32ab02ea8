"""torch.save's file format laid out in memory, for the `concurrent` backend (this file is not a backend).

    plan_pieces(pieces) -> Plan    the byte image of every file in one buffer: zip headers, the pickled structure (as
                                    torch.save would write it, but describing tensors by where they will be staged),
                                    and a slot for every tensor's bytes. Each file image starts on a page boundary, so
                                    the staged buffer IS the file and goes to disk with O_DIRECT as it is.
    TorchZipWriter(out)             the zip container (stored entries, 64-byte aligned data, data descriptors, zip64)

Zip entries carry crc32 0, as torch.save writes them with ``compute_crc32`` off: the manifest's xxh3 of the whole
file is the integrity check, and ``torch.load`` does not check zip crcs. ``torch.load(weights_only=True)`` reads the
files back (tests/test_concurrent.py checks every dtype, aliasing, zip64).
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import CheckpointError
from ..fsio import PAGE
from ..naming import setting

ALIGN = 64  # torch.save's storage alignment: every tensor starts on a 64-byte boundary, in the file and in the buffer

# --- torch.save's container, written as a stream --------------------------------------------------------------------
_ZIP64_LIMIT = 0xFFFFFFFF  # tests lower this to run the zip64 records on small files
_FLAGS = 0x0808  # bit 3: sizes and crc follow the data (data descriptor); bit 11: UTF-8 names — as torch.save writes


class _Image:
    """Where TorchZipWriter's output goes at plan time: the small writes are kept with their offsets, a data record
    only reserves its bytes (the copier fills them later)."""

    def __init__(self):
        self.size = 0
        self.parts: list[tuple[int, bytes]] = []

    def write(self, data: bytes) -> None:
        self.parts.append((self.size, bytes(data)))
        self.size += len(data)

    def reserve(self, nbytes: int) -> None:
        self.size += nbytes


class TorchZipWriter:
    """The zip archive torch.save produces (``archive/data.pkl``, ``archive/data/<key>`` ...): stored (uncompressed)
    entries whose data start on 64-byte boundaries (an ``FB`` padding extra field, like torch's), a data descriptor
    after each entry, zip64 records where sizes or offsets need them, crc32 0 (see the module docstring)."""

    def __init__(self, out: _Image, archive: str = "archive"):
        self.out = out
        self.archive = archive
        self.entries: list[tuple[bytes, int, int]] = []  # name, header offset, size

    def begin(self, name: str) -> tuple[bytes, int, int]:
        encoded = f"{self.archive}/{name}".encode()
        offset = self.out.size
        pad = -(offset + 30 + len(encoded) + 4) % ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        self.out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), len(extra))
                       + encoded + extra)
        return encoded, offset, self.out.size

    def end(self, begun: tuple[bytes, int, int]) -> None:
        encoded, offset, start = begun
        size = self.out.size - start
        if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
            self.out.write(struct.pack("<IIQQ", 0x08074B50, 0, size, size))
        else:
            self.out.write(struct.pack("<IIII", 0x08074B50, 0, size, size))
        self.entries.append((encoded, offset, size))

    def add(self, name: str, data: bytes) -> None:
        begun = self.begin(name)
        self.out.write(data)
        self.end(begun)

    def close(self) -> None:
        cd_offset = self.out.size
        records = []
        for encoded, offset, size in self.entries:
            sizes, header_offset, z64 = size, offset, []
            if size >= _ZIP64_LIMIT:
                sizes, z64 = 0xFFFFFFFF, [size, size]
            if offset >= _ZIP64_LIMIT:
                header_offset = 0xFFFFFFFF
                z64.append(offset)
            extra = struct.pack(f"<HH{len(z64)}Q", 1, 8 * len(z64), *z64) if z64 else b""
            version = 45 if z64 else 20
            records.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, _FLAGS, 0, 0, 0, 0, sizes,
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


class StorageRef:
    """One zip data record: all tensors of one dtype in one file, as one storage. Pickled as torch's persistent id."""

    __slots__ = ("key", "dtype", "offset", "nbytes")

    def __init__(self, key: str, dtype: torch.dtype, offset: int):
        self.key, self.dtype, self.offset, self.nbytes = key, dtype, offset, 0


@dataclass
class FilePlan:
    name: str
    base: int = 0  # buffer offset of the file's first byte (page-aligned)
    size: int = 0  # file size
    parts: list[tuple[int, bytes]] = field(default_factory=list)  # (buffer offset, bytes): headers and small records
    records: list[StorageRef] = field(default_factory=list)  # tensor data; StorageRef.offset is a buffer offset


@dataclass
class Plan:
    files: list[FilePlan]
    copies: list[tuple[torch.Tensor, int]]  # (source tensor, byte offset in the buffer set), ascending offsets
    nbytes: int  # the buffer set's size: every file image, each starting on a page
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

    def __init__(self, file, place: Callable[[torch.Tensor], tuple[StorageRef, int]]):
        super().__init__(file, protocol=2)
        self._place = place

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            ref, element_offset = self._place(obj)
            return (torch._utils._rebuild_tensor_v2,
                    (ref, element_offset, tuple(obj.shape), _contiguous_stride(obj.shape), False, collections.OrderedDict()))
        return NotImplemented

    def persistent_id(self, obj):
        if type(obj) is StorageRef:
            numel = obj.nbytes // obj.dtype.itemsize
            return ("storage", getattr(torch, _STORAGE_CLASS[obj.dtype]), obj.key, "cpu", numel)
        return None


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _check_stageable(t: torch.Tensor, where: str) -> None:
    if t.layout != torch.strided or t.dtype not in _STORAGE_CLASS or type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(f"the concurrent backend cannot stage a {type(t).__name__} ({t.dtype}, {t.layout}) in {where}; "
                        f"use {setting('backend', 'vanilla')} for this state")


def plan_pieces(pieces: dict[str, dict]) -> Plan:
    """Lay out the byte image of every file of ``pieces`` in one buffer (file by file, each on a page boundary) and
    place each tensor in its file's data records (one record per dtype, tensors 64-byte aligned). Python values (step
    counters, learning rates, ...) are pickled here, at save time; tensor bytes are not read."""
    files, copies, cursor = [], [], 0
    for name, obj in pieces.items():
        records: dict[torch.dtype, StorageRef] = {}
        slots: dict[tuple, tuple[StorageRef, int, torch.Tensor]] = {}  # alias -> (record, byte offset in it, tensor)

        def place(t: torch.Tensor) -> tuple[StorageRef, int]:
            key = _alias_key(t)
            if key not in slots:  # memory seen twice (e.g. tied weights) is staged and stored once, as torch.save does
                _check_stageable(t, name)
                if t.dtype not in records:
                    records[t.dtype] = StorageRef(str(len(records)), t.dtype, 0)
                ref = records[t.dtype]
                start = _align(ref.nbytes)
                ref.nbytes = start + t.numel() * t.element_size()
                slots[key] = (ref, start, t)
            ref, start, _ = slots[key]
            return ref, start // t.element_size()

        _Pickler(_NullSink(), place).dump(obj)  # pass 1: find the tensors and size the records
        data = io.BytesIO()
        _Pickler(data, place).dump(obj)  # pass 2: same placement, final record sizes in the storage ids
        fp = FilePlan(name, base=-(-cursor // PAGE) * PAGE, records=list(records.values()))
        image = _Image()
        zw = TorchZipWriter(image)
        zw.add("data.pkl", data.getvalue())
        zw.add(".format_version", b"1")
        zw.add(".storage_alignment", str(ALIGN).encode())
        zw.add("byteorder", sys.byteorder.encode())
        for ref in fp.records:
            begun = zw.begin(f"data/{ref.key}")
            ref.offset = fp.base + image.size
            image.reserve(ref.nbytes)
            zw.end(begun)
        zw.add("version", b"3\n")
        zw.add(".data/serialization_id", str(uuid.uuid4().int).encode())
        zw.close()
        fp.size = image.size
        fp.parts = [(fp.base + off, part) for off, part in image.parts]
        copies += [(t, ref.offset + start) for ref, start, t in slots.values()]
        files.append(fp)
        cursor = fp.base + fp.size
    copies.sort(key=lambda c: c[1])
    tensor_bytes = sum(t.numel() * t.element_size() for t, _ in copies)
    return Plan(files, copies, -(-cursor // PAGE) * PAGE, tensor_bytes)


class _NullSink:
    def write(self, data) -> int:
        return len(data)
