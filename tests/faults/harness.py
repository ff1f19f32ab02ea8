"""The fault-injection harness: kill real training runs, resume them, and count what (if anything) went wrong.

A *configuration* is (backend, world size[, --jit-checkpoint]); every backend registered in
``checkpoint.backends.BACKENDS`` is included automatically, single process and 2 ranks (torchrun, gloo).

For each world size an uninterrupted *reference* run (vanilla backend) trains the tiny model for ``steps`` steps, saving
every step (so that saves are frequent and many kills land inside one); every configuration of that world size is
compared with it, so a backend or --jit-checkpoint that changed one bit of training would show as a mismatch. A *trial* then trains the same run from scratch, killing it
1..max_kills times and resuming each time with ``--resume-from-checkpoint latest`` until it reaches the target step:

* ``random``: SIGKILL at a uniformly random moment of the remaining training loop (estimated from the reference run).
  With 2 ranks either one rank (torchrun then tears the others down) or the whole job (node loss).
* a named point of the save path, through the test-only hook of checkpoint/fsio.py (``PYRECOVER_FAULT=<point>:<n>``,
  n random over the writes of the remaining run): ``after_write_before_fsync``, ``after_fsync_before_rename``,
  ``after_manifest_before_commit``, ``during_retention_delete``.

After every attempt the checkpoint folder is scanned (commit markers, manifests and every checksum) and compared with
what was seen before. Counted:

* kills, and kills inside a save (evidence on disk: a new uncommitted step folder, temporary or trash files; or a named
  save-path point fired);
* resumes (the log says "resumed from ... (step N"), and resumes from a partial/wrong checkpoint: N is not the newest
  checkpoint that verified before the attempt, or the run started fresh although one existed            -- must be 0;
* checkpoints lost: a checkpoint that verified earlier is later missing or fails verification while no newer valid
  one exists (retention may delete old ones only once newer ones are committed), or any committed checkpoint fails
  verification                                                                                            -- must be 0;
* final-weight mismatches: the finished run's final checkpoint differs from the reference (model + optimizer, bitwise,
  tests/check_weights_equality.py --tolerance 0 --optimizer) or its loss CSV's deterministic columns differ -- must be 0;
* unexpected exits (an attempt nobody killed exited non-zero) and unfinished trials                       -- must be 0.

SIGKILL tests crash consistency of the *process*: data the kernel already has survives. Power loss (unsynced page
cache dropped) is not simulated; the fsync ordering that covers it is in checkpoint/fsio.py and layout.commit.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, torchrun_cmd

POINTS = ("after_write_before_fsync", "after_fsync_before_rename", "after_manifest_before_commit",
          "during_retention_delete")
REQUIRED_ZERO = ("checkpoints_lost", "partial_resumes", "final_mismatches", "unexpected_exits", "unfinished_trials",
                 "reference_failures")
EXPERIMENT = "run"
KEEP = 2
ATTEMPT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Config:
    backend: str
    world_size: int
    jit: bool = False

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.world_size}{'+jit' if self.jit else ''}"


@dataclass
class Counters:
    trials: int = 0
    attempts: int = 0
    kills: int = 0
    kills_in_save: int = 0
    resumes: int = 0
    jit_saves: int = 0
    checkpoints_lost: int = 0
    partial_resumes: int = 0
    final_mismatches: int = 0
    unexpected_exits: int = 0
    unfinished_trials: int = 0
    reference_failures: int = 0
    kills_by_kind: dict = field(default_factory=dict)

    def add(self, other: "Counters") -> None:
        for k, v in asdict(other).items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    self.kills_by_kind[kk] = self.kills_by_kind.get(kk, 0) + vv
            else:
                setattr(self, k, getattr(self, k) + v)

    def violations(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in REQUIRED_ZERO if getattr(self, k)}


# --- processes -------------------------------------------------------------------------------------------------------


_ATTEMPT_VAR = "PYRECOVER_FAULTS_ATTEMPT"


def _attempt_pids(tag: str) -> list[int]:
    """Live processes of one attempt: train.py, or torchrun and every rank, found by a variable in their environment.
    torchrun starts each rank in a session of its own (start_new_session=True), so torchrun's process group does not
    cover them, and a rank outlives a killed launcher (reparented: no parent link left to follow)."""
    needle = f"{_ATTEMPT_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:  # a zombie's environ reads empty: only processes that can still run or write match
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


class Run:
    """One attempt: train.py (or torchrun) in its own session, output collected line by line."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.tag = uuid.uuid4().hex
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env_for_tests({**(env or {}), _ATTEMPT_VAR: self.tag}), cwd=ROOT,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        self.t_loop: float | None = None
        self.t_done: float | None = None  # the "done:" line: the loop and the final save are over
        self.t_end: float | None = None
        self.loop_started = threading.Event()
        self.hung = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if not self.loop_started.is_set() and line.startswith("model "):
                self.t_loop = time.monotonic()
                self.loop_started.set()
            elif self.t_done is None and line.startswith("done: "):
                self.t_done = time.monotonic()
        self.loop_started.set()  # also on exit, so nobody waits forever

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def running(self) -> bool:
        return self.proc.poll() is None

    def worker_pids(self) -> list[int]:
        """The training processes: train.py itself, or torchrun's worker children."""
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            kids = []
        return [int(k) for k in kids] or [self.proc.pid]

    def kill(self, pid: int) -> bool:
        try:
            os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False

    def kill_all(self) -> None:
        """SIGKILL the whole job at once (a node lost): the launcher and every rank."""
        for pid in _attempt_pids(self.tag):
            self.kill(pid)

    def wait(self, timeout: float = ATTEMPT_TIMEOUT_S) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.hung = True
            self.kill_all()
            rc = self.proc.wait()
        self.t_end = time.monotonic()
        # Stragglers (a rank whose launcher died first) must be gone before the checkpoint folder is inspected or
        # the next attempt starts: two generations of ranks writing one run folder is not a fault this tests.
        deadline = time.monotonic() + 30
        while _attempt_pids(self.tag):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of attempt {self.tag} survive SIGKILL: {_attempt_pids(self.tag)}")
            self.kill_all()
            time.sleep(0.05)
        self._reader.join(timeout=10)
        return rc


