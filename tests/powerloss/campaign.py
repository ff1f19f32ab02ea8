"""The power-loss campaign: trace one real training run per configuration on the recording filesystem, enumerate
the crash states its log allows (model.py), and resume real training from each distinct one.

    python -m tests.powerloss [--configs vanilla,dcp,concurrent,mirror] [--profiles posix,ext4,nfs]
                              [--variants N] [--max-runs N] [--seed S] [--jobs J]

A crash state passes when ``--resume-from-checkpoint latest`` on it
  - exits 0, resuming from a committed checkpoint that verified (every load verifies; a failed one exits non-zero),
  - from a step no older than the newest checkpoint the run had reported durable ("checkpoint step N committed")
    before the crash point,
  - and ends with weights and optimizer state bitwise equal to an uninterrupted run's, with a loss CSV that holds
    every step once, each row equal to the uninterrupted run's.
A state that breaks the first two is *lost*; one that breaks the last is *mismatched*. Equal states (the same files
built from the same writes) are resumed once: the counts say how many crash states were tried and how many distinct
ones ran.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import model
from .recorder import Mount, fuse_problem

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# Saves at 2, 4 and 6 with one kept: every save after the first replaces the previous one (retention), and the run
# ends with a final save, so one trace holds the start-up, three saves, two retentions and the lease's retirement.
RUN = ["--model", "tiny", "--sequence-length", "32", "--batch-size", "4", "--lr-warmup-steps", "5",
       "--logging-frequency", "5", "--training-steps", str(STEPS), "--checkpoint-frequency", "2",
       "--experiment-name", "e", "--max-kept-checkpoints", "1", "--log-loss-to-csv"]
CONFIGS = {
    "vanilla": ["--checkpoint-backend", "vanilla"],
    "dcp": ["--checkpoint-backend", "dcp"],
    "concurrent": ["--checkpoint-backend", "concurrent"],
    "mirror": ["--checkpoint-backend", "vanilla", "--mirror-dir", "{root}/mirror", "--mirror-keep", "1"],
}
REPORTED = re.compile(r"checkpoint step (\d+) committed")
RESUMED = re.compile(r"resumed from .*\(step (\d+)")


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYRECOVER_FAULT", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    return env


def _args(config: str, root: Path, extra: tuple = ()) -> list[str]:
    flags = [a.replace("{root}", str(root)) for a in CONFIGS[config]]
    return [sys.executable, str(ROOT / "train.py"), *RUN, *flags, "--checkpoint-dir", str(root / "ck"), *extra]


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


@dataclass
class Trace:
    ops: list
    log_dir: Path
    reports: list = field(default_factory=list)  # (monotonic ns when the line arrived, step)

    def floor(self, k: int) -> int:
        """The newest step reported durable before the k-th operation: a crash there must not resume older."""
        if k <= 0:
            return 0
        t = self.ops[k - 1][1]
        return max((step for when, step in self.reports if when < t), default=0)


def trace(config: str, work: Path) -> Trace:
    """One uninterrupted run on the recording filesystem; its report lines stamped as they arrive."""
    log_dir = work / "log"
    reports = []
    with Mount(work / "backing", work / "mnt", log_dir):
        proc = subprocess.Popen(_args(config, work / "mnt"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=_env(), cwd=ROOT)
        out = []
        for line in proc.stdout:
            out.append(line)
            if m := REPORTED.search(line):
                reports.append((time.monotonic_ns(), int(m.group(1))))
        if proc.wait() != 0:
            raise RuntimeError(f"the traced {config} run failed:\n{''.join(out[-30:])}")
    return Trace(model.load(log_dir), log_dir, reports)


def reference(config: str, work: Path) -> tuple[dict, list]:
    """The uninterrupted run's final weights and optimizer state, and its loss rows."""
    proc = _run(_args(config, work / "ref"))
    if proc.returncode:
        raise RuntimeError(f"the reference {config} run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return _final(work / "ref"), _rows(work / "ref")


def _final(root: Path) -> dict:
    from checkpoint.reader import read_section

    run = root / "ck" / "e"
    return {s: read_section(str(run), s) for s in ("model", "optimizer")}


def _rows(root: Path) -> list:
    with open(root / "ck" / "e" / "loss.csv", newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    keep = [i for i, h in enumerate(header) if h in ("step", "loss", "lr", "grad_norm", "tokens_seen")]
    return [tuple(r[i] for i in keep) for r in rows[1:]]


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8) if a.numel() else a, b.reshape(-1).view(torch.uint8) if b.numel() else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass
class Outcome:
    verdict: str  # "ok" | "lost" | "mismatched"
    why: str = ""
    resumed: int = 0


def check(config: str, state: dict, trace_: Trace, floor: int, ref: tuple, work: Path) -> Outcome:
    root = Path(tempfile.mkdtemp(dir=work, prefix="state-")) / "root"
    try:
        model.materialize(state, trace_.ops, trace_.log_dir, root)
        proc = _run(_args(config, root, ("--resume-from-checkpoint", "latest")))
        text = proc.stdout + proc.stderr
        m = RESUMED.search(text)
        resumed = int(m.group(1)) if m else 0
        if proc.returncode:
            return Outcome("lost", f"resume exited {proc.returncode}: {text.strip().splitlines()[-1][:300]}", resumed)
        if resumed < floor:
            return Outcome("lost", f"resumed from step {resumed}, but step {floor} had been reported durable", resumed)
        if not _same(_final(root), ref[0]):
            return Outcome("mismatched", "final weights or optimizer state differ from the uninterrupted run", resumed)
        rows = _rows(root)
        if rows != ref[1]:
            steps = [r[0] for r in rows]
            return Outcome("mismatched", f"loss CSV rows differ from the uninterrupted run (steps {steps})", resumed)
        return Outcome("ok", "", resumed)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


def campaign(config: str, work: Path, profiles: list[str], variants: int, max_runs: int, seed: int, jobs: int,
             say=print) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    ref = reference(config, work)
    tr = trace(config, work / "trace")
    distinct: dict[int, tuple] = {}  # signature -> (state, strictest floor, (profile, k, variant))
    tried = 0
    for profile in profiles:
        for k, v, state, sig in model.states(tr.ops, profile, variants=variants, seed=seed):
            tried += 1
            floor = tr.floor(k)
            if sig not in distinct or floor > distinct[sig][1]:
                distinct[sig] = (state, floor, (profile, k, v))
    chosen = list(distinct.values())
    if max_runs and len(chosen) > max_runs:
        chosen = random.Random(seed).sample(chosen, max_runs)
    results = {"config": config, "ops": len(tr.ops), "tried": tried, "distinct": len(distinct), "ran": len(chosen),
               "lost": [], "mismatched": [], "reported": [s for _, s in tr.reports]}
    lock = threading.Lock()

    def one(item):
        state, floor, where = item
        out = check(config, state, tr, floor, ref, work)
        if out.verdict != "ok":
            profile, k, v = where
            op = tr.ops[k - 1] if k else None
            line = (f"{config} {profile} k={k} variant={v} (after {op[0] if op else 'nothing'} "
                    f"{op[2:] if op and op[0] != 'write' else ''}): {out.why}")
            with lock:
                results[out.verdict].append(line)
                say(f"  {out.verdict.upper()}: {line}")

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, chosen))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.powerloss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="vanilla,dcp,concurrent,mirror")
    p.add_argument("--profiles", default=",".join(model.PROFILES))
    p.add_argument("--variants", type=int, default=2, help="seeded crash states per crash point beyond the "
                   "durable-only one, each keeping a random choice of unsynced operations (default: 2)")
    p.add_argument("--max-runs", type=int, default=0, help="resume at most N distinct states per configuration, "
                   "sampled with the seed (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    args = p.parse_args(argv)
    if problem := fuse_problem():
        print(f"error: the recording filesystem cannot run here: {problem}", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    profiles = [q for q in args.profiles.split(",") if q]
    for name, known in (("configuration", CONFIGS), ("profile", model.PROFILES)):
        for x in (configs if name == "configuration" else profiles):
            if x not in known:
                print(f"error: unknown {name} {x!r}; choose from {', '.join(known)}", file=sys.stderr)
                return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="powerloss-"))
    t0 = time.monotonic()
    totals = {"tried": 0, "distinct": 0, "ran": 0, "lost": 0, "mismatched": 0}
    try:
        for config in configs:
            r = campaign(config, work / config, profiles, args.variants, args.max_runs, args.seed, args.jobs)
            print(f"{config}: {r['ops']} operations traced, reported durable {r['reported']}; crash states tried "
                  f"{r['tried']}, distinct {r['distinct']}, resumed {r['ran']}: lost {len(r['lost'])}, "
                  f"mismatched {len(r['mismatched'])}", flush=True)
            for key in totals:
                totals[key] += len(r[key]) if isinstance(r[key], list) else r[key]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total ({', '.join(profiles)}; variants {args.variants}, seed {args.seed}): crash states tried "
          f"{totals['tried']}, distinct {totals['distinct']}, resumed {totals['ran']}, lost {totals['lost']}, "
          f"mismatched {totals['mismatched']} ({time.monotonic() - t0:.0f}s)")
    return 1 if totals["lost"] or totals["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
