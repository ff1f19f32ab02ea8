"""Rank failures for the goodput benchmark: `python -m benchmarks.goodput --failure rank|mixed` (issue 56, item 7).

Each failure SIGKILLs ONE rank process (not the launcher, not the job) at the times of a seeded Poisson process of mean
MTBF, in wall seconds from each configuration's start; the rank is drawn per failure from the seed. Two configurations
run on the same schedule, the same training (--ranks gloo ranks of `small`, the node-local tier in /dev/shm every
--local-every steps, the shared tier every --shared-every):

- cold (torchrun): after a rank's death torchrun's agent stops the survivors and the job ends; the harness restarts it
  at once with `--resume-from-checkpoint latest` (today's path);
- in-process (launcher.py --spares K): the survivors keep their processes, a waiting spare takes the dead rank, every
  rank reloads the newest step they all reach and goes on. The rank's process is found from the launcher's lines
  (`member m pid P rank R|spare` at start, `generation G: ... member s (spare) takes rank r` per recovery). K: --spares,
  else the failures of the schedule within the cold run's wall time (at least 1). With too few spares the launcher
  aborts, the ranks end, and the harness restarts the job cold, as for torchrun.

--failure mixed: each failure is, drawn from the seed with even odds, one rank SIGKILLed as above or the whole job
(the launcher and every member: on one machine a lost node is the whole job), after which both configurations restart
cold.

Before them a failure-free run of the same training under torchrun gives the failure-free wall time and start-up, and
the final model the kill runs must equal bitwise (tests/check_weights_equality.py --tolerance 0 --optimizer on the final
step; the loss rows' deterministic columns are compared too).

Each run's goodput takes its step time from the run itself, never from another run: the machine is shared, and a load
that differs between the reference run and a measured run (minutes apart) made a step time borrowed from the reference
meaningless (a rerun came out at goodput 1.21). Per run (the reference too, for comparison):

    t_step         = the run's median step interval (loss CSV, step_interval)
    goodput        = t_step x N / wall
    goodput_steady = t_step x (N - 1) / (wall - startup)

startup = the launch of the run's first start to its first step done: the job's one-time start-up (a long job amortises
it; the in-process configuration also starts its spares then), reported apart as startup_s. The reference's steady
goodput is the ceiling of the others': its saves, the slower steps among them and its final save are still counted.
A configuration that slows every step (its spares' CPU, say) shows it in t_step_s, not in its goodput.

Cost per failure (cost_per_failure_s: the median over the failures) is accounted from the loss CSV's times, redone
work included: a failure while the job's newest step done is s (done at w_s) costs the time until step s + 1 is first
done after it, less one step: c = w'_{s+1} - w_s - t_step, t_step the median step interval of the same run. Failures
that strike before that step (a kill inside a recovery) share one window, split evenly. Beside it,
cost_per_failure_wall_s = (wall - failure-free wall) / failures, which also counts what failures cost the start and the
finish and the drift of the machine's speed between runs.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from tests.faults.harness import Run, _attempt_pids, _ATTEMPT_VAR
from tests.helpers import env_for_tests

from benchmarks import goodput_common as g  # the harness's shared pieces (goodput.py imports this module)

START = re.compile(r"launcher: member (\d+) pid (\d+) (?:rank (\d+)|spare)")
GENERATION = re.compile(r"launcher: generation (\d+): (.*)")
TAKES = re.compile(r"member (\d+) \(spare\) takes rank (\d+)")
# rank 0's line after an in-process recovery (train.py recovery_line)
INPROCESS = re.compile(r"recovery: (?P<what>.*?) failed; generation (?P<gen>\d+) resumed step (?P<step>\d+) from "
                       r"(?P<src>.*?) in-process; (?:detect (?P<detect>[\d.]+)s, )?tear down (?P<teardown>[\d.]+)s, "
                       r"agree (?P<agree>[\d.]+)s, load (?P<load>[\d.]+)s, first step (?P<first_step>[\d.]+)s; "
                       r"(?P<total>[\d.]+)s in all")
# rank 0's line after a restart (metrics.recovery_line): process start to the first step, in parts
RESTART = re.compile(r"recovery: first step after resume (?P<total>[\d.]+)s after process start \((?P<parts>.*?)\)")
PART = re.compile(r"([a-z -]+?) ([\d.]+)s")
INPROCESS_PARTS = ("detect", "teardown", "agree", "load", "first_step", "total")
RESTART_PARTS = ("python start-up", "imports", "setup", "checkpoint load", "first step")
CONFIGS = ("cold", "in-process")
LABELS = {"cold": "cold (torchrun, restart)", "in-process": "in-process (launcher.py, spares)"}


def log(msg: str) -> None:
    print(msg, flush=True)


# --- the schedule ----------------------------------------------------------------------------------------------------


@dataclass
class Planned:
    """One failure of the schedule: at ``at`` s from the start (or, with ``step``, as the job completes that step),
    ``kind`` rank (SIGKILL the holder of rank ``rank``) or job (SIGKILL the launcher and every process)."""

    at: float
    kind: str
    rank: int
    step: int | None = None


def schedule(seed: int, mtbf: float, failure: str, ranks: int, times: list[float] | None = None,
             steps: list[int] | None = None) -> Iterator[Planned]:
    """The failures, without end: the times of goodput.kill_schedule (or ``times``, or ``steps``), each with its kind
    (``failure`` rank: always rank; mixed: rank or job, even odds) and its rank, both drawn from the seed per failure,
    so every configuration meets the same failures."""
    if steps:
        when: Iterator = ((math.inf, s) for s in steps)
    else:
        when = ((t, None) for t in (times if times is not None else g.kill_schedule(seed, mtbf)))
    for i, (t, step) in enumerate(when):
        rng = random.Random(f"rank-failure {seed} {i}")
        rank = rng.randrange(ranks)  # first: --failure rank and mixed draw the same ranks
        yield Planned(t, "job" if failure == "mixed" and rng.random() < 0.5 else "rank", rank, step)


# --- running a job ---------------------------------------------------------------------------------------------------


@dataclass
class Kill:
    """One failure as it happened. Times in s from the job's start."""

    at: float
    kind: str
    rank: int
    pid: int | None  # the rank's process (None for a job kill)
    member: int | None  # in-process: the launcher's member that held the rank
    incarnation: int
    done_step: int  # the job's newest step done at the kill (0: none)
    done_at: float | None  # when that step was done (None: no step yet: the job's start)
    deferred_s: float = 0.0  # how long the kill waited for a process holding the rank (a recovery under way)