def train_cmd(cfg: Config, dataset: str, ckpt_dir: Path, steps: int) -> list[str]:
    args = [*TINY, "--dataset", dataset, "--training-steps", str(steps), "--checkpoint-frequency", "1",
            "--max-kept-checkpoints", str(KEEP), "--checkpoint-dir", str(ckpt_dir), "--experiment_name", EXPERIMENT,
            "--checkpoint-backend", cfg.backend, "--log-loss-to-csv", "--resume-from-checkpoint", "latest"]
    if cfg.jit:
        args += ["--jit-checkpoint", "--pg-timeout-seconds", "30"]
    if cfg.world_size == 1:
        return [PY, str(ROOT / "train.py"), *args]
    return torchrun_cmd(cfg.world_size, args)


# --- looking at the checkpoint folder --------------------------------------------------------------------------------


@dataclass
class Scan:
    valid: set[int] = field(default_factory=set)
    committed_invalid: dict[int, str] = field(default_factory=dict)
    uncommitted: set[tuple[str, int, int]] = field(default_factory=set)  # (name, inode, mtime_ns)
    debris: set[str] = field(default_factory=set)  # temporary files and trash folders

    @property
    def newest_valid(self) -> int | None:
        return max(self.valid) if self.valid else None


def scan(root: Path) -> Scan:
    from checkpoint import layout
    from checkpoint.errors import CheckpointError

    s = Scan()
    for info in layout.list_checkpoints(root):
        if info.committed:
            try:
                layout.verify(info.path)
                s.valid.add(info.step)
            except CheckpointError as e:
                s.committed_invalid[info.step] = str(e)
        else:
            st = info.path.stat()
            s.uncommitted.add((info.path.name, st.st_ino, st.st_mtime_ns))
    if root.is_dir():
        for p in root.rglob(".*"):
            if ".tmp-" in p.name or p.name.startswith(".trash-"):
                s.debris.add(str(p.relative_to(root)))
    return s


# --- reference and trials --------------------------------------------------------------------------------------------


@dataclass
class Reference:
    cfg: Config
    exp: Path
    step_s: float
    writes_per_save: int
    ok: bool
    output: str = ""


def run_reference(cfg: Config, dataset: str, base: Path, steps: int) -> Reference:
    ckpt = base / f"reference-{cfg.name.replace('/', '-').replace('+', '-')}"
    shutil.rmtree(ckpt, ignore_errors=True)
    run = Run(train_cmd(cfg, dataset, ckpt, steps))
    rc = run.wait()
    exp = ckpt / EXPERIMENT
    final = exp / f"step-{steps:08d}"
    ok = rc == 0 and (final / "COMMITTED").exists() and run.t_loop is not None
    step_s = ((run.t_done or run.t_end) - run.t_loop) / steps if run.t_loop else 1.0
    writes = 12
    if ok:
        manifest = json.loads((final / "manifest.json").read_text())
        writes = len(manifest["files"]) + 3  # payload files, part record, manifest, COMMITTED
    return Reference(cfg, exp, step_s, writes, ok, run.output)


def _pick_n(point: str, saves_left: int, ref: Reference, rng: random.Random) -> int:
    per_save = {"after_write_before_fsync": ref.writes_per_save, "after_fsync_before_rename": ref.writes_per_save,
                "after_manifest_before_commit": 1, "during_retention_delete": 1}[point]
    return rng.randint(1, max(1, saves_left * per_save))


