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
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from check_weights_equality import compare
from helpers import PY, ROOT, TINY, env_for_tests

from . import model
from .recorder import Mount, fuse_problem

STEPS = 6
# Saves at 2, 4 and 6 with one kept: every save after the first replaces the previous one (retention), and the run
# ends with a final save; the token cache is built on the traced filesystem too. Three traces per configuration:
#   run     a fresh start: the lease, the token cache, three saves, two retentions, the end;
#   sweep   a restart over the leftovers of a run killed halfway through writing step 6 (its staging folder, temporary
#           files): the start-up sweep, then steps 5-6 and the save of step 6 again;
#   retire  a restart from step 4 (`--resume-from-checkpoint 4`) over a run folder that also holds step 6: the newer
#           line is retired (moved aside), then steps 5-6 are trained and saved again.
SCENARIOS = ("run", "sweep", "retire")
RUN = TINY + ["--training-steps", str(STEPS), "--checkpoint-frequency", "2",
       "--experiment-name", "e", "--max-kept-checkpoints", "1", "--log-loss-to-csv", "--data-cache-dir", "{root}/cache"]
CONFIGS = {
    "vanilla": ["--checkpoint-backend", "vanilla"],
    "dcp": ["--checkpoint-backend", "dcp"],
    "concurrent": ["--checkpoint-backend", "concurrent"],
    "mirror": ["--checkpoint-backend", "vanilla", "--mirror-dir", "{root}/mirror", "--mirror-keep", "1"],
}
# What this campaign found, each fixed, each with its crash state as a regression test in tests/test_powerloss.py.
FOUND = [
    "a new run folder (and .owner/, the JIT folder, a retired line's folder, the local tier's folders, the loss "
    "CSV's folder) was made with mkdir -p and never fsynced into its parent: strict POSIX could lose the run folder "
    "with every checkpoint reported in it (fix: fsio.make_dirs; test_new_folders_are_durable_once_make_dirs_returns)",
    "`hf.py export --force` renamed the earlier export aside, then the new one in: a power cut between the two "
    "(both pending until one folder fsync) left no OUT at all (fix: one RENAME_EXCHANGE swap where the filesystem "
    "has it; test_replacing_an_export_keeps_out_whole_in_every_crash_state)",
    "loss CSV rows appended after the last sync survived as zeros (ext4, mirror configuration) and the resume died "
    "on int('\\x00...') (fix: metrics._whole_rows stops at the first torn row; "
    "test_a_torn_loss_csv_tail_is_dropped_on_resume)",
    "torch's FileSystemWriter fsyncs its buffered stream without flushing it (upstream filesystem.py, "
    "FileSystemWriter.finish and _write_files_from_queue), so a small .metadata tail misses the fsync; our DCP "
    "stream flushes before DCP fsyncs (test_dcp_files_are_flushed_before_dcp_fsyncs_them)",
]
REPORTED = re.compile(r"checkpoint step (\d+) committed")
RESUMED = re.compile(r"resumed from .*\(step (\d+)")


def _args(config: str, root: Path, extra: tuple = ()) -> list[str]:
    flags = [a.replace("{root}", str(root)) for a in RUN + CONFIGS[config]]
    return [PY, str(ROOT / "train.py"), *flags, "--checkpoint-dir", str(root / "ck"), *extra]


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_for_tests(), cwd=ROOT)


@dataclass
class Trace:
    ops: list
    log_dir: Path
    reports: list = field(default_factory=list)  # (monotonic ns when the line arrived, step)
    floor0: int = 0  # the step a crash may go back to before anything of this trace was reported

    def floor(self, k: int) -> int:
        """The newest step reported durable before the k-th operation: a crash there must not resume older."""
        if k <= 0:
            return self.floor0
        t = self.ops[k - 1][1]
        return max((step for when, step in self.reports if when < t), default=self.floor0)