@dataclass
class Start:
    """One start of the job (one launcher or torchrun process)."""

    start: float
    end: float
    rc: int
    killed: bool  # a failure struck it (rank or job)
    resumed_from: int | None
    first_step: float | None  # its first step done (from the loss CSV)
    restart_line: str | None  # train.py's "recovery: first step after resume ..." (rank 0; a restart)
    inprocess_lines: list[str] = field(default_factory=list)  # train.py's in-process recovery lines (rank 0)
    launcher_lines: list[str] = field(default_factory=list)  # launcher.py's lines


@dataclass
class FailureJob:
    origin: float
    wall: float
    outcome: str  # finished | timed out | failed (rc N)
    starts: list[Start]
    kills: list[Kill]
    rows: set  # every (step, unix time) seen in the loss CSV: at each kill and at the end
    final_rows: list
    tail: str = ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive_in(pid: int, tag: str) -> bool:
    """Whether ``pid`` is still a live process of the attempt ``tag`` (not a zombie, not a reused pid)."""
    return _environ(pid).get(_ATTEMPT_VAR) == tag


def torchrun_rank_pid(run: Run, rank: int) -> int | None:
    """The process of rank ``rank`` under torchrun: a child of the agent with RANK=rank (a rank's own children, such
    as a background saver, carry the same variables but another parent)."""
    for pid in _attempt_pids(run.tag):
        if pid != run.proc.pid and _ppid(pid) == run.proc.pid and _environ(pid).get("RANK") == str(rank):
            return pid
    return None


def launcher_holders(lines: list[str]) -> tuple[dict[int, int], dict[int, int]]:
    """From launcher.py's lines: (rank -> member now holding it, member -> pid)."""
    holder, pids = {}, {}
    for line in lines:
        if (m := START.search(line)) is not None:
            pids[int(m.group(1))] = int(m.group(2))
            if m.group(3) is not None:
                holder[int(m.group(3))] = int(m.group(1))
        elif (m := GENERATION.search(line)) is not None:
            for member, rank in TAKES.findall(m.group(2)):
                holder[int(rank)] = int(member)
    return holder, pids


def inprocess_rank_pid(run: Run, rank: int) -> tuple[int | None, int | None]:
    """(pid, member) of the launcher's member holding ``rank`` now, if that process is alive."""
    holder, pids = launcher_holders(list(run.lines))
    member = holder.get(rank)
    pid = pids.get(member) if member is not None else None
    return (pid, member) if pid is not None and _alive_in(pid, run.tag) else (None, None)


