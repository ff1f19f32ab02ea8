"""Checkpoint benchmark: every backend against this machine's physical limits, one command, one run.

    python -m benchmarks.backends                 # = make bench-detail; ~12 min on 2 idle CPU cores; writes results/
    python -m benchmarks.backends --quick         # ~4 min smoke run (small state only, short training runs)
    python -m benchmarks.backends --dir /scratch  # benchmark another disk (default ./checkpoints; a temporary
                                                  # pyrecover-bench-<pid> sub-folder is used and removed)
    python -m benchmarks.backends --part saves|train   # one half only (development)

A time budget (--budget-min, default 14) keeps a busy machine from running for an hour: measurements that would not
finish in time are skipped and marked in the table.

Same state objects and the same directory for every row. Measured in the same run:
  * physical limits: single-threaded memcpy of the state into a contiguous host buffer, and sequential write + fsync
    bandwidth of the checkpoint disk (Python write+fsync of non-zero data, cross-checked with `dd conv=fsync`);
  * per backend (vanilla = synchronous torch.save + fsync; concurrent with N = 1, 2, 4; DCP sync / async thread /
    async process when a `dcp` backend is registered): training stall per save, time to durable (committed), MiB/s,
    load time (verify + restore), through CheckpointManager exactly as train.py drives it; plus a burst of saves back
    to back, where N matters;
  * training throughput of `train.py --model small` with no checkpointing and with a checkpoint every 10, 50, 100 steps,
    and the tokens/s dip while a checkpoint persists in the background;
  * writer threads vs a writer process: the training-step slowdown while persisting (the GIL question).
Output: results/checkpoint_bench.md (+ .json, .png); the markdown is also printed.
"""

from __future__ import annotations

import argparse
import csv
import warnings
import gc
import inspect
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from checkpoint.backends import BACKENDS, RankInfo, backend_class, make_backend
from checkpoint.backends.concurrent import ConcurrentBackend
from checkpoint.backends.torchzip import plan_pieces
from checkpoint.backends.torchfile import payload_pieces
from .records import Row, TrainRun, from_dict
from .report import fmt, plot, report
from .writer_gil import writer_dip
from checkpoint.manager import CheckpointManager
from checkpoint.state import CheckpointState, ModelState, OptimizerState, RNGState, TrainState

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


# --- states -------------------------------------------------------------------------------------------------------


@dataclass
class StateSpec:
    key: str
    label: str
    config: object
    note: str


def state_specs(quick: bool) -> list[StateSpec]:
    from model import ModelConfig, get_config

    specs = [StateSpec("small", "small", get_config("small", 32000, 128), "preset `small` (19.5M params), vocab 32000")]
    if not quick:
        specs.append(StateSpec("125m", "125m", get_config("125m", 32000, 128),
                               "preset `125m` (124.7M params), vocab 32000"))
        specs.append(StateSpec("350m", "~4 GiB", ModelConfig(dim=1024, n_layers=18, n_heads=16, n_kv_heads=8,
                                                               ffn_dim=4096, vocab_size=32000, max_seq_len=128),
                               "synthetic: no preset is ~4 GiB, so a 348M-param Llama-shaped config (dim 1024, "
                               "18 layers) built with the real model class"))
    return specs


def build_state(config) -> tuple[CheckpointState, int]:
    """Model + AdamW after one real optimizer step (moments and step counts populated), as train.py checkpoints it."""
    from model import Transformer

    torch.manual_seed(0)
    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = CheckpointState(model=ModelState(model), optimizer=OptimizerState(model, opt), train_state=TrainState(),
                            rng=RNGState())
    nbytes = plan_pieces(payload_pieces(state, 0)).tensor_bytes
    return state, nbytes


# --- physical limits ----------------------------------------------------------------------------------------------