def trace(config: str, work: Path, *, start: tuple | None = None, extra: tuple = (), floor0: int = 0) -> Trace:
    """One uninterrupted run on the recording filesystem, its report lines stamped as they arrive. ``start``:
    (state, trace it comes from) to put on the backing folder first, as the durable state at mount time."""
    log_dir = work / "log"
    if start is not None:
        model.materialize(start[0], start[1].ops, start[1].log_dir, work / "backing")
    reports = []
    with Mount(work / "backing", work / "mnt", log_dir):
        proc = subprocess.Popen(_args(config, work / "mnt", extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env_for_tests(), cwd=ROOT)
        out = []
        for line in proc.stdout:
            out.append(line)
            if m := REPORTED.search(line):
                reports.append((time.monotonic_ns(), int(m.group(1))))
        if proc.wait() != 0:
            raise RuntimeError(f"the traced {config} run ({work.name}) failed:\n{''.join(out[-30:])}")
    return Trace(model.load(log_dir), log_dir, reports, floor0)


def _publish_of(ops: list, step: int) -> int:
    """The index of the rename that published step ``step``."""
    name = f"step-{step:08d}"
    return next(i for i, op in enumerate(ops) if op[0] == "rename" and op[5] == name)


def traces(config: str, work: Path, scenarios=SCENARIOS) -> dict[str, Trace]:
    first = trace(config, work / "run")
    out = {"run": first}
    publish = _publish_of(first.ops, STEPS)
    if "sweep" in scenarios:  # killed halfway through writing step 6: its staging folder, files and temporaries
        begun = next(i for i, op in enumerate(first.ops) if op[0] == "mkdir" and op[3] == f"step-{STEPS:08d}")
        killed = (begun + publish) // 2
        out["sweep"] = trace(config, work / "sweep", start=(model.visible_at(first.ops, killed), first),
                             extra=("--resume-from-checkpoint", "latest"), floor0=first.floor(killed))
    if "retire" in scenarios:  # step 6 published, step 4 not yet removed by retention; the user goes back to step 4
        out["retire"] = trace(config, work / "retire", start=(model.visible_at(first.ops, publish + 1), first),
                              extra=("--resume-from-checkpoint", str(STEPS - 2)), floor0=STEPS - 2)
    return {k: v for k, v in out.items() if k in scenarios}


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
        final = _final(root)
        if problems := [p for s in final for p in compare(final[s], ref[0][s], 0, False, s)]:  # bitwise
            return Outcome("mismatched", f"differs from the uninterrupted run: {problems[0]}", resumed)
        rows = _rows(root)
        if rows != ref[1]:
            steps = [r[0] for r in rows]
            return Outcome("mismatched", f"loss CSV rows differ from the uninterrupted run (steps {steps})", resumed)
        return Outcome("ok", "", resumed)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


@dataclass
class _Distinct:
    state: dict
    floor: int  # the strictest floor among the crash points that leave this state
    where: tuple  # (scenario, profile, k, variant) of one of them, to reproduce it
    base: bool = False  # some crash point leaves it with only what was made durable (variant 0)
    covers: int = 0  # how many crash points leave it


def campaign(config: str, work: Path, profiles: list[str], variants: int, max_runs: int, seed: int, jobs: int,
             say=print, scenarios=SCENARIOS, trace_as_reference: bool = False) -> dict:
    """Every durable-only crash state (variant 0) of every crash point is resumed; of the seeded variants, at most
    ``max_runs`` distinct ones (0 = all), sampled with the seed. ``trace_as_reference``: the uninterrupted run the
    resumed states are compared with is the traced fresh run itself (the same flags, uninterrupted: what it wrote, in
    its backing folder once unmounted) instead of one more run on the plain disk (a train.py run and a tokenization
    less). A trace that training on the recording filesystem had changed still shows: the crash states before its
    first checkpoint resume from nothing, on the plain disk, and would differ from it."""
    work.mkdir(parents=True, exist_ok=True)
    ref = None if trace_as_reference else reference(config, work)
    trs = traces(config, work, scenarios)
    if ref is None:
        ref = _final(work / "run" / "backing"), _rows(work / "run" / "backing")  # trace(config, work / "run")
    distinct: dict[tuple, _Distinct] = {}
    tried = 0
    for scenario, tr in trs.items():
        for profile in profiles:
            for k, v, state, sig in model.states(tr.ops, profile, variants=variants, seed=seed):
                tried += 1
                d = distinct.setdefault((scenario, sig), _Distinct(state, -1, (scenario, profile, k, v)))
                d.covers += 1
                d.base |= v == 0
                if tr.floor(k) > d.floor:
                    d.floor, d.where = tr.floor(k), (scenario, profile, k, v)
    base = [d for d in distinct.values() if d.base]
    extra = [d for d in distinct.values() if not d.base]
    if max_runs and len(extra) > max_runs:
        extra = random.Random(seed).sample(extra, max_runs)
    chosen = base + extra
    results = {"config": config, "ops": {n: len(t.ops) for n, t in trs.items()}, "tried": tried,
               "distinct": len(distinct), "ran": len(chosen), "checked": sum(d.covers for d in chosen),
               "lost": [], "mismatched": [], "reported": {n: [s for _, s in t.reports] for n, t in trs.items()}}
    lock = threading.Lock()

    def one(d: _Distinct):
        scenario, profile, k, v = d.where
        tr = trs[scenario]
        out = check(config, d.state, tr, d.floor, ref, work)
        if out.verdict != "ok":
            op = tr.ops[k - 1] if k else None
            line = (f"{config} {scenario} {profile} k={k} variant={v} seed={seed} (after {op[0] if op else 'nothing'}"
                    f" {op[2:] if op and op[0] != 'write' else ''}): {out.why}")
            with lock:
                results[out.verdict].append(line)
                say(f"  {out.verdict.upper()}: {line}")

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, chosen))
    return results