def progress(csv_path: Path, rows: set, origin: float) -> tuple[int, float | None]:
    """Read the loss CSV into ``rows``; the job's newest step done so far and when (over every read: a restart rewrites
    the CSV without the steps it redoes)."""
    rows.update((s, w) for s, w in g.loss_rows(csv_path) if w >= origin)
    if not rows:
        return 0, None
    step = max(s for s, _ in rows)
    return step, min(w for s, w in rows if s == step)


def run_failure_job(cmd: list[str], csv_path: Path, plan: Iterator[Planned], limit_s: float, inprocess: bool,
                    env: dict | None = None) -> FailureJob:
    """Run ``cmd`` to the end, applying the failures of ``plan``; restart it at once whenever it exits non-zero after a
    failure (cold: every rank failure; in-process: a job failure, or an abort for want of a spare)."""
    origin = time.time()
    nxt = next(plan, None)
    starts: list[Start] = []
    kills: list[Kill] = []
    rows: set = set()
    while True:
        launch = time.time()
        run = Run(cmd, env)
        struck, due_since = False, None
        try:
            while run.proc.poll() is None:
                now = time.time()
                if now - origin >= limit_s:
                    run.kill_all()
                    run.wait()
                    starts.append(_start(run, launch, origin, csv_path, True))
                    return FailureJob(origin, time.time() - origin, "timed out", starts, kills, rows,
                                      g.loss_rows(csv_path), run.output[-6000:])
                due = nxt is not None and (now - origin >= nxt.at if nxt.step is None else
                                           progress(csv_path, rows, origin)[0] >= nxt.step)
                if due:
                    due_since = due_since or now
                    kill = _strike(run, nxt, inprocess, csv_path, rows, origin, len(starts))
                    if kill is not None:
                        kill.deferred_s = now - due_since
                        kills.append(kill)
                        what = f"rank {kill.rank} (pid {kill.pid})" if kill.kind == "rank" else "the job"
                        late = kill.deferred_s > 0.5
                        log(f"  {kill.at:.1f} s: {what} SIGKILLed at step {kill.done_step}"
                            + (f", {kill.deferred_s:.1f} s late (no process held the rank)" if late else ""))
                        struck, due_since, nxt = True, None, next(plan, None)
                        continue
                time.sleep(0.1 if nxt is not None and nxt.step is not None else 0.02)
            run.wait()
        except BaseException:
            run.kill_all()
            run.wait()
            raise
        start = _start(run, launch, origin, csv_path, struck)
        starts.append(start)
        log(f"  start {start.start:.1f} s: exit {start.rc} at {start.end:.1f} s, resumed from {start.resumed_from}"
            + (f", {len(start.inprocess_lines)} in-process recoveries" if inprocess else ""))
        if start.rc == 0:
            progress(csv_path, rows, origin)
            return FailureJob(origin, start.end, "finished", starts, kills, rows, g.loss_rows(csv_path))
        if not struck:
            return FailureJob(origin, start.end, f"failed (rc {start.rc})", starts, kills, rows,
                              g.loss_rows(csv_path), run.output[-6000:])


def _strike(run: Run, planned: Planned, inprocess: bool, csv_path: Path, rows: set, origin: float,
            incarnation: int) -> Kill | None:
    """Apply one failure; None when no process holds the rank yet (the kill waits for one)."""
    pid = member = None
    if planned.kind == "rank":
        pid, member = inprocess_rank_pid(run, planned.rank) if inprocess else (torchrun_rank_pid(run, planned.rank),
                                                                               None)
        if pid is None:
            return None
    step, at = progress(csv_path, rows, origin)
    now = time.time()
    if planned.kind == "job":
        run.kill_all()
    else:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
    return Kill(now - origin, planned.kind, planned.rank, pid, member, incarnation, step,
                None if at is None else at - origin)


def _start(run: Run, launch: float, origin: float, csv_path: Path, struck: bool) -> Start:
    out = run.output
    m, fresh = g.RESUMED.search(out), out.find(g.FRESH)
    if fresh >= 0 and (m is None or fresh < m.start()):  # a fresh start (a later resume is an in-process recovery's)
        m = None
    mine = [w for _, w in g.loss_rows(csv_path) if w >= launch]
    rs = RESTART.search(out)
    return Start(start=launch - origin, end=time.time() - origin, rc=run.proc.returncode, killed=struck,
                 resumed_from=int(m.group(1)) if m else (0 if fresh >= 0 else None),
                 first_step=min(mine) - origin if mine else None, restart_line=rs.group(0) if rs else None,
                 inprocess_lines=[x.group(0) for x in INPROCESS.finditer(out)],
                 launcher_lines=[line.rstrip() for line in out.splitlines() if line.startswith("launcher: ")])