def run_trial(cfg: Config, ref: Reference, dataset: str, base: Path, steps: int, rng: random.Random, max_kills: int,
              log: Callable[[str], None], keep: bool = False) -> Counters:
    c = Counters(trials=1)
    trial_dir = base / f"trial-{rng.getrandbits(32):08x}"
    exp = trial_dir / EXPERIMENT
    kills_planned = rng.randint(1, max_kills)
    prev = scan(exp)
    known_valid: set[int] = set()
    finished = False
    notes: list[str] = []
    for _attempt in range(kills_planned + 4):
        c.attempts += 1
        start = prev.newest_valid or 0
        kind = None
        env: dict[str, str] = {}
        if c.kills < kills_planned:
            kind = "random" if rng.random() < 0.5 else rng.choice(POINTS)
        if kind in POINTS:
            env["PYRECOVER_FAULT"] = f"{kind}:{_pick_n(kind, steps - start, ref, rng)}"
        run = Run(train_cmd(cfg, dataset, trial_dir, steps), env)
        killed_by_us = None
        if kind == "random":
            run.loop_started.wait(timeout=ATTEMPT_TIMEOUT_S)
            delay = rng.uniform(0, ref.step_s * (steps - start))
            try:
                run.proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                if cfg.world_size > 1 and (cfg.jit or rng.random() < 0.5):
                    pids = run.worker_pids()
                    if run.kill(rng.choice(pids)):
                        killed_by_us = "random-rank"
                else:
                    run.kill_all()
                    killed_by_us = "random" if cfg.world_size == 1 else "random-job"
        rc = run.wait()
        out = run.output
        if keep:
            trial_dir.mkdir(parents=True, exist_ok=True)
            (trial_dir / f"attempt-{c.attempts}-{kind or 'none'}-{env.get('PYRECOVER_FAULT', '')}.log").write_text(
                f"exit {rc}, killed by the harness: {killed_by_us}\n{out}")
        cur = scan(exp)
        fault_hits = re.findall(r"\[fault\] SIGKILL at (\w+)", out)
        killed = killed_by_us or (fault_hits[0] if fault_hits else None)

        # resumed from the newest valid checkpoint seen before this attempt?
        m = re.search(r"resumed from \S+ \(step (\d+)", out)
        if m:
            c.resumes += 1
            if int(m.group(1)) != prev.newest_valid:
                c.partial_resumes += 1
                notes.append(f"resumed from step {m.group(1)} but the newest valid checkpoint was {prev.newest_valid}")
        elif "no checkpoint found" in out and prev.newest_valid is not None:
            c.partial_resumes += 1
            notes.append(f"started fresh although step {prev.newest_valid} was a valid checkpoint")
        c.jit_saves += len(re.findall(r"jit: rank \d+ saved step", out))

        # nothing committed may be lost
        for step, why in cur.committed_invalid.items():
            if prev.committed_invalid.get(step) != why:
                c.checkpoints_lost += 1
                notes.append(f"committed checkpoint step {step} fails verification: {why}")
        for step in sorted(known_valid - cur.valid):
            if not any(s > step for s in cur.valid):
                c.checkpoints_lost += 1
                notes.append(f"checkpoint step {step} verified earlier and is now gone/invalid; newest valid "
                             f"{cur.newest_valid}")
        known_valid = set(cur.valid)

        if killed:
            c.kills += 1
            c.kills_by_kind[killed] = c.kills_by_kind.get(killed, 0) + 1
            if fault_hits or (cur.uncommitted - prev.uncommitted) or (cur.debris - prev.debris):
                c.kills_in_save += 1
        elif rc == 0 and f"done: {steps} steps" in out:
            finished = True
        elif run.hung:
            c.unexpected_exits += 1
            notes.append(f"attempt hung for {ATTEMPT_TIMEOUT_S:.0f}s; last output: {out[-1500:]}")
        else:
            c.unexpected_exits += 1
            notes.append(f"attempt exited {rc} without being killed; last output:\n{out[-2500:]}")
        prev = cur
        if finished or (not killed and rc != 0):
            break
    if not finished:
        c.unfinished_trials += 1
        notes.append("the run did not reach the target step")
    else:
        final = exp / f"step-{steps:08d}"
        cw = check_weights(ref.exp / f"step-{steps:08d}", final, "--tolerance", "0", "--optimizer")
        same_loss = loss_rows(ref.exp / "loss.csv") == loss_rows(exp / "loss.csv")
        if cw.returncode != 0 or not same_loss:
            c.final_mismatches += 1
            notes.append(f"final state differs from the reference: weights rc={cw.returncode} "
                         f"{(cw.stdout + cw.stderr).strip()[-600:]}; loss rows {'equal' if same_loss else 'DIFFER'}")
    kinds = ",".join(f"{k}x{v}" if v > 1 else k for k, v in c.kills_by_kind.items()) or "none"
    log(f"  {cfg.name:<16} kills {c.kills} ({kinds}), in save {c.kills_in_save}, resumes {c.resumes}"
        f"{f', jit saves {c.jit_saves}' if cfg.jit else ''} -> "
        f"{'OK' if not c.violations() else 'FAIL'}")
    for n in notes:
        log(f"    ! {n}")
    if not keep and not c.violations():
        shutil.rmtree(trial_dir, ignore_errors=True)
    return c