def export_campaign(work: Path, source: Path, profiles: list[str], variants: int, seed: int) -> dict:
    """``python hf.py export`` into a fresh OUT, then again with --force over it (another dtype, so the bytes
    differ), on the recording filesystem. Once the first export has returned, every crash state must hold OUT whole:
    the first export or the second, never neither, never a mix."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "mnt" / "out"
    export = [PY, str(ROOT / "hf.py"), "export", str(source), str(out), "--to", "hf"]
    with Mount(work / "backing", work / "mnt", work / "log"):
        for extra in (("--dtype", "bfloat16"), ("--force",)):
            proc = _run(export + list(extra))
            if proc.returncode:
                raise RuntimeError(f"hf.py export failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            if extra[0] == "--dtype":
                first_done = time.monotonic_ns()
    ops = model.load(work / "log")
    reported = sum(1 for op in ops if op[1] < first_done)  # crash points from here on: the first export was reported
    old = model.files(model.visible_at(ops, reported), ops, work / "log", "out")
    new = model.files(model.visible_at(ops, len(ops)), ops, work / "log", "out")
    assert old and new and old != new, "the two exports should differ"
    results = {"config": "export", "ops": {"export": len(ops)}, "tried": 0, "distinct": 0, "ran": 0, "checked": 0,
               "lost": [], "mismatched": [], "reported": {"export": ["first export"]}}
    seen: dict[tuple, str] = {}
    for profile in profiles:
        for k, v, state, _ in model.states(ops, profile, variants=variants, seed=seed):
            results["tried"] += 1
            sub = tuple(sorted((p, w) for p, w in state.items() if p == "out" or p.startswith("out/")))
            key = (sub, k >= reported)
            if key not in seen:
                got = model.files(state, ops, work / "log", "out")
                if got in (old, new) or (k < reported and not got):
                    seen[key] = ""
                else:
                    which = "missing" if "out" not in state else "empty" if not got else "neither export (mixed or torn)"
                    seen[key] = f"export {profile} k={k} variant={v} seed={seed} (after {ops[k - 1][0]}): OUT {which}"
            results["checked"] += 1
            if seen[key]:
                results["lost"].append(seen[key])
    results["distinct"] = results["ran"] = len(seen)
    results["lost"] = sorted(set(results["lost"]))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.powerloss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="vanilla,dcp,concurrent,mirror")
    p.add_argument("--profiles", default=",".join(model.PROFILES))
    p.add_argument("--variants", type=int, default=1, help="seeded crash states per crash point beyond the "
                   "durable-only one, each keeping a random choice of unsynced operations (default: 1)")
    p.add_argument("--max-runs", type=int, default=40, help="every durable-only crash state is resumed; of the "
                   "seeded variants at most N distinct ones per configuration, sampled with the seed (0 = all; "
                   "default: 40)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="traces per configuration (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-export", dest="export", action="store_false",
                   help="skip the crash states of `hf.py export --force` replacing an earlier export")
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
    # a SIGTERM (timeout, Ctrl-C's cousin) unwinds like an exception, so every recording mount is unmounted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.work or Path(tempfile.mkdtemp(prefix="powerloss-"))
    t0 = time.monotonic()
    scenarios = [x for x in args.scenarios.split(",") if x]
    if unknown := [x for x in scenarios if x not in SCENARIOS]:
        print(f"error: unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    totals = {"tried": 0, "distinct": 0, "ran": 0, "checked": 0, "lost": 0, "mismatched": 0}
    try:
        for config in configs:
            r = campaign(config, work / config, profiles, args.variants, args.max_runs, args.seed, args.jobs,
                         scenarios=scenarios)
            print(f"{config}: operations traced {r['ops']}, reported durable {r['reported']}; crash states "
                  f"{r['tried']}, distinct {r['distinct']}, resumed {r['ran']} (covering {r['checked']} crash "
                  f"states): lost {len(r['lost'])}, mismatched {len(r['mismatched'])}", flush=True)
            for key in totals:
                totals[key] += len(r[key]) if isinstance(r[key], list) else r[key]
        if args.export:
            source = work / configs[0] / "ref" / "ck" / "e" if configs else None
            if source is None or not source.exists():
                reference("vanilla", work / "export-ref")
                source = work / "export-ref" / "ref" / "ck" / "e"
            r = export_campaign(work / "export", source, profiles, args.variants, args.seed)
            for line in r["lost"]:
                print(f"  LOST: {line}")
            print(f"export (hf.py export, then --force over it): operations traced {r['ops']['export']}; crash "
                  f"states {r['tried']}, distinct {r['distinct']}, all checked: lost {len(r['lost'])}", flush=True)
            for key in totals:
                totals[key] += len(r[key]) if isinstance(r[key], list) else r[key]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total ({', '.join(configs)}; {', '.join(scenarios)}; profiles {', '.join(profiles)}; variants "
          f"{args.variants}, seed {args.seed}): crash states {totals['tried']}, distinct {totals['distinct']}, "
          f"resumed {totals['ran']}, crash states checked {totals['checked']}, lost {totals['lost']}, mismatched "
          f"{totals['mismatched']}, found and fixed {len(FOUND)} ({time.monotonic() - t0:.0f}s)")
    for line in FOUND:
        print(f"  found and fixed: {line}")
    return 1 if totals["lost"] or totals["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
