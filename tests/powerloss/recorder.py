"""The recording filesystem: a FUSE passthrough onto a backing folder that logs, in order, every operation that can
change what a power cut leaves behind (creates, renames, unlinks, writes, truncates, and the fsyncs of files and
folders). What the process sees is the backing folder; what would survive is computed later from the log
(model.py), so one traced run yields every crash state.

Run as ``python -m tests.powerloss.recorder BACKING MOUNTPOINT LOGDIR`` (foreground; unmount with
``fusermount3 -u``), or through ``Mount`` below, which always unmounts. The log is two files in LOGDIR:
``ops.jsonl`` (one JSON list per operation: name, monotonic ns, arguments) and ``data.bin`` (write payloads,
referenced by offset). Single-threaded on purpose: the log order is the order the kernel handed us the calls.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT_NODE = 0
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # linux/fs.h


class Recorder:
    """The mfusepy Operations (duck-typed: mfusepy looks the methods up by name)."""

    use_ns = True

    def __init__(self, backing: str, log_dir: str):
        self.root = os.path.realpath(backing)
        log = Path(log_dir)
        log.mkdir(parents=True, exist_ok=True)
        self.ops = open(log / "ops.jsonl", "w", buffering=1 << 20)
        self.data = open(log / "data.bin", "wb", buffering=0)
        self.data_off = 0
        self.entries: dict[int, dict[str, int]] = {ROOT_NODE: {}}  # the visible namespace: folder node -> name -> node
        self.next_node = ROOT_NODE + 1
        self.fds: dict[int, int] = {}  # open file handle -> node (a file renamed while open keeps its node)
        self._scan(ROOT_NODE, self.root)
        self._log("barrier")  # what was there at mount time is durable

    # --- the log ----------------------------------------------------------------------------------------------------
    def _log(self, op: str, *args) -> None:
        self.ops.write(json.dumps([op, time.monotonic_ns(), *args]) + "\n")

    def _blob(self, data: bytes) -> int:
        off = self.data_off
        self.data.write(data)
        self.data_off += len(data)
        return off

    def _scan(self, node: int, folder: str) -> None:
        for name in sorted(os.listdir(folder)):
            p = os.path.join(folder, name)
            child = self._new(node, name)
            if os.path.islink(p):
                self._log("symlink", node, name, child, os.readlink(p))
            elif os.path.isdir(p):
                self.entries[child] = {}
                self._log("mkdir", node, name, child)
                self._scan(child, p)
            else:
                self._log("create", node, name, child)
                content = Path(p).read_bytes()
                if content:
                    self._log("write", child, 0, self._blob(content), len(content))

    def _new(self, parent: int, name: str) -> int:
        node = self.next_node
        self.next_node += 1
        self.entries[parent][name] = node
        return node

    # --- paths ------------------------------------------------------------------------------------------------------
    def _real(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _split(self, path: str) -> tuple[int, str]:
        parts = [p for p in path.split("/") if p]
        node = ROOT_NODE
        for p in parts[:-1]:
            node = self.entries[node][p]
        return node, parts[-1] if parts else ""

    def _node(self, path: str) -> int:
        parent, name = self._split(path)
        return self.entries[parent][name] if name else ROOT_NODE

    # --- reads and attributes: passed through, not logged -----------------------------------------------------------
    def getattr(self, path, fh=None):
        st = os.lstat(self._real(path))
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
                                             "st_mtime_ns", "st_ctime_ns", "st_ino", "st_blocks")} | {
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

    def access(self, path, amode):
        if not os.access(self._real(path), amode):
            raise OSError(errno.EACCES, "")
        return 0

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._real(path))]

    def readlink(self, path):
        return os.readlink(self._real(path))

    def statfs(self, path):
        sv = os.statvfs(self._real(path))
        return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                             "f_files", "f_flag", "f_frsize", "f_namemax")}

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def chmod(self, path, mode):
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        return 0

    def utimens(self, path, times=None):
        os.utime(self._real(path), ns=times) if times else os.utime(self._real(path))
        return 0

    def opendir(self, path):
        return 0

    def releasedir(self, path, fh):
        return 0

    # --- files ------------------------------------------------------------------------------------------------------
    def open(self, path, flags):
        fd = os.open(self._real(path), flags & ~getattr(os, "O_DIRECT", 0))
        self.fds[fd] = self._node(path)
        if flags & os.O_TRUNC:
            self._log("truncate", self.fds[fd], 0)
        return fd

    def create(self, path, mode, flags):
        parent, name = self._split(path)
        existed = name in self.entries[parent]
        fd = os.open(self._real(path), (flags | os.O_CREAT) & ~getattr(os, "O_DIRECT", 0), mode)
        if existed:
            node = self.entries[parent][name]
            if flags & os.O_TRUNC:
                self._log("truncate", node, 0)
        else:
            node = self._new(parent, name)
            self._log("create", parent, name, node)
        self.fds[fd] = node
        return fd

    def write(self, path, data, offset, fh):
        n = os.pwrite(fh, data, offset)
        self._log("write", self.fds[fh], offset, self._blob(data[:n]), n)
        return n

    def truncate(self, path, length, fh=None):
        if fh is not None and fh in self.fds:
            os.ftruncate(fh, length)
            node = self.fds[fh]
        else:
            os.truncate(self._real(path), length)
            node = self._node(path)
        self._log("truncate", node, length)
        return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)
        self.fds.pop(fh, None)
        return 0

    def fsync(self, path, datasync, fh):
        self._log("fsync", self.fds[fh])  # only logged: durability is the model's business, not the backing disk's
        return 0

    def fsyncdir(self, path, datasync, fh):
        self._log("fsyncdir", self._node(path))
        return 0

    # --- the namespace ----------------------------------------------------------------------------------------------
    def mkdir(self, path, mode):
        os.mkdir(self._real(path), mode)
        parent, name = self._split(path)
        node = self._new(parent, name)
        self.entries[node] = {}
        self._log("mkdir", parent, name, node)
        return 0

    def rmdir(self, path):
        os.rmdir(self._real(path))
        parent, name = self._split(path)
        self._log("rmdir", parent, name, self.entries[parent].pop(name))
        return 0

    def unlink(self, path):
        os.unlink(self._real(path))
        parent, name = self._split(path)
        self._log("unlink", parent, name, self.entries[parent].pop(name))
        return 0

    def rename(self, old, new, flags=0):
        sp, sname = self._split(old)
        dp, dname = self._split(new)
        if flags & RENAME_EXCHANGE:
            from checkpoint.fsio import exchange  # here: the checkpoint package's imports would slow every mount

            if not exchange(Path(self._real(old)), Path(self._real(new))):
                raise OSError(errno.EINVAL, "")
            a, b = self.entries[sp][sname], self.entries[dp][dname]
            self.entries[sp][sname], self.entries[dp][dname] = b, a
            self._log("exchange", sp, sname, dp, dname, a, b)
            return 0
        if flags & ~RENAME_NOREPLACE:
            raise OSError(errno.EINVAL, "")
        if flags & RENAME_NOREPLACE and os.path.lexists(self._real(new)):
            raise OSError(errno.EEXIST, "")
        os.rename(self._real(old), self._real(new))
        node = self.entries[sp].pop(sname)
        replaced = self.entries[dp].get(dname)
        self.entries[dp][dname] = node
        self._log("rename", sp, sname, dp, dname, node, replaced)
        return 0

    def link(self, target, source):
        os.link(self._real(source), self._real(target))
        parent, name = self._split(target)
        node = self._node(source)
        self.entries[parent][name] = node
        self._log("link", parent, name, node)
        return 0

    def symlink(self, target, source):
        os.symlink(source, self._real(target))
        parent, name = self._split(target)
        node = self._new(parent, name)
        self._log("symlink", parent, name, node, source)
        return 0

    def destroy(self, path):
        self.ops.flush()
        self.ops.close()
        self.data.close()


def main(argv: list[str]) -> int:
    import logging

    import mfusepy

    class FUSE(mfusepy.FUSE):
        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:  # mfusepy drops renameat2's flags
            return self.operations.rename(old.decode(self.encoding, self.errors),
                                          new.decode(self.encoding, self.errors), flags)

    logging.getLogger("mfusepy").setLevel(logging.CRITICAL)  # an ENOENT from getattr is not news
    backing, mountpoint, log_dir = argv
    FUSE(Recorder(backing, log_dir), mountpoint, foreground=True, nothreads=True)
    return 0


# --- the harness side ---------------------------------------------------------------------------------------------
def fuse_problem() -> str | None:
    """Why a recording mount cannot run here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (apt install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy cannot load libfuse3 ({e}; pip install mfusepy, apt install fuse3)"
    return None


def _mounted(mountpoint: Path) -> bool:
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


class Mount:
    """A recording mount of BACKING at MOUNTPOINT, logging into LOGDIR. Always unmounted on exit (``fusermount3 -u``
    in a finally; lazily if something still holds it), and the daemon stopped by its PID."""

    def __init__(self, backing: Path, mountpoint: Path, log_dir: Path):
        self.backing, self.mountpoint, self.log_dir = Path(backing), Path(mountpoint), Path(log_dir)

    def __enter__(self) -> "Mount":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.powerloss.recorder", str(self.backing),
                                      str(self.mountpoint), str(self.log_dir)],
                                     cwd=Path(__file__).resolve().parents[2], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not _mounted(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read() if self.proc.poll() is not None else "timed out"
                self.unmount()
                raise RuntimeError(f"the recording filesystem did not mount at {self.mountpoint}: {err}")
            time.sleep(0.05)
        return self

    def unmount(self) -> None:
        try:
            if _mounted(self.mountpoint):
                if subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True).returncode:
                    subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def crash(self, profile: str = "posix", k: int | None = None, variant: int = 0, seed: int = 0) -> dict:
        """A power cut: unmount, and leave in the backing folder only what survives a cut after the first k logged
        operations (all by default) under ``profile``; variant > 0 also keeps a seeded choice of unsynced operations.
        Returns the state (model.state_at)."""
        from . import model

        self.unmount()
        ops = model.load(self.log_dir)
        state = model.state_at(ops, len(ops) if k is None else k, profile, variant, seed)
        survivor = self.backing.with_name(self.backing.name + ".crashed")
        shutil.rmtree(survivor, ignore_errors=True)
        model.materialize(state, ops, self.log_dir, survivor)
        shutil.rmtree(self.backing)
        survivor.rename(self.backing)
        return state

    def __exit__(self, *exc) -> None:
        self.unmount()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