# --- the suite -------------------------------------------------------------------------------------------------------


def configurations(backends: list[str] | None = None, world_sizes: tuple[int, ...] = (1, 2),
                   jit: bool = True) -> list[Config]:
    from checkpoint.backends import BACKENDS

    names = [b for b in BACKENDS if backends is None or b in backends]
    configs = [Config(b, w) for w in world_sizes for b in names]
    if jit and 2 in world_sizes and names:
        configs.append(Config(names[0], 2, jit=True))
    return configs


def run_suite(trials: int, seed: int, dataset: str, workdir: Path, *, steps: int = 5, max_kills: int = 2,
              backends: list[str] | None = None, world_sizes: tuple[int, ...] = (1, 2), jit: bool = True,
              keep: bool = False, log: Callable[[str], None] = print) -> tuple[Counters, dict[str, Counters], float]:
    t0 = time.monotonic()
    rng = random.Random(seed)
    configs = configurations(backends, world_sizes, jit)
    per_config = {cfg.name: Counters() for cfg in configs}
    refs: dict[str, Reference] = {}
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"fault injection: {trials} trials over {len(configs)} configurations ({', '.join(per_config)}), "
        f"{steps} steps each, saving every step, seed {seed}")
    from checkpoint.backends import BACKENDS

    ref_backend = "vanilla" if "vanilla" in BACKENDS else next(iter(BACKENDS))
    for cfg in configs:  # references first: they also warm the token cache for concurrently starting ranks
        # One reference per world size: neither the backend nor --jit-checkpoint may change a single bit of training.
        plain = Config(ref_backend, cfg.world_size)
        if plain.name not in refs:
            ref = run_reference(plain, dataset, workdir, steps)
            refs[plain.name] = ref
            log(f"  reference {plain.name:<16} {'ok' if ref.ok else 'FAILED'} ({ref.step_s:.3f}s/step incl. save)")
            if not ref.ok:
                per_config[cfg.name].reference_failures += 1
                log("    ! " + ref.output[-2500:].replace("\n", "\n    ! "))
        refs[cfg.name] = refs[plain.name]
    for i in range(trials):
        cfg = configs[i % len(configs)]
        if not refs[cfg.name].ok:
            continue
        per_config[cfg.name].add(run_trial(cfg, refs[cfg.name], dataset, workdir, steps, rng, max_kills, log, keep))
    total = Counters()
    for c in per_config.values():
        total.add(c)
    return total, per_config, time.monotonic() - t0


def report(total: Counters, per_config: dict[str, Counters], seconds: float, seed: int, trials: int) -> str:
    cols = ("trials", "kills", "kills_in_save", "resumes", "jit_saves", "checkpoints_lost", "partial_resumes",
            "final_mismatches", "unexpected_exits", "unfinished_trials")
    heads = ("trials", "kills", "in save", "resumes", "jit saves", "lost", "partial resumes", "mismatches",
             "unexpected", "unfinished")
    width = max(len(n) for n in [*per_config, "total"]) + 2
    lines = [f"{'configuration':<{width}}" + " ".join(f"{h:>{max(len(h), 6)}}" for h in heads)]
    for name, c in [*per_config.items(), ("total", total)]:
        lines.append(f"{name:<{width}}" + " ".join(f"{getattr(c, k):>{max(len(h), 6)}}" for k, h in zip(cols, heads)))
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(total.kills_by_kind.items())) or "none"
    v = total.violations()
    lines += [
        f"kills by kind: {kinds}",
        f"trials {total.trials}, kills {total.kills}, kills inside a save {total.kills_in_save}, resumes "
        f"{total.resumes}, checkpoints lost {total.checkpoints_lost}, resumes from a partial checkpoint "
        f"{total.partial_resumes}, final-weight mismatches {total.final_mismatches}",
        f"{'PASS' if not v else 'FAIL: ' + ', '.join(f'{k}={n}' for k, n in v.items())} "
        f"({seconds:.0f}s; reproduce with: python -m tests.faults --trials {trials} --seed {seed})",
    ]
    return "\n".join(lines)