# --- accounting ------------------------------------------------------------------------------------------------------


def step_interval(rows: list[tuple[int, float]]) -> float | None:
    """The median time between consecutive steps of a loss CSV's rows."""
    at = dict(rows)
    gaps = [at[s] - at[s - 1] for s in at if s - 1 in at and at[s] > at[s - 1]]
    return statistics.median(gaps) if gaps else None


def failure_costs(kills: list[Kill], rows: set, origin: float, t_step: float, steps: int) -> list[dict]:
    """Per failure: the wall time it cost, redone work included (see the module's docstring). Failures at the same
    newest step done (the later ones struck before the first was made good) share one window, evenly."""
    out = []
    for _, group in itertools.groupby(enumerate(kills), key=lambda ik: ik[1].done_step):
        group = list(group)
        first = group[0][1]
        s, last = first.done_step, group[-1][1]
        done_at = first.done_at if first.done_at is not None else 0.0  # no step yet: from the job's start
        again = [w - origin for st, w in rows if st == s + 1 and w - origin > last.at]
        cost = (min(again) - done_at - t_step) / len(group) if again and s < steps else None
        for i, k in group:
            out.append({"kill": i + 1, "at_s": k.at, "kind": k.kind, "rank": k.rank, "pid": k.pid,
                        "member": k.member, "done_step": s, "cost_s": cost, "shared_with": len(group) - 1,
                        "step_again_s": min(again) if again else None})
    return out


def parse_inprocess(line: str) -> dict:
    m = INPROCESS.search(line)
    if m is None:
        return {}
    d = {k: (float(v) if v is not None else None) for k, v in m.groupdict().items() if k in INPROCESS_PARTS}
    return d | {"what": m.group("what"), "generation": int(m.group("gen")), "resumed_step": int(m.group("step")),
                "source": m.group("src")}


def parse_restart(line: str | None) -> dict:
    m = RESTART.search(line or "")
    if m is None:
        return {}
    return {"total": float(m.group("total")), **{k.strip(): float(v) for k, v in PART.findall(m.group("parts"))}}


def goodputs(job: FailureJob, steps: int) -> dict:
    """A run's goodput from its own times (see the module's docstring): t_step_s (its median step interval), startup_s
    (its first start's launch to that start's first step done), goodput and goodput_steady; None where unknown."""
    t_step = step_interval(job.final_rows)
    first = job.starts[0] if job.starts else None
    startup = first.first_step - first.start if first is not None and first.first_step is not None else None
    return {"t_step_s": t_step, "startup_s": startup,
            "goodput": t_step * steps / job.wall if t_step is not None and job.wall > 0 else None,
            "goodput_steady": t_step * (steps - 1) / (job.wall - startup)
            if t_step is not None and startup is not None and job.wall > startup else None}


def account(name: str, job: FailureJob, steps: int, ff_t_step: float, ff_wall: float) -> dict:
    """One configuration's figures; ``ff_t_step`` (the reference's step interval) stands in for its own step interval
    only in the cost per failure, and only if the run has none (no two consecutive steps)."""
    own = goodputs(job, steps)
    t_step = own["t_step_s"] or ff_t_step
    costs = failure_costs(job.kills, job.rows, job.origin, t_step, steps)
    known = [c["cost_s"] for c in costs if c["cost_s"] is not None]
    kills = len(job.kills)
    # what each failure's recovery consisted of
    inproc = [parse_inprocess(line) for s in job.starts for line in s.inprocess_lines]
    for c in costs:  # the in-process line that names the killed pid
        hit = next((p for p in inproc if c["pid"] is not None and f"pid {c['pid']}," in p.get("what", "")), None)
        if hit:
            c["recovery"] = hit
            c["redone_steps"] = max(0, c["done_step"] - hit["resumed_step"])
    for i, s in enumerate(job.starts[:-1]):  # cold: the kill that ended a start, and the restart after it
        nxt = job.starts[i + 1]
        mine = [c for c in costs if job.kills[c["kill"] - 1].incarnation == i]
        if s.killed and mine and nxt.resumed_from is not None:
            c = mine[-1]
            c.setdefault("redone_steps", max(0, c["done_step"] - nxt.resumed_from))
            c["teardown_s"] = s.end - job.kills[c["kill"] - 1].at  # the kill to the job's exit
            c["restart_s"] = (nxt.first_step - nxt.start) if nxt.first_step is not None else None
            c["restart"] = parse_restart(nxt.restart_line)
    return {
        "name": name, "goodput": own["goodput"], "goodput_steady": own["goodput_steady"],
        "startup_s": own["startup_s"], "wall_s": job.wall, "kills": kills,
        "kills_by_kind": {k: sum(x.kind == k for x in job.kills) for k in ("rank", "job")},
        "cost_per_failure_s": statistics.median(known) if known else None,
        "cost_per_failure_min_s": min(known, default=None), "cost_per_failure_max_s": max(known, default=None),
        "cost_per_failure_wall_s": (job.wall - ff_wall) / kills if kills else None,
        "t_step_s": own["t_step_s"], "starts": len(job.starts), "inprocess_recoveries": len(inproc),
        "redone_steps": sum(c.get("redone_steps", 0) for c in costs), "failures": costs, "outcome": job.outcome,
    }