def memcpy_seconds(state: CheckpointState, repeats: int = 2) -> float:
    """Single-threaded copy of every state tensor into one contiguous, pre-faulted buffer (what a snapshot costs)."""
    plan = plan_pieces(payload_pieces(state, 0))
    buf = np.zeros(plan.nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t, off in plan.copies:
            n = t.numel() * t.element_size()
            if n:
                np.copyto(buf[off:off + n], t.detach().reshape(-1).view(torch.uint8).numpy())
        best = min(best, time.perf_counter() - t0)
    del buf
    return best


def disk_write_fsync(directory: Path, nbytes: int, dd: bool = True) -> dict:
    """Sequential write + fsync of `nbytes` of non-zero data in 16 MiB blocks (dd bs=16M conv=fsync equivalent)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk-probe.bin"
    block = np.random.default_rng(0).integers(0, 256, 16 * MiB, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            view = memoryview(block)[: min(len(block), nbytes - written)]
            while view:
                n = os.write(fd, view)
                view = view[n:]
                written += n
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    result = {"bytes": nbytes, "seconds": seconds, "mib_s": nbytes / MiB / seconds}
    dd = shutil.which("dd") if dd else None
    if dd:
        out = subprocess.run([dd, "if=/dev/zero", f"of={path}", "bs=16M", f"count={nbytes // (16 * MiB)}",
                              "conv=fsync"], capture_output=True, text=True)
        path.unlink(missing_ok=True)
        m = re.search(r"copied, ([\d.]+) s", out.stderr)
        if m:
            result["dd_mib_s"] = (nbytes // (16 * MiB)) * 16 / float(m.group(1))
    return result


# --- per-backend save / load --------------------------------------------------------------------------------------


def backend_factories(first: bool, with_dcp: bool = True) -> list[tuple[str, object, int]]:
    """(label, factory(rank) -> Backend, host buffer sets to pre-allocate). N only matters when saves overlap, so the
    N sweep (and the no-pipelining variant) runs on the first, smallest state only."""
    quiet = {"log": lambda m: None}
    rows: list[tuple[str, object, int]] = [("vanilla (sync)", lambda r: make_backend("vanilla", r), 0)]
    for n in ((1, 2, 4) if first else (1,)):
        rows.append((f"concurrent N={n}", lambda r, n=n: ConcurrentBackend(r, max_async=n, **quiet), n))
    if first:
        rows.append(("concurrent N=1, no pipelining",
                     lambda r: ConcurrentBackend(r, max_async=1, pipeline=False, **quiet), 1))
        rows.append(("concurrent N=1, writer nice 10",
                     lambda r: ConcurrentBackend(r, max_async=1, writer_nice=10, **quiet), 1))
    if not with_dcp:
        rows.append(("dcp (sync)", "time budget: the ~4 GiB state runs vanilla and concurrent only", 0))
        rows.append(("dcp async", "time budget: the ~4 GiB state runs vanilla and concurrent only", 0))
        rows.append(("dcp async (process)", "time budget: the ~4 GiB state runs vanilla and concurrent only", 0))
    elif "dcp" in BACKENDS:
        rows.append(("dcp (sync)", lambda r: make_backend("dcp", r), 0))
        params = inspect.signature(backend_class("dcp").__init__).parameters
        flag = next((p for p in params if "async" in p.lower()), None)
        if flag is not None:
            rows.append((f"dcp async ({flag}=True)", lambda r, f=flag: make_backend("dcp", r, **{f: True}), 0))
            # DCP's background save process: it starts at the first save, so the best of the saves is steady state
            rows.append(("dcp async (process)", lambda r, f=flag: make_backend("dcp", r, **{f: "process"}), 0))
        else:
            rows.append(("dcp async", "no async option found on the dcp backend's constructor", 0))
    else:
        rows.append(("dcp (sync)", None, 0))
        rows.append(("dcp async", None, 0))
    return rows


def prewarm(backend, state: CheckpointState, sets: int) -> None:
    """Allocate the concurrent backend's buffer sets up front (train.py allocates them lazily at the first save(s));
    the allocation time is reported separately, once."""
    if not isinstance(backend, ConcurrentBackend) or sets <= 0:
        return
    nbytes = plan_pieces(payload_pieces(state, 0)).nbytes
    taken = [backend.pool.acquire(nbytes, False, "bench pre-allocation") for _ in range(sets)]
    for b in taken:
        backend.pool.release(b)


def measure_backend(label: str, factory, sets: int, state: CheckpointState, root: Path, state_label: str,
                    saves: int, burst: int) -> Row:
    row = Row(state_label, label)
    if factory is None or isinstance(factory, str):
        row.note = f"skipped: {factory or 'no `dcp` backend registered in checkpoint/backends yet'}"
        return row
    shutil.rmtree(root, ignore_errors=True)
    rank = RankInfo()
    try:
        backend = factory(rank)
    except Exception as e:  # noqa: BLE001 - a backend that cannot be built here is a note in the table, not a crash
        row.note = f"skipped: {type(e).__name__}: {e}"
        return row
    prewarm(backend, state, max(1, min(sets, burst or 1)) if sets else 0)
    manager = CheckpointManager(root, backend, rank, run_id="bench")
    step = 0
    stalls, calls, durables = [], [], []
    for _ in range(saves):
        step += 1
        t0 = time.perf_counter()
        manager.save(step, state)
        t1 = time.perf_counter()
        manager.wait_staged()
        t2 = time.perf_counter()
        manager.wait()
        t3 = time.perf_counter()
        calls.append(t1 - t0)
        stalls.append(t2 - t0)
        durables.append(t3 - t0)
        row.mib = manager.history[-1].bytes / MiB
    row.call_s, row.stall_s, row.durable_s = min(calls), min(stalls), min(durables)
    if burst:
        burst_stalls = []
        t0 = time.perf_counter()
        for _ in range(burst):
            step += 1
            s0 = time.perf_counter()
            manager.save(step, state)
            manager.wait_staged()
            burst_stalls.append(time.perf_counter() - s0)
        manager.wait()
        row.burst_total_s = time.perf_counter() - t0
        row.burst_stall_s = statistics.mean(burst_stalls)
        row.burst_saves = burst
    if isinstance(backend, ConcurrentBackend):
        row.host_mib = backend.pool.nbytes / MiB
    manager.close()
    gc.collect()
    t0 = time.perf_counter()
    loader = CheckpointManager(root, make_backend("vanilla", rank), rank, run_id="bench-load")
    loader.load(str(step), state)
    row.load_s = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    return row


# --- real training runs -------------------------------------------------------------------------------------------

_SAVE_LINE = re.compile(r"checkpoint step (\d+) committed: ([\d.]+) MiB, blocked ([\d.]+)s, durable after ([\d.]+)s")
_BLOCKED = re.compile(r"training blocked ([\d.]+)s")


def train_run(backend: str, every: int, steps: int, dataset: Path, root: Path, tokens: int, train_args: list[str],
              backend_args: list[str], warm: int = 5) -> TrainRun:
    run = TrainRun(backend, every, steps)
    ck = root / f"train-{backend.replace(' ', '_')}-{every}"
    shutil.rmtree(ck, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", "small", "--dataset", str(dataset), *train_args,
           "--training-steps", str(steps), "--checkpoint-frequency", str(every), "--checkpoint-dir", str(ck),
           "--log-loss-to-csv", "--max-kept-checkpoints", "2", "--logging-frequency", str(10 ** 6), *backend_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYRECOVER_FAULT", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        run.note = f"failed (rc {proc.returncode}): {(proc.stderr.strip().splitlines() or [''])[-1][:200]}"
        return run
    with open(ck / "default" / "loss.csv", newline="") as f:
        wall = {int(r["step"]): float(r["wall_time"]) for r in csv.DictReader(f)}
    saves = {int(m.group(1)): (float(m.group(3)), float(m.group(4))) for m in _SAVE_LINE.finditer(proc.stdout)}
    saves = {s: v for s, v in saves.items() if s < steps}  # the final save happens after the last measured step
    run.saves = len(saves)
    run.blocked_s = sum(b for b, _ in saves.values())
    run.persist_s = statistics.mean(d for _, d in saves.values()) if saves else float("nan")
    outside, during = [], []
    for i in range(warm + 1, steps + 1):
        stall = saves.get(i - 1, (0.0, 0.0))[0]
        compute = wall[i] - wall[i - 1] - stall
        start = wall[i - 1] + stall
        busy = any(wall[s] <= start < wall[s] + d for s, (_, d) in saves.items())
        (during if busy else outside).append(compute)
    run.loop_s = wall[steps] - wall[warm]
    run.n_during = len(during)
    if outside:
        run.tok_s_out = tokens / statistics.median(outside)
    if during:
        run.tok_s_during = tokens / statistics.median(during)
    run.extra = {"median_step_out": statistics.median(outside) if outside else None,
                 "median_step_during": statistics.median(during) if during else None, "n_steps": steps - warm}
    shutil.rmtree(ck, ignore_errors=True)
    return run


def finish_overheads(runs: list[TrainRun]) -> None:
    """Overheads against the no-checkpoint runs (one first, one last: their mean loop time and median step)."""
    bases = [r for r in runs if r.every == 0 and not r.note]
    if not bases:
        return
    base_loop = statistics.mean(r.loop_s for r in bases)
    for r in runs:
        if r.note or r.every == 0:
            continue
        r.overhead_wall_pct = 100 * (r.loop_s / base_loop - 1)
        med_out = r.extra["median_step_out"]
        extra = r.blocked_s + (r.n_during * (r.extra["median_step_during"] - med_out) if r.n_during else 0.0)
        r.overhead_est_pct = 100 * extra / (r.extra["n_steps"] * med_out)
    # Intervals whose run did not fit the time budget: projected from the same backend's every-10 run (cost per save =
    # blocked time + extra step time while persisting, spread over the longer interval). Marked as projections.
    for r in runs:
        if r.every and r.note.startswith("skipped"):
            src = next((x for x in runs if x.backend == r.backend and x.every == 10 and not x.note and x.saves), None)
            if src is not None and src.overhead_est_pct == src.overhead_est_pct:
                per_save = src.overhead_est_pct / 100 * src.extra["n_steps"] * src.extra["median_step_out"] / src.saves
                r.overhead_est_pct = 100 * per_save / (r.every * src.extra["median_step_out"])
                r.note = "not run (time budget); est. projected from every 10"


# --- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(ROOT / "checkpoints"), help="checkpoint directory: the disk measured")
    p.add_argument("--out", default=str(ROOT / "results"), help="where the table, JSON and PNG go")
    p.add_argument("--dataset", default=str(ROOT / "data" / "train_data.parquet"), help="corpus for the training runs")
    p.add_argument("--quick", action="store_true", help="small state only, short training runs (a smoke test)")
    p.add_argument("--budget-min", type=float, default=14.0,
                   help="stop starting new measurements that would end after this many minutes (skipped ones are "
                        "marked in the table)")
    p.add_argument("--train-steps", type=int, default=None, help="steps per training run (default 110; quick 30)")
    p.add_argument("--batch-size", type=int, default=2, help="training runs: samples per step")
    p.add_argument("--sequence-length", type=int, default=64, help="training runs: tokens per sample")
    p.add_argument("--replot", metavar="JSON", help="only rebuild the markdown and PNG from a previous run's JSON")
    p.add_argument("--part", choices=["all", "saves", "train"], default="all",
                   help="saves = physical limits + save/load table + writer experiment; train = the train.py runs only")
    args = p.parse_args(argv)
    if args.replot:
        return replot(Path(args.replot), Path(args.out))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process: expected

    t_start = time.perf_counter()
    deadline = t_start + 60 * args.budget_min

    def left() -> float:
        return deadline - time.perf_counter()

    # Everything goes into a fresh sub-folder of --dir, removed at the end; nothing else in --dir is touched.
    directory, out = Path(args.dir) / f"pyrecover-bench-{os.getpid()}", Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    fs = subprocess.run(["df", "-hT", str(directory)], capture_output=True, text=True).stdout.splitlines()
    meta = {"command": "python -m benchmarks.backends"
                       + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                       f"{mem_available() / GiB:.0f} GiB RAM available at start, torch threads {torch.get_num_threads()}",
            "dir": str(Path(args.dir)), "filesystem": " ".join(fs[-1].split()[:2]) if len(fs) > 1 else "?",
            "load_start": os.getloadavg()[0]}
    dataset = Path(args.dataset)
    if args.part != "saves" and not dataset.exists():
        print(f"error: {dataset} does not exist; run `make data` (or pass --dataset)", file=sys.stderr)
        return 2

    try:
        rows, limits, dip, runs = _run_all(args, meta, directory, dataset, left)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    meta["duration_min"] = (time.perf_counter() - t_start) / 60
    meta["load_end"] = os.getloadavg()[0]
    text = report(meta, limits, rows, runs, dip)
    (out / "checkpoint_bench.md").write_text(text)
    (out / "checkpoint_bench.json").write_text(json.dumps(
        {"meta": meta, "limits": limits, "rows": [r.__dict__ | {"mib_s": r.mib_s} for r in rows],
         "train": [r.__dict__ | {"dip_pct": r.dip_pct} for r in runs], "writer_dip": dip}, indent=1, default=str))
    plot(out / "checkpoint_bench.png", limits, rows, runs)
    print(text)
    log(f"wrote {out / 'checkpoint_bench.md'}, {out / 'checkpoint_bench.png'}, {out / 'checkpoint_bench.json'} "
        f"in {meta['duration_min']:.1f} min")
    return 0


def _run_all(args, meta: dict, directory: Path, dataset: Path, left) -> tuple[list[Row], dict, list[dict], list[TrainRun]]:
    log("disk: sequential write + fsync")
    limits: dict = {"disk": disk_write_fsync(directory, (256 if args.quick or args.part == "train" else 1024) * MiB),
                    "states": []}
    log(f"disk {limits['disk']['mib_s']:.0f} MiB/s (dd from /dev/zero {limits['disk'].get('dd_mib_s', float('nan')):.0f})")
    disk = limits["disk"]["mib_s"]
    # Budget: the save/load table and the writer experiment may use up to ~60% of the time, training the rest.
    static_until = left() * (0.4 if args.part == "all" else 0.0)

    rows: list[Row] = []
    dip: list[dict] = []
    for i, spec in enumerate(state_specs(args.quick) if args.part != "train" else []):
        first = i == 0
        est = _estimate_bytes(spec.config)
        factories = backend_factories(first, with_dcp=i < 2)
        saves, burst = (2, 4) if first else (1, 0)
        # one save + one load (reads the files and verifies them) per row, at disk speed, plus building the state
        row_s = (saves + burst) * est / MiB / disk + 2 * est / MiB / max(disk, 1) + 1
        if not first and left() - static_until < row_s * 2 + 15:
            log(f"state {spec.label}: skipped (time budget)")
            limits["states"].append({"label": spec.label, "note": spec.note + " — skipped: time budget",
                                     "mib": est / MiB, "memcpy_s": float("nan")})
            rows += [Row(spec.label, label, note="skipped: time budget") for label, _, _ in factories]
            continue
        if mem_available() < 2.6 * est:
            log(f"state {spec.label}: skipped, needs ~{2.6 * est / GiB:.1f} GiB free RAM")
            limits["states"].append({"label": spec.label, "note": spec.note + " — skipped: RAM", "mib": est / MiB,
                                     "memcpy_s": float("nan")})
            rows += [Row(spec.label, label, note="skipped: RAM") for label, _, _ in factories]
            continue
        log(f"state {spec.label}: building ({spec.note})")
        state, nbytes = build_state(spec.config)
        size16 = -(-nbytes // (16 * MiB)) * 16 * MiB
        entry = {"label": spec.label, "note": spec.note, "mib": nbytes / MiB, "memcpy_s": memcpy_seconds(state),
                 "disk": []}
        limits["states"].append(entry)
        log(f"state {spec.label}: {nbytes / MiB:.0f} MiB, memcpy {entry['memcpy_s']:.3f}s")
        for label, factory, sets in factories:
            need_mem = nbytes * (2.5 + (sets if label.startswith("concurrent") else 0))
            if not isinstance(factory, (type(None), str)):
                if mem_available() < need_mem:
                    rows.append(Row(spec.label, label, note=f"skipped: needs ~{need_mem / GiB:.1f} GiB free RAM"))
                    continue
                if not first and left() - static_until < row_s:
                    rows.append(Row(spec.label, label, note="skipped: time budget"))
                    continue
            log(f"state {spec.label}: {label}")
            disk_ref = float("nan")
            if not isinstance(factory, (type(None), str)):
                disk_ref = disk_write_fsync(directory, size16, dd=False)["mib_s"]  # the physical limit, right now
                entry["disk"].append(disk_ref)
            row = measure_backend(label, factory, sets, state, directory / "ckpt", spec.label, saves=saves, burst=burst)
            row.disk_mib_s = disk_ref
            rows.append(row)
            log(f"  write+fsync {fmt(disk_ref, 0)} MiB/s | stall {fmt(row.stall_s)}s save() {fmt(row.call_s)}s "
                f"durable {fmt(row.durable_s, 2)}s {fmt(row.mib_s, 0)} MiB/s load {fmt(row.load_s, 2)}s {row.note}")
        if entry["disk"]:
            entry["disk_mib_s"] = statistics.median(entry["disk"])
        if first:
            log("writer thread vs writer process")
            dip = writer_dip(nbytes, directory / "dip", 1.5, 3 if args.quick else 4, args.batch_size,
                             args.sequence_length)
            for d in dip:
                log(f"  {d['writer']}: median step {d['median_step_s']:.3f}s ({d['dip_pct']:.1f}%), {d['mib_s']:.0f} MiB/s")
        del state
        gc.collect()
    if args.part != "train":
        limits["disk_end"] = disk_write_fsync(directory, (256 if args.quick else 1024) * MiB)
        log(f"disk again: {limits['disk_end']['mib_s']:.0f} MiB/s")

    runs: list[TrainRun] = []
    if args.part == "saves":
        return rows, limits, dip, runs
    steps = args.train_steps or (30 if args.quick else 110)
    tokens = args.batch_size * args.sequence_length
    train_args = ["--batch-size", str(args.batch_size), "--sequence-length", str(args.sequence_length)]
    meta["train"] = (f"batch {args.batch_size} x seq {args.sequence_length} ({tokens} tokens/step), {steps} steps per "
                     "run, at most 2 checkpoints kept, torch's default threads")
    intervals = (10,) if args.quick else (10, 50, 100)
    plans = [("none", 0, ["--checkpoint-backend", "vanilla"])]
    for every in intervals:  # the most informative first: when the budget runs out, the tail is skipped
        plans.append(("concurrent N=2", every, ["--checkpoint-backend", "concurrent", "--max-async", "2"]))
        plans.append(("vanilla (sync)", every, ["--checkpoint-backend", "vanilla"]))
        if "dcp" in BACKENDS:
            plans.append(("dcp async", every, ["--checkpoint-backend", "dcp", "--async-checkpoint"]))
    plans.append(("none", 0, ["--checkpoint-backend", "vanilla"]))  # again at the end: load drift shows up here
    run_s = None
    for k, (backend, every, bargs) in enumerate(plans):
        last = k == len(plans) - 1
        if run_s is not None and left() < run_s * (1.0 if last else 2.0):  # keep room for the closing baseline
            runs.append(TrainRun(backend, every, steps, note="skipped: time budget"))
            continue
        log(f"train.py small: {backend}, checkpoint every {every or 'never'}")
        t0 = time.perf_counter()
        run = train_run(backend, every, steps, dataset, directory, tokens, train_args, bargs)
        run_s = max(run_s or 0.0, time.perf_counter() - t0)
        runs.append(run)
        log(f"  loop {fmt(run.loop_s, 1)}s blocked {fmt(run.blocked_s, 2)}s tok/s {fmt(run.tok_s_out, 0)} "
            f"while persisting {fmt(run.tok_s_during, 0)} {run.note}")
    finish_overheads(runs)
    return rows, limits, dip, runs


def replot(path: Path, out: Path) -> int:
    data = json.loads(path.read_text())

    rows = [from_dict(Row, d) for d in data["rows"]]
    runs = [from_dict(TrainRun, d) for d in data["train"]]
    text = report(data["meta"], data["limits"], rows, runs, data["writer_dip"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_bench.md").write_text(text)
    plot(out / "checkpoint_bench.png", data["limits"], rows, runs)
    print(text)
    return 0


def _estimate_bytes(config) -> int:
    """Model + AdamW bytes (fp32 weights and two moments) without building the model."""
    d, f, v, L = config.dim, config.ffn_dim, config.vocab_size, config.n_layers
    kv = config.n_kv_heads * config.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    return 12 * (2 * v * d + L * per_layer + d)


if __name__ == "__main__":
    sys.exit(main())