# --- the runs --------------------------------------------------------------------------------------------------------


def rank_cmd(folder: Path, args: argparse.Namespace, launcher: str, spares: int = 0) -> list[str]:
    """The training of every run: goodput.train_cmd's, with the node-local tier; under torchrun or launcher.py."""
    cmd = g.train_cmd(folder, args.steps, args.local_every, shlex.split(g.CONFIGS["tiered"]), args.dataset, s3=False,
                      shared_every=args.shared_every)
    at = cmd.index("train.py")
    if launcher == "torchrun":
        head = [g.PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)]
    else:
        head = [g.PY, "launcher.py", "--nproc", str(args.ranks), "--spares", str(spares)]
    return head + cmd[at:]


def final_step(folder: Path, steps: int) -> Path:
    return folder / "run" / f"step-{steps:08d}"


def bitwise(a: Path, b: Path) -> tuple[bool, str]:
    """tests/check_weights_equality.py --tolerance 0 --optimizer: (equal, its last output line)."""
    if not a.is_dir() or not b.is_dir():
        return False, f"no final checkpoint: {a if not a.is_dir() else b}"
    proc = subprocess.run([g.PY, str(g.ROOT / "tests" / "check_weights_equality.py"), str(a), str(b), "--tolerance",
                           "0", "--optimizer"], capture_output=True, text=True, timeout=300, cwd=g.ROOT,
                          env=env_for_tests())
    said = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, (said[-1] if said else f"exit {proc.returncode}")[:300]


LOSS_COLUMNS = ("step", "loss", "lr", "tokens_seen")  # the loss CSV's deterministic columns


def loss_columns(path: Path) -> list[tuple]:
    import csv

    try:
        with open(path, newline="") as f:
            return [tuple(r[k] for k in LOSS_COLUMNS) for r in csv.DictReader(f)]
    except FileNotFoundError:
        return []


def run_rank_failures(args: argparse.Namespace, workdir: Path, res: dict) -> None:
    """The failure-free reference, then the cold and the in-process configuration on the same failures."""
    N = args.steps
    explicit = [float(t) for t in args.kill_times.split(",") if t.strip()] if args.kill_times else None
    kill_steps = [int(s) for s in args.kill_steps.split(",") if s.strip()] if args.kill_steps else None

    def plan() -> Iterator[Planned]:
        return schedule(args.seed, args.mtbf, args.failure, args.ranks, explicit, kill_steps)

    ref = workdir / "reference"
    log(f"reference: failure-free, torchrun, {N} steps, local tier every {args.local_every}, shared every "
        f"{args.shared_every}")
    job = run_failure_job(rank_cmd(ref, args, "torchrun"), ref / "run" / "loss.csv", iter(()), 1800 + 10 * N, False)
    ff = goodputs(job, N)
    if job.outcome != "finished" or N not in dict(job.final_rows) or ff["t_step_s"] is None:
        raise SystemExit(f"the reference run {job.outcome}:\n{job.tail}")
    ff_wall = job.wall
    res.update(failure_free_wall_s=ff_wall, failure_free_t_step_s=ff["t_step_s"],
               failure_free_goodput=ff["goodput"], failure_free_goodput_steady=ff["goodput_steady"],
               failure_free_startup_s=ff["startup_s"])
    log(f"  wall {ff_wall:.1f} s, t_step {ff['t_step_s']:.3f} s, start-up {g.f(ff['startup_s'], 1)} s, goodput "
        f"{g.f(ff['goodput'], 3)}, steady {g.f(ff['goodput_steady'], 3)}")

    limit = 6 * ff_wall + 120
    spares = args.spares
    for name in CONFIGS:
        inprocess = name == "in-process"
        if inprocess and spares is None:  # the failures the schedule plans within the cold run's wall time
            cold_wall = res["configs"].get("cold", {}).get("wall_s") or 3 * ff_wall
            spares = max(1, sum(p.kind == "rank" for p in itertools.takewhile(
                lambda p: p.at < cold_wall, itertools.islice(plan(), 1000))) if kill_steps is None else
                len(kill_steps))
        folder = workdir / name
        log(f"{name}: {N} steps, " + (f"launcher.py with {spares} spares" if inprocess else "torchrun")
            + f", failures: {args.failure}")
        try:
            job = run_failure_job(rank_cmd(folder, args, "launcher" if inprocess else "torchrun", spares or 0),
                                  folder / "run" / "loss.csv", plan(), limit, inprocess)
            r = account(name, job, N, ff["t_step_s"], ff_wall)
            if job.outcome == "finished":
                r["bitwise"], r["bitwise_said"] = bitwise(final_step(folder, N), final_step(ref, N))
                mine, theirs = loss_columns(folder / "run" / "loss.csv"), loss_columns(ref / "run" / "loss.csv")
                r["loss_rows_equal"] = mine == theirs
                if not r["loss_rows_equal"]:  # the first row that differs, and in which columns
                    r["loss_rows_diff"] = next(
                        ({"step": b[0], "columns": [k for k, x, y in zip(LOSS_COLUMNS, a, b) if x != y],
                          "reference": dict(zip(LOSS_COLUMNS, a)), "run": dict(zip(LOSS_COLUMNS, b))}
                         for a, b in zip(theirs, mine) if a != b),
                        {"step": None, "columns": ["rows"], "reference": len(theirs), "run": len(mine)})
            else:
                r["bitwise"], r["bitwise_said"], r["loss_rows_equal"], r["tail"] = False, job.outcome, False, job.tail
                log(f"  {job.outcome}:\n{job.tail}")
        finally:
            shutil.rmtree(g.local_dir(folder), ignore_errors=True)
        r.update(label=LABELS[name], spares=spares if inprocess else None,
                 starts_detail=[asdict(s) for s in job.starts], kills_detail=[asdict(k) for k in job.kills])
        res["configs"][name] = r
        log(f"{name}: goodput {g.f(r['goodput'], 3)}, steady {g.f(r['goodput_steady'], 3)} (t_step "
            f"{g.f(r['t_step_s'], 3)} s, start-up {g.f(r['startup_s'], 1)} s), wall {r['wall_s']:.1f} s, {r['kills']} "
            f"failures, cost per failure "
            f"{g.f(r['cost_per_failure_s'])} s (median; (wall - failure-free) / failures "
            f"{g.f(r['cost_per_failure_wall_s'])} s), bitwise {r['bitwise']}")
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(g.local_dir(ref), ignore_errors=True)
    if not args.keep:
        shutil.rmtree(ref, ignore_errors=True)
    longest = max((c["wall_s"] for c in res["configs"].values()), default=0.0)
    res["schedule"] = [asdict(p) for p in itertools.takewhile(
        lambda p: p.at < longest, itertools.islice(plan(), 1000))] if kill_steps is None else \
        [asdict(p) for p in plan()]


# --- report ----------------------------------------------------------------------------------------------------------


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def render(res: dict) -> str:
    m, a = res["machine"], res["args"]
    f = g.f
    sched = res.get("schedule", [])
    when = (f"as a run completes step {a['kill_steps']} (--kill-steps)" if a.get("kill_steps") else
            ("at the times given by --kill-times" if a.get("kill_times") else
             f"at exponential inter-arrival times of mean MTBF {a['mtbf']:g} s, seed {a['seed']}")
            + ", in wall seconds from each configuration's start: "
            + (", ".join(f"{p['at']:.1f} s ({'rank ' + str(p['rank']) if p['kind'] == 'rank' else 'job'})"
                         for p in sched) or "none within the runs"))
    lines = [
        f"# Goodput under {'rank' if a['failure'] == 'rank' else 'rank and job'} failures: cold restart vs in-process "
        "recovery", "",
        f"`{res['command']}` — {res['date']}, commit {m['commit']}"
        + (f" ({m['dirty']})" if m.get("dirty") else "") + ", "
        f"{m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}; load average "
        f"{m['load_start']:.1f} at the start, {m['load_end']:.1f} at the end; {res['duration_s'] / 60:.1f} min.", "",
        f"`train.py {' '.join(g.TRAIN_ARGS)}` on {a['ranks']} gloo ranks, {a['steps']} steps, "
        f"`--checkpoint-backend concurrent`, the node-local tier in /dev/shm every {a['local_every']} steps, the "
        f"shared tier every {a['shared_every']}, `--resume-from-checkpoint latest`. Failures: "
        + ("SIGKILL of one rank process (not the launcher, not the job), the rank drawn from the seed per failure, "
           if a["failure"] == "rank" else
           "per failure, drawn from the seed with even odds, SIGKILL of one rank process (the rank drawn too) or of "
           "the whole job (launcher and every process: on one machine a lost node is the job), ")
        + when + ". The same failures for both configurations:", "",
        "- **cold**: `torchrun --standalone`; a rank's death ends the job (torchrun's agent stops the survivors); the "
        "harness restarts it at once with `--resume-from-checkpoint latest` (today's path);",
        f"- **in-process**: `launcher.py --nproc {a['ranks']} --spares K`; the survivors keep their processes, a spare "
        "takes the dead rank, every rank reloads the newest step they all reach (the node-local tier) and goes on; the "
        "killed process is the member holding the rank now, from the launcher's lines. With no spare left the ranks "
        "end and the harness restarts the job cold.", "",
        "**Goodput = t_step × steps / wall**, t_step the run's own median step interval (from its loss CSV; the "
        "start-up, the recoveries, the redone steps and the saves' time above the median make up the rest of the "
        "wall). Each run's t_step comes from that run itself: on this shared machine the load, and with it the step "
        "time, differs from one run to the next, and a step time taken from another run made the figure "
        "meaningless (a rerun under a changed load came out above 1). **Steady goodput = t_step × (steps "
        "− 1) / (wall − start-up)**: the same without the job's one-time start-up, the launch to the first step done "
        "(listed below; a long job amortises it, and the in-process configuration starts its spares in it). The "
        "failure-free reference (the same training under torchrun, no failure) is measured the same way: its steady "
        f"goodput {f(res.get('failure_free_goodput_steady'), 3)} is the ceiling (goodput "
        f"{f(res.get('failure_free_goodput'), 3)}, wall {f(res['failure_free_wall_s'], 1)} s, t_step "
        f"{f(res.get('failure_free_t_step_s'), 3)} s), as its saves and final save still count. "
        "**Cost per failure** = the median over the failures of the wall time each cost, redone work included, "
        "from the loss CSV's times: a failure while the newest step done is s (done at w_s) costs w'_(s+1) − w_s − "
        "t_step, w'_(s+1) the first time step s + 1 is done after it, t_step the run's median step interval "
        "(failures before that step share one window evenly). Beside it, (wall − failure-free wall) / failures, "
        "which also counts the difference in start-up and the load's drift between the runs. "
        "**Bitwise**: the final step's model and optimizer against the reference's, "
        "`tests/check_weights_equality.py --tolerance 0 --optimizer`; loss rows: the loss CSV's deterministic columns "
        "(step, loss, lr, tokens) equal the reference's.", "",
        "| configuration | goodput | steady goodput | wall s | failures | cost per failure s: median (min–max) | "
        "(wall − failure-free) / failures s | redone steps | starts | bitwise | loss rows equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        g.row("failure-free reference (torchrun)", f(res.get("failure_free_goodput"), 3),
              f(res.get("failure_free_goodput_steady"), 3), f(res["failure_free_wall_s"], 1), 0, "–", "–", 0, 1,
              "(reference)", "(reference)")]
    for name, c in res["configs"].items():
        kinds = c["kills_by_kind"]
        n = f"{c['kills']}" + (f" ({kinds['rank']} rank, {kinds['job']} job)" if kinds.get("job") else "")
        lines.append(g.row(
            f"{c['label']}" + (f", K = {c['spares']}" if c.get("spares") is not None else ""),
            f"**{f(c['goodput'], 3)}**", f"**{f(c.get('goodput_steady'), 3)}**", f(c["wall_s"], 1), n,
            f"**{f(c['cost_per_failure_s'])}** ({f(c['cost_per_failure_min_s'])}–{f(c['cost_per_failure_max_s'])})",
            f(c["cost_per_failure_wall_s"]), c["redone_steps"], c["starts"], "yes" if c["bitwise"] else
            f"**no** ({c['bitwise_said']})", "yes" if c["loss_rows_equal"] else "no"))
    cold, inproc = res["configs"].get("cold"), res["configs"].get("in-process")
    if cold and inproc and cold.get("cost_per_failure_s") and inproc.get("cost_per_failure_s"):
        left = {n: f(1 - c["cost_per_failure_s"] / a["mtbf"], 3) for n, c in (("cold", cold), ("in-process", inproc))}
        lines += ["", f"Long-job view at MTBF {a['mtbf']:g} s (start-up and final save → 0): the failures leave "
                  f"1 − cost / MTBF of the time to training: cold {left['cold']}, in-process {left['in-process']}."]
    for name, c in res["configs"].items():
        d = c.get("loss_rows_diff")
        if d:
            lines += ["", f"{name}: the loss rows differ from the reference's first at step {d['step']}, in "
                      f"{', '.join(d['columns'])}: reference {d['reference']}, this run {d['run']}."]
    if res["configs"]:
        k = (inproc or {}).get("spares")
        runs = [("failure-free reference", res.get("failure_free_startup_s"), res.get("failure_free_t_step_s")),
                *((n, c.get("startup_s"), c.get("t_step_s")) for n, c in res["configs"].items())]
        lines += ["", "Start-up (launch to the first step done) and t_step (median step interval), per run: "
                  + ", ".join(f"{n} {f(su, 1)} s and {f(ts, 3)} s" for n, su, ts in runs)
                  + (f" (in-process: the ranks set up beside the {k} spares, forked from one warm standby that "
                     f"imports once, on {m['cores']} cores)" if k else "")
                  + ". The start-up counts in goodput and in (wall − failure-free) / failures, not in steady goodput "
                  "nor in the cost per failure. A run whose every step is slower (its own overhead or the machine's "
                  "load: one run cannot tell them apart) has a larger t_step, not a lower goodput: compare the "
                  "t_step values for that."]
    # the breakdowns
    lines += ["", "## Where a failure's time goes", ""]
    if inproc:
        recs = [c.get("recovery") or {} for c in inproc["failures"]]
        lines += ["In-process: rank 0's `recovery:` line per failure, as train.py logs it (detect = the launcher "
                  "seeing the death, within its 5 ms poll, to rank 0 seeing the failure; in all = the launcher seeing "
                  "the death to the first step after the recovery done), and the cost accounted from the loss CSV.",
                  "", "| # | at s | rank (pid) | step done | resumed step | redone steps | detect s | tear down s | "
                  "agree s | load s | first step s | in all s | cost s |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c, r in zip(inproc["failures"], recs):
            lines.append(g.row(c["kill"], f(c["at_s"], 1), f"{c['rank']} ({c['pid']})" if c["kind"] == "rank" else
                               "job", c["done_step"], r.get("resumed_step", "–"), c.get("redone_steps", "–"),
                               *(f(r.get(k)) for k in INPROCESS_PARTS), f(c["cost_s"])))
        if any(recs):
            lines.append(g.row("median", "", "", "", "", "", *(f(_median(r.get(k) for r in recs)) for k in
                                                                INPROCESS_PARTS), f(inproc["cost_per_failure_s"])))
        lines.append("")
    if cold:
        lines += ["Cold: per failure, the kill to the job's exit (torchrun stopping the survivors), the restart's "
                  "launch to its first step done (loss CSV), and the restart's own `recovery:` line (rank 0, from its "
                  "process start; torchrun's agent start is outside it).", "",
                  "| # | at s | rank (pid) | step done | resumed step | redone steps | kill → exit s | "
                  "restart → first step s | " + " | ".join(f"{p} s" for p in RESTART_PARTS) + " | cost s |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(RESTART_PARTS) + "---:|"]
        for c in cold["failures"]:
            rp = c.get("restart") or {}
            redone = c.get("redone_steps")
            lines.append(g.row(c["kill"], f(c["at_s"], 1), f"{c['rank']} ({c['pid']})" if c["kind"] == "rank" else
                               "job", c["done_step"], "–" if redone is None else c["done_step"] - redone,
                               "–" if redone is None else redone, f(c.get("teardown_s")), f(c.get("restart_s")),
                               *(f(rp.get(p)) for p in RESTART_PARTS), f(c["cost_s"])))
        lines.append("")
    lines += ["## Starts", "", "Times in s from the configuration's start.", "",
              "| configuration | # | start | end | exit | resumed from | first step | in-process recoveries |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in res["configs"].items():
        for i, s in enumerate(c["starts_detail"]):
            lines.append(g.row(name, i, f(s["start"], 1), f(s["end"], 1), s["rc"],
                               "–" if s["resumed_from"] is None else s["resumed_from"], f(s["first_step"], 1),
                               len(s["inprocess_lines"])))
    notes = [line for c in res["configs"].values() for s in c["starts_detail"] for line in s["launcher_lines"]
             if "generation" in line or "spare member" in line or "did not end" in line]
    if notes:
        lines += ["", "launcher.py's lines:", "", "```", *notes, "```"]
    return "\n".join(lines) + "\n"
