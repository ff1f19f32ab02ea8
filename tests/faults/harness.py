"""The fault-injection harness: kill real training runs, resume them, and count what (if anything) went wrong.

A *configuration* is (backend, world size[, --jit-checkpoint]); every backend registered in
``checkpoint.backends.BACKENDS`` is included automatically, single process and 2 ranks (torchrun, gloo).

For each world size an uninterrupted *reference* run (vanilla backend) trains the tiny model for ``steps`` steps, saving
every step (so that saves are frequent and many kills land inside one); every configuration of that world size is
compared with it, so a backend or --jit-checkpoint that changed one bit of training would show as a mismatch. A *trial* then trains the same run from scratch, killing it
1..max_kills times and resuming each time with ``--resume-from-checkpoint latest`` until it reaches the target step:

* ``random``: SIGKILL at a uniformly random moment of the remaining training loop (estimated from the reference run).
  With 2 ranks either one rank (torchrun then tears the others down) or the whole job (node loss).
* a named point of the save path, through the test-only hook of checkpoint/knobs.py (``PYRECOVER_FAULT=<point>:<n>``,
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

Trials are of two kinds (``--kinds``; with both, every ``OVERLAP_EVERY``-th trial is an overlap): ``kill`` (above) and
``overlap``, two incarnations on one run directory (one writer per run directory, checkpoint/lease.py). The first
attempt, incarnation A, is frozen (SIGSTOP on the launcher and every rank) at a random moment after a random step's
loss row, often inside a save; a second start on the same folder without ``--force-takeover`` must be refused (exit 2,
"is in use by"); then incarnation B starts with ``--force-takeover`` (as SLURM's requeued incarnation while a stale
node's ranks live on), resumes from ``latest`` and trains a step or two (it may itself get the trial's first kill);
then A is continued. A must stop without changing anything: exit 6 (fenced; under torchrun the workers' exit code 6),
and no committed step folder carrying A's run id (part records) may appear that was not committed before B took over
(nor may A log a commit of another step). B and the attempts after it are counted like any other attempt (resume from
the newest checkpoint that verified while A was frozen, nothing lost), and the trial must end bit-identical. Counted:
overlaps, starts refused while A was frozen, A's fenced exits, and

* stale commits (A committed or published a checkpoint after the takeover), stale successes (A exited 0 although its
  final checkpoint was not committed before the takeover), unrefused starts (the second start without
  ``--force-takeover`` was not refused, or changed the folder)                                            -- must be 0.

The in-process configuration (``spares`` > 0: ``vanilla/2+inproc``, kill trials only) runs each attempt under
launcher.py with that many spares and the node-local tier (every step; the shared tier every INPROC_SHARED_EVERY-th).
Its kills are SIGKILLs of one rank process (the member holding the rank now, from the launcher's lines), at random
moments or at a save-path point of one rank (PYRECOVER_FAULT_RANK), several per launch. With a spare left each must
cost an in-process recovery: the launcher's ``generation G:`` line (a spare takes the rank), rank 0's ``recovery:``
line, the resumed step the newest every rank held when the rank was killed, the survivors ending the run in their
first processes; with none left the ranks exit 3 and the next attempt is the restart. Counted: in-process recoveries,
spares run out (each a restart), and missed recoveries and replaced survivors                             -- must be 0.

A save is staged in ``.staging-<run id>/step-N`` and renamed into place once committed: a staged step folder, like a
temporary or trash file, is evidence of a kill inside a save; a committed staged copy whose ``step-N`` is missing (a
kill between a replacement's two renames) is published by the next start, so it counts as valid for `latest` and loss.

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

from helpers import PY, ROOT, TINY, check_weights, csv_rows, env_for_tests, loss_rows, torchrun_cmd
from train import EXIT_BAD_INPUT, EXIT_FENCED  # the one exit-code table (2: a start refused, run directory in use)

POINTS = ("after_write_before_fsync", "after_fsync_before_rename", "after_manifest_before_commit",
          "during_retention_delete")
REQUIRED_ZERO = ("checkpoints_lost", "partial_resumes", "final_mismatches", "unexpected_exits", "unfinished_trials",
                 "reference_failures", "stale_commits", "stale_successes", "unrefused_starts", "missed_recoveries",
                 "replaced_survivors")
KINDS = ("kill", "overlap")
OVERLAP_EVERY = 4  # with both kinds, trials 3, 7, 11, ... are overlaps (4 and the 7 configurations are coprime)
EXPERIMENT = "run"
KEEP = 2
ATTEMPT_TIMEOUT_S = 300.0
#: the in-process configuration (launcher.py with spares): the node-local tier saves every step, the shared tier every
#: INPROC_SHARED_EVERY-th (and the final step), so a recovery, and a restart, load steps only the local tier holds
INPROC_SHARED_EVERY = 2
LOCAL_DIR = "local"  # the node-local tier, in the trial's folder beside the run folder
#: train.py's line when a recovered generation finds no step every rank reached (it ends: exit 3, a fresh start)
BEFORE_FIRST = "error: the failure came before the run's first checkpoint"


@dataclass(frozen=True)
class Config:
    backend: str
    world_size: int
    jit: bool = False
    spares: int = 0  # > 0: launcher.py with this many spares and the node-local tier (in-process recovery)

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.world_size}{'+jit' if self.jit else ''}{'+inproc' if self.spares else ''}"


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
    overlaps: int = 0  # overlap trials in which A was frozen alive and B took over
    overlaps_in_save: int = 0  # ... with A frozen inside a save (a staged step folder, temporary or trash files)
    refused_starts: int = 0  # starts without --force-takeover refused while A was frozen
    fenced_exits: int = 0  # A stopped fenced (exit 6) after it was continued
    stale_commits: int = 0
    stale_successes: int = 0
    unrefused_starts: int = 0
    inprocess_recoveries: int = 0  # a spare took the killed rank and every rank resumed in process (no restart)
    spares_out: int = 0  # no spare left for a killed rank: the ranks exited 3, a restart resumed from `latest`
    early_kills: int = 0  # a rank killed before the run's first checkpoint: the ranks exit 3, a fresh start follows
    late_kills: int = 0  # a rank killed as the run ended (its peer had left): the launcher ends the run, a restart
    inprocess_from_local: int = 0  # ... that loaded the node-local tier (its recovery line says so)
    missed_recoveries: int = 0  # a rank killed with a spare left, and no in-process recovery followed
    replaced_survivors: int = 0  # a rank nobody killed did not end the run in its first process
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

    def signal_all(self, sig: int) -> int:
        """Send ``sig`` to the launcher and every rank (SIGSTOP: a stale node frozen; SIGCONT: it wakes up)."""
        sent = 0
        for pid in _attempt_pids(self.tag):
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
        return sent

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


def train_cmd(cfg: Config, dataset: str, ckpt_dir: Path, steps: int, *extra: str) -> list[str]:
    every = INPROC_SHARED_EVERY if cfg.spares else 1
    args = [*TINY, "--dataset", dataset, "--training-steps", str(steps), "--checkpoint-frequency", str(every),
            "--max-kept-checkpoints", str(KEEP), "--checkpoint-dir", str(ckpt_dir), "--experiment_name", EXPERIMENT,
            "--checkpoint-backend", cfg.backend, "--log-loss-to-csv", "--resume-from-checkpoint", "latest", *extra]
    if cfg.jit:
        args += ["--jit-checkpoint", "--pg-timeout-seconds", "30"]
    if cfg.spares:  # one node: N ranks and K spares of train.py under launcher.py; the local tier in the trial's folder
        args += ["--local-checkpoint-dir", str(ckpt_dir / LOCAL_DIR), "--local-checkpoint-frequency", "1"]
        return [PY, str(ROOT / "launcher.py"), "--nproc", str(cfg.world_size), "--spares", str(cfg.spares),
                str(ROOT / "train.py"), "--distributed", *args]
    if cfg.world_size == 1:
        return [PY, str(ROOT / "train.py"), *args]
    return torchrun_cmd(cfg.world_size, args)


# --- looking at the checkpoint folder --------------------------------------------------------------------------------


@dataclass
class Scan:
    valid: set[int] = field(default_factory=set)
    committed_invalid: dict[int, str] = field(default_factory=dict)
    # uncommitted step folders, and every staged one (.staging-<run id>/step-N: a save not yet published), as
    # (name, inode, mtime_ns)
    uncommitted: set[tuple[str, int, int]] = field(default_factory=set)
    debris: set[str] = field(default_factory=set)  # temporary files and trash folders
    # committed staged copies whose step-N is missing (a kill between a replacement's two renames): the next start
    # publishes them (layout.recover), so `latest` will find them
    publishable: set[int] = field(default_factory=set)

    @property
    def newest_valid(self) -> int | None:
        return max(self.valid) if self.valid else None

    @property
    def newest_resumable(self) -> int | None:
        """The step the next `--resume-from-checkpoint latest` must resume from."""
        steps = self.valid | self.publishable
        return max(steps) if steps else None


def _staged_folders(root: Path) -> list[Path]:
    from checkpoint import layout

    if not root.is_dir():
        return []
    return sorted(p for stage in root.glob(f"{layout.STAGING_PREFIX}*") if stage.is_dir() for p in stage.iterdir()
                  if layout.STEP_DIR_RE.match(p.name) and p.is_dir())


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
    for staged in _staged_folders(root):
        try:
            st = staged.stat()
        except FileNotFoundError:
            continue
        s.uncommitted.add((str(staged.relative_to(root)), st.st_ino, st.st_mtime_ns))
        step = int(layout.STEP_DIR_RE.match(staged.name).group(1))
        if (staged / layout.COMMITTED).exists() and not (root / staged.name).exists():
            try:
                layout.verify(staged)
                s.publishable.add(step)
            except CheckpointError:
                pass
    if root.is_dir():
        for p in root.rglob(".*"):
            if p.relative_to(root).parts[0] == ".owner":  # the lease's own temporary files are not a save's
                continue
            if ".tmp-" in p.name or p.name.startswith(".trash-"):
                s.debris.add(str(p.relative_to(root)))
    return s


def committed_folders(root: Path) -> dict[int, tuple[str, int, frozenset[str]]]:
    """Every committed step folder under ``root`` -- published, staged, retired -- by inode (a rename keeps it):
    (path relative to root, step, the run ids of its part records)."""
    from checkpoint import layout

    found: dict[int, tuple[str, int, frozenset[str]]] = {}
    if not root.is_dir():
        return found
    folders = [i.path for i in layout.list_checkpoints(root)] + _staged_folders(root)
    folders += [p for p in (root / layout.RETIRED_DIR).glob("*/step-*") if p.is_dir()]
    for folder in folders:
        try:
            if not (folder / layout.COMMITTED).exists():
                continue
            ids = set()
            for part in folder.glob("part-rank-*.json"):
                try:
                    ids.add(json.loads(part.read_text()).get("run_id", ""))
                except (OSError, ValueError):
                    ids.add("?")
            m = layout.STEP_DIR_RE.match(folder.name)
            found[folder.stat().st_ino] = (str(folder.relative_to(root)), int(m.group(1)) if m else -1, frozenset(ids))
        except FileNotFoundError:  # moved or deleted meanwhile
            continue
    return found


# --- the in-process configuration: the node-local tier and the launcher's lines ---------------------------------------


def _local_rank_dirs(trial_dir: Path, world_size: int) -> list[list[Path]]:
    """The node-local tier's folder of each rank (every run folder <experiment>-<key> found there; one per trial)."""
    from checkpoint.places import rank_dir_name

    runs = sorted((trial_dir / LOCAL_DIR).glob(f"{EXPERIMENT}-*"))
    return [[run / rank_dir_name(r) for run in runs] for r in range(world_size)]


def _committed_steps(folders: list[Path], verify: bool = False) -> set[int]:
    """The steps committed (COMMITTED present; with ``verify``, also verified) in any of ``folders``."""
    from checkpoint import layout
    from checkpoint.errors import CheckpointError

    steps = set()
    for folder in folders:
        try:
            for info in layout.list_checkpoints(folder):
                if info.committed:
                    if verify:
                        layout.verify(info.path)
                    steps.add(info.step)
        except (OSError, CheckpointError):  # moved or deleted meanwhile, or not (yet) valid
            continue
    return steps


def local_common(trial_dir: Path, world_size: int, verify: bool = False) -> int | None:
    """The newest step every rank holds committed in the node-local tier (what a load may take from there)."""
    per_rank = [_committed_steps(folders, verify) for folders in _local_rank_dirs(trial_dir, world_size)]
    return max(set.intersection(*per_rank), default=None) if per_rank else None


def _staged_committed(root: Path) -> set[int]:
    """Steps committed in a staging folder of ``root`` (published by the next start: as good as committed)."""
    from checkpoint import layout

    try:
        return {int(layout.STEP_DIR_RE.match(p.name).group(1)) for p in _staged_folders(root)
                if (p / layout.COMMITTED).exists()}
    except OSError:  # published or swept meanwhile
        return set()


def _save_in_flight(folders: list[Path]) -> bool:
    """A staged step folder or a temporary file under ``folders``: a save (or a drain) was being written."""
    for folder in folders:
        try:
            if _staged_folders(folder) or any(".tmp-" in p.name for p in folder.rglob(".*")):
                return True
        except OSError:  # moved or deleted meanwhile
            continue
    return False


@dataclass
class RankKill:
    """One rank process killed in an in-process attempt, and what the folders held right after it."""

    kind: str  # "random-rank" or the save-path point that fired
    rank: int
    pid: int
    dead_newest: int | None  # the newest step committed in the killed rank's local folder (frozen from the kill on)
    common: int | None  # the newest step committed in every rank's local folder
    shared: int | None  # the newest step committed in the shared tier
    in_save: bool
    reliable: bool  # taken before the recovery could load (a save-path kill is seen through its line, a bit later)


def _members(out: str) -> dict[int, tuple[int, str]]:
    """launcher.py's start lines: member -> (pid, "rank R" or "spare")."""
    return {int(m): (int(pid), role) for m, pid, role in
            re.findall(r"^launcher: member (\d+) pid (\d+) (rank \d+|spare)$", out, re.M)}


def _holders(out: str) -> dict[int, int]:
    """Which pid holds each rank now, as the launcher's lines say: the start, then each spare that takes a rank."""
    members = _members(out)
    holders = {int(role.split()[1]): pid for pid, role in members.values() if role.startswith("rank ")}
    for line in re.findall(r"^launcher: generation \d+: (.*)$", out, re.M):
        for m, r in re.findall(r"member (\d+) \(spare\) takes rank (\d+)", line):
            if int(m) in members:
                holders[int(r)] = members[int(m)][0]
    return holders


def _alive(pid: int) -> bool:
    """Running (not a zombie that already exited and waits for the launcher to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


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


def _pick_n_rank(point: str, saves_left: int, ref: Reference, rng: random.Random, rank: int, fresh: bool) -> int:
    """n for a save-path point of ONE rank's process in the in-process configuration, over its writes of the remaining
    run (an estimate): every step its local part (rank 0, the node's leader, also the shared pieces), a manifest and
    COMMITTED; every INPROC_SHARED_EVERY-th step the drain of that part to the shared tier and its part record (rank 0
    also commits there); retention deletes once a tier holds KEEP steps (``fresh``: none yet)."""
    pieces = max(1, ref.writes_per_save - 3 - ref.cfg.world_size)  # model, optimizer, ...: the files of no one rank
    local = (pieces if rank == 0 else 0) + 1 + 2
    drained = (pieces if rank == 0 else 0) + 1 + 1 + (2 if rank == 0 else 0)
    shared = 1 / INPROC_SHARED_EVERY if rank == 0 else 0  # rank 0 commits the shared tier, and applies its retention
    per_step = {"after_write_before_fsync": local + drained / INPROC_SHARED_EVERY,
                "after_fsync_before_rename": local + drained / INPROC_SHARED_EVERY,
                "after_manifest_before_commit": 1 + shared, "during_retention_delete": 1 + shared}[point]
    if point == "during_retention_delete" and fresh:
        saves_left -= KEEP
    return rng.randint(1, max(1, round(saves_left * per_step)))


def _random_kill(run: Run, cfg: Config, rng: random.Random, delay: float) -> str | None:
    """SIGKILL ``run`` after ``delay`` seconds unless it ends first. With 2 ranks either one rank (torchrun then tears
    the others down) or the whole job (node loss). Returns the kind of kill, None if the run ended first."""
    try:
        run.proc.wait(timeout=delay)
        return None
    except subprocess.TimeoutExpired:
        pass
    if cfg.world_size > 1 and (cfg.jit or rng.random() < 0.5):
        return "random-rank" if run.kill(rng.choice(run.worker_pids())) else None
    run.kill_all()
    return "random" if cfg.world_size == 1 else "random-job"


def _staging_ids(root: Path) -> set[str]:
    """Run ids of the incarnations with a staging folder in ``root`` (.staging-<run id>)."""
    from checkpoint import layout

    if not root.is_dir():
        return set()
    return {p.name[len(layout.STAGING_PREFIX):] for p in root.glob(f"{layout.STAGING_PREFIX}*")}


def _worker_exit(out: str, code: int) -> bool:
    """torchrun exits 1 whatever its workers returned; their exit codes are only in its failure summary."""
    return re.search(rf"exitcode\s*:\s*{code}\b", out) is not None


def run_trial(cfg: Config, ref: Reference, dataset: str, base: Path, steps: int, rng: random.Random, max_kills: int,
              log: Callable[[str], None], keep: bool = False, kind: str = "kill") -> Counters:
    c = Counters(trials=1)
    trial_dir = base / f"trial-{rng.getrandbits(32):08x}"
    exp = trial_dir / EXPERIMENT
    overlap = kind == "overlap"
    kills_planned = rng.randint(0 if overlap else 1, max_kills)  # an overlap's frozen incarnation is interruption enough
    prev = scan(exp)
    known_valid: set[int] = set()
    finished = False
    notes: list[str] = []
    overlap_notes: list[str] = []

    def save_log(run: Run, rc: int, label: str, killed_by_us: str | None, n: int | None = None) -> None:
        if keep:
            trial_dir.mkdir(parents=True, exist_ok=True)
            (trial_dir / f"attempt-{n or c.attempts}-{label}.log").write_text(
                f"exit {rc}, killed by the harness: {killed_by_us}\n{run.output}")

    def check_resume(out: str, before: Scan, expected: int | None | str = "shared") -> None:
        """Resumed from the newest checkpoint that verified before the attempt (or one its start publishes)?
        ``expected``: that step when more than the shared tier holds it (the in-process configuration's local tier)."""
        if expected == "shared":
            expected = before.newest_resumable
        m = re.search(r"resumed from \S+ \(step (\d+)", out)
        if m:
            c.resumes += 1
            if int(m.group(1)) != expected:
                c.partial_resumes += 1
                notes.append(f"resumed from step {m.group(1)} but the newest valid checkpoint was {expected}")
        elif "no checkpoint found" in out and expected is not None:
            c.partial_resumes += 1
            notes.append(f"started fresh although step {expected} was a valid checkpoint")

    def check_lost(cur: Scan, before: Scan) -> None:
        """Nothing committed may be lost."""
        nonlocal known_valid
        for step, why in cur.committed_invalid.items():
            if before.committed_invalid.get(step) != why:
                c.checkpoints_lost += 1
                notes.append(f"committed checkpoint step {step} fails verification: {why}")
        usable = cur.valid | cur.publishable
        for step in sorted(known_valid - usable):
            if not any(s > step for s in usable):
                c.checkpoints_lost += 1
                notes.append(f"checkpoint step {step} verified earlier and is now gone/invalid; newest valid "
                             f"{cur.newest_resumable}")
        known_valid = set(usable)

    def account(run: Run, rc: int, killed_by_us: str | None, before: Scan, cur: Scan) -> str:
        """Count one attempt that found the folder as ``before`` and left it as ``cur``: finished, killed or failed."""
        out = run.output
        check_resume(out, before)
        c.jit_saves += len(re.findall(r"jit: rank \d+ saved step", out))
        check_lost(cur, before)
        fault_hits = re.findall(r"\[fault\] SIGKILL at (\w+)", out)
        killed = killed_by_us or (fault_hits[0] if fault_hits else None)
        if killed:
            c.kills += 1
            c.kills_by_kind[killed] = c.kills_by_kind.get(killed, 0) + 1
            if fault_hits or (cur.uncommitted - before.uncommitted) or (cur.debris - before.debris):
                c.kills_in_save += 1
            return "killed"
        if rc == 0 and f"done: {steps} steps" in out:
            return "finished"
        c.unexpected_exits += 1
        if run.hung:
            notes.append(f"attempt hung for {ATTEMPT_TIMEOUT_S:.0f}s; last output: {out[-1500:]}")
        else:
            notes.append(f"attempt exited {rc} without being killed; last output:\n{out[-2500:]}")
        return "failed"

    def overlap_attempt(fault: str | None) -> tuple[str, Scan]:
        """Incarnation A frozen alive, a plain second start refused, B takes over with --force-takeover, A continued:
        A must stop fenced without changing anything. Returns B's outcome (A's if it ended before the freeze)."""
        no_slurm = {"SLURM_JOB_ID": ""}  # a job id shared with the harness's own job would make the 2nd start a requeue
        c.attempts += 1
        a = Run(train_cmd(cfg, dataset, trial_dir, steps), no_slurm)
        runs = [a]
        try:
            # Freeze after a random step's loss row (A's save of that step starts right after it) and a random part
            # of a step more: inside a save or between saves. A has a staging folder by then: its run id.
            a.loop_started.wait(timeout=ATTEMPT_TIMEOUT_S)
            row = rng.randint(1, max(1, steps - 1))
            deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
            while a.running() and time.monotonic() < deadline and not (
                    csv_rows(exp / "loss.csv") >= row and _staging_ids(exp)):
                time.sleep(0.005)
            try:
                a.proc.wait(timeout=rng.uniform(0, ref.step_s / 2))
            except subprocess.TimeoutExpired:
                a.signal_all(signal.SIGSTOP)
            time.sleep(0.2)  # the reader takes in what A wrote before it stopped
            if not a.running():  # A ended before the freeze: an ordinary attempt
                rc = a.wait()
                save_log(a, rc, "overlap-A-ended-before-the-freeze", None)
                overlap_notes.append("A ended before it could be frozen")
                cur = scan(exp)
                return account(a, rc, None, prev, cur), cur
            n_frozen = len(a.lines)
            a_ids = _staging_ids(exp)
            frozen = scan(exp)
            frozen_committed = committed_folders(exp)
            check_resume(a.output, prev)
            check_lost(frozen, prev)
            c.overlaps += 1
            in_save = bool(frozen.uncommitted or frozen.debris)
            c.overlaps_in_save += in_save
            overlap_notes.append(f"A frozen after loss row {csv_rows(exp / 'loss.csv')}"
                                 f"{' inside a save' if in_save else ''}")

            # 1. a start without --force-takeover while A lives: refused in one line, the folder unchanged
            second = Run(train_cmd(cfg, dataset, trial_dir, steps), no_slurm)
            runs.append(second)
            rc2 = second.wait()
            save_log(second, rc2, "overlap-second-start-while-A-frozen", None)
            out2 = second.output
            errors = [ln for ln in out2.splitlines() if ln.startswith("error:")]
            refused = (rc2 == EXIT_BAD_INPUT or (cfg.world_size > 1 and rc2 != 0 and _worker_exit(out2, EXIT_BAD_INPUT))
                       ) and len(errors) == 1 and "is in use by" in errors[0]
            unchanged = scan(exp) == frozen and committed_folders(exp) == frozen_committed
            if refused and unchanged:
                c.refused_starts += 1
                overlap_notes.append("2nd start refused")
            else:
                c.unrefused_starts += 1
                notes.append(f"a second start without --force-takeover while A was alive exited {rc2}"
                             f"{'' if unchanged else ' and changed the run directory'}; output:\n{out2[-2000:]}")

            # 2. B takes over (a requeued incarnation) and trains a step or two while A is still frozen; it may get
            # this attempt's kill: a named point (n over the writes of B's run) now, or a random one once A is continued
            env: dict[str, str] = {}
            if fault in POINTS:
                env["PYRECOVER_FAULT"] = f"{fault}:{_pick_n(fault, steps - (frozen.newest_resumable or 0), ref, rng)}"
            c.attempts += 1
            b = Run(train_cmd(cfg, dataset, trial_dir, steps, "--force-takeover"), env)
            runs.append(b)
            b.loop_started.wait(timeout=ATTEMPT_TIMEOUT_S)
            m = re.search(r"resumed from \S+ \(step (\d+)", b.output)
            b_start = int(m.group(1)) if m else 0
            target = min(steps, b_start + rng.randint(1, 2))
            deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
            while b.running() and csv_rows(exp / "loss.csv") < target and time.monotonic() < deadline:
                time.sleep(0.005)

            # 3. A wakes up while B trains (or after B ended); B may get this attempt's kill meanwhile
            a.signal_all(signal.SIGCONT)
            killed_by_us = None
            if fault == "random":
                left = max(0.5, steps - csv_rows(exp / "loss.csv"))
                killed_by_us = _random_kill(b, cfg, rng, rng.uniform(0, ref.step_s * left))
            rc_a = a.wait()
            rc_b = b.wait()
            save_log(a, rc_a, "overlap-A-frozen-then-continued", None, n=c.attempts - 1)
            save_log(b, rc_b, f"overlap-B-force-takeover-{fault or 'none'}-{env.get('PYRECOVER_FAULT', '')}", killed_by_us)
            cur = scan(exp)

            # A: fenced, exit 6, no commit after the takeover
            post = "".join(a.lines[n_frozen:])
            fenced = "fenced" in post and (rc_a == EXIT_FENCED or (
                cfg.world_size > 1 and rc_a != 0 and _worker_exit(post, EXIT_FENCED)))
            a_before = {step for _, step, ids in frozen_committed.values() if ids & a_ids}
            if fenced:
                c.fenced_exits += 1
                overlap_notes.append("A fenced")
            elif rc_a == 0 and steps in a_before:
                overlap_notes.append("A had committed its final step before the takeover and exited 0")
            elif rc_a == 0:
                c.stale_successes += 1
                notes.append(f"A exited 0 after B took over (its final step was not committed before); output "
                             f"after it was continued:\n{post[-2000:]}")
            else:
                c.unexpected_exits += 1
                notes.append(f"A exited {rc_a} after B took over, not fenced (exit {EXIT_FENCED}); output after it "
                             f"was continued:\n{post[-2500:]}")
            stale: dict[int, str] = {}
            for ino, (rel, step, ids) in committed_folders(exp).items():
                if ids & a_ids and ino not in frozen_committed:
                    stale[step] = f"{rel} (part records of A's run {sorted(ids & a_ids)[0]}) committed after B took over"
            for s in map(int, re.findall(r"checkpoint step (\d+) committed", post)):
                if s not in a_before and s not in stale:
                    stale[s] = f"A logged a commit of step {s} after B took over"
            c.stale_commits += len(stale)
            notes.extend(stale.values())
            return account(b, rc_b, killed_by_us, frozen, cur), cur
        finally:  # in any case, no process of A (nor of the other starts) outlives the trial
            for r in runs:
                if r.running() or _attempt_pids(r.tag):
                    r.signal_all(signal.SIGCONT)
                    r.kill_all()
                    r.wait()

    def inprocess_attempt(faults: list[str]) -> tuple[str, Scan]:
        """launcher.py with spares: one kill of ONE rank process (the member that holds the rank now, from the
        launcher's lines; never the launcher) per entry of ``faults``, the first possibly a save-path point of one
        rank (PYRECOVER_FAULT_RANK), the others at random moments, each after the launcher's word on the one before.
        A kill with a spare left must cost an in-process recovery: the launcher's generation line (a spare takes the
        rank), rank 0's recovery line, the survivors in their processes to the end; with none left the ranks exit 3
        and the next attempt is the restart. Returns the attempt's outcome and the folder's scan after it."""
        ws = cfg.world_size
        local_start = local_common(trial_dir, ws, verify=True)
        expected = max([s for s in (prev.newest_resumable, local_start) if s is not None], default=None)
        start = expected or 0
        env: dict[str, str] = {}
        point_rank = None
        if faults and faults[0] in POINTS:
            point_rank = rng.randrange(ws)
            n = _pick_n_rank(faults[0], steps - start, ref, rng, point_rank, fresh=expected is None)
            env = {"PYRECOVER_FAULT": f"{faults[0]}:{n}", "PYRECOVER_FAULT_RANK": str(point_rank)}
        c.attempts += 1
        run = Run(train_cmd(cfg, dataset, trial_dir, steps), env)
        kills: list[RankKill] = []

        def snapshot(kind: str, rank: int, pid: int) -> RankKill:
            folders = _local_rank_dirs(trial_dir, ws)
            per_rank = [_committed_steps(f) for f in folders]  # the killed rank's first: its folder is frozen
            shared = _committed_steps([exp]) | _staged_committed(exp)
            return RankKill(kind, rank, pid, max(per_rank[rank], default=None),
                            max(set.intersection(*per_rank), default=None), max(shared, default=None),
                            _save_in_flight(folders[rank]) or _save_in_flight([exp]), True)

        def said(pid: int) -> bool:
            return re.search(rf"^launcher: generation \d+.*\bpid {pid}\b", run.output, re.M) is not None

        try:
            run.loop_started.wait(timeout=ATTEMPT_TIMEOUT_S)
            for i, fault in enumerate(faults):
                if i == 0 and fault in POINTS:  # fires by itself in the process started with RANK=point_rank (even
                    deadline = time.monotonic() + ATTEMPT_TIMEOUT_S  # in the start, before the loop)
                    while run.running() and "[fault] SIGKILL at" not in run.output and time.monotonic() < deadline:
                        time.sleep(0.005)
                    if not run.running():  # it ended: every line read before looking
                        run._reader.join(timeout=10)
                    at = run.output.find("[fault] SIGKILL at")
                    if at < 0:
                        break  # n lay past this run's writes: no kill
                    pid = _members(run.output).get(point_rank, (0, ""))[0]
                    kill = snapshot(fault, point_rank, pid)
                    # seen through its line: trusted as the folders at the kill only if no reload followed yet
                    kill.reliable = "resumed from" not in run.output[at:]
                else:
                    if not run.running():
                        break
                    window = steps - start if i == 0 else max(1, steps - csv_rows(exp / "loss.csv")) + 1
                    try:
                        run.proc.wait(timeout=rng.uniform(0, ref.step_s * window))
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    rank = rng.randrange(ws)
                    pid = _holders(run.output).get(rank)
                    if pid is None or not _alive(pid) or not run.kill(pid):
                        break  # that rank's process has left: the run is ending
                    kill = snapshot("random-rank", rank, pid)
                kills.append(kill)
                deadline = time.monotonic() + ATTEMPT_TIMEOUT_S  # the launcher's word before the next kill: who holds
                while run.running() and not said(kill.pid) and time.monotonic() < deadline:  # which rank now
                    time.sleep(0.005)
        except BaseException:
            run.kill_all()
            run.wait()
            raise
        rc = run.wait()
        save_log(run, rc, f"inproc-{'-'.join(k.kind for k in kills) or 'none'}-{env.get('PYRECOVER_FAULT', '')}"
                 f"{'-rank' + str(point_rank) if point_rank is not None else ''}", ",".join(map(str, kills)) or None)
        out = run.output
        cur = scan(exp)
        loop = re.search(r"^model ", out, re.M)  # the start's resume (or fresh start) is logged before its loop
        check_resume(out[:loop.start()] if loop else out, prev, expected)
        check_lost(cur, prev)

        gens = [(int(g), line) for g, line in re.findall(r"^launcher: generation (\d+): (.*)$", out, re.M)]
        ended = re.search(r"^launcher: generation \d+ ended: (.*)$", out, re.M)
        killed = {k.pid for k in kills}
        for g, line in gens:  # every failure the launcher saw is one of ours
            for pid in map(int, re.findall(r"\(member \d+, pid (\d+)\) (?:died|failed)", line)):
                if pid not in killed:
                    c.unexpected_exits += 1
                    notes.append(f"generation {g}: a rank nobody killed failed: {line}")
        took = [g for g, line in gens if "(spare) takes rank" in line]
        spares_out = late = early = False
        into: dict[int, RankKill] = {}  # generation -> the kill that started it
        landed: set[int] = set()  # ranks whose process we killed
        for k in kills:
            hit = next(((g, line) for g, line in gens
                        if re.search(rf"\(member \d+, pid {k.pid}\) died \(SIGKILL\)", line)), None)
            if hit is None and ended and re.search(rf"exit \d+ \(member \d+, pid {k.pid}\)", ended.group(1)):
                continue  # it had left (exit 0) before the signal came: no kill
            c.kills += 1
            c.kills_by_kind[k.kind] = c.kills_by_kind.get(k.kind, 0) + 1
            c.kills_in_save += k.in_save or k.kind in POINTS
            landed.add(k.rank)
            if hit is None:  # the launcher ended the run first (its peer had left): a restart resumes
                late = True
                continue
            g, line = hit
            if re.search(rf"member \d+ \(spare\) takes rank {k.rank}\b", line):
                into[g] = k
            elif "no spare left" in line and len([t for t in took if t < g]) >= cfg.spares:
                spares_out = True
            else:
                c.missed_recoveries += 1
                notes.append(f"rank {k.rank} (pid {k.pid}) killed with a spare left; the launcher: {line}")

        # each generation a spare joined: rank 0's recovery line after its first step, unless it failed before one
        # or had no step left; the step it resumed is the newest every rank reached when the rank was killed
        lines = out.splitlines()
        state: dict[int, dict] = {}
        current = None
        for line in lines:
            m = re.match(r"launcher: generation (\d+): (.*)", line)
            if m:
                current = int(m.group(1)) if "(spare) takes rank" in m.group(2) else None
                if current is not None:
                    state[current] = {"resumed": None, "recovered": None, "early": False}
                continue
            if line.startswith(BEFORE_FIRST) and current is not None:
                state[current]["early"] = True
                continue
            m = re.match(r"resumed from \S+ \(step (\d+)", line)
            if m and current is not None and state[current]["resumed"] is None:
                state[current]["resumed"] = int(m.group(1))
                continue
            m = re.match(r"recovery: .* failed; generation (\d+) resumed step (\d+) from (.*) in-process; ", line)
            if m and int(m.group(1)) in state:
                state[int(m.group(1))]["recovered"] = (int(m.group(2)), m.group(3))
        for g, st in sorted(state.items()):
            later = any(h > g for h, _ in gens)
            step = st["recovered"][0] if st["recovered"] else st["resumed"]
            k = into.get(g)
            lower = None if k is None else max([s for s in (k.common, k.shared) if s is not None], default=None)
            if st["recovered"] or (rc == 0 and st["resumed"] == steps and not later):
                c.inprocess_recoveries += 1
                c.inprocess_from_local += bool(st["recovered"] and "local tier" in st["recovered"][1])
            elif st["early"] and not later:  # no step every rank reached: the ranks end, a fresh start follows
                early = True
                if k is not None and k.reliable and lower is not None:
                    c.partial_resumes += 1
                    notes.append(f"generation {g} found no checkpoint, but every rank held step {lower} when rank "
                                 f"{k.rank} was killed")
                continue
            elif not later:
                c.missed_recoveries += 1
                notes.append(f"generation {g}: a spare took the killed rank, but no recovery line followed")
                continue
            if k is None or not k.reliable or step is None:
                continue
            upper = max([s for s in (k.dead_newest, k.shared) if s is not None], default=0)
            if (lower is not None and step < lower) or step > upper:
                c.partial_resumes += 1
                notes.append(f"generation {g} resumed step {step}; when rank {k.rank} was killed every rank held step "
                             f"{lower}, the killed rank's newest was {k.dead_newest}")

        if rc == 0 and f"done: {steps} steps" in out:  # the survivors ended the run in their first processes
            members = _members(out)
            first = {int(role.split()[1]): pid for pid, role in members.values() if role.startswith("rank ")}
            now = _holders(out)
            ends = {int(r): int(pid) for r, pid in re.findall(r"rank (\d+) exit 0 \(member \d+, pid (\d+)\)",
                                                            ended.group(1) if ended else "")}
            for r in range(ws):
                want = now.get(r) if r in landed else first.get(r)
                if ends.get(r) is None or ends.get(r) != want or ends.get(r) in killed:
                    c.replaced_survivors += 1
                    notes.append(f"rank {r} ended the run in pid {ends.get(r)}, not {want} "
                                 f"({'its spare' if r in landed else 'its first process'})")
            if len(members) != ws + cfg.spares:
                c.replaced_survivors += 1
                notes.append(f"the launcher started {len(members)} members, not {ws + cfg.spares}")
            return "finished", cur
        if spares_out and rc == 3 and re.search(r"^launcher: generation \d+: .*no spare left", out, re.M):
            c.spares_out += 1
            return "killed", cur
        if early and rc == 3 and not spares_out:
            c.early_kills += 1
            return "killed", cur
        if late and rc != 0 and not spares_out:
            c.late_kills += 1
            return "killed", cur
        c.unexpected_exits += 1
        notes.append(f"in-process attempt exited {rc} ({len(kills)} rank kills{', hung' if run.hung else ''}); "
                     f"last output:\n{out[-2500:]}")
        return "failed", cur

    for attempt in range(kills_planned + 4):
        start = prev.newest_resumable or 0
        fault = None
        env: dict[str, str] = {}
        if cfg.spares:  # at most one more kill than spares per launch; only its first can be a save-path point
            faults = [("random" if rng.random() < 0.5 else rng.choice(POINTS)) if i == 0 else "random"
                      for i in range(min(kills_planned - c.kills, cfg.spares + 1))]
            status, cur = inprocess_attempt(faults)
            prev = cur
            finished = status == "finished"
            if status != "killed":
                break
            continue
        if c.kills < kills_planned:
            fault = "random" if rng.random() < 0.5 else rng.choice(POINTS)
        if overlap and attempt == 0:
            status, cur = overlap_attempt(fault)
        else:
            if fault in POINTS:
                env["PYRECOVER_FAULT"] = f"{fault}:{_pick_n(fault, steps - start, ref, rng)}"
            c.attempts += 1
            run = Run(train_cmd(cfg, dataset, trial_dir, steps), env)
            killed_by_us = None
            if fault == "random":
                run.loop_started.wait(timeout=ATTEMPT_TIMEOUT_S)
                killed_by_us = _random_kill(run, cfg, rng, rng.uniform(0, ref.step_s * (steps - start)))
            rc = run.wait()
            save_log(run, rc, f"{fault or 'none'}-{env.get('PYRECOVER_FAULT', '')}", killed_by_us)
            cur = scan(exp)
            status = account(run, rc, killed_by_us, prev, cur)
        prev = cur
        finished = status == "finished"
        if status != "killed":
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
    other = "".join(f", {what} {n}" for what, n in (("before the first checkpoint", c.early_kills),
                                                    ("as the run ended", c.late_kills)) if n)
    inproc = (f", in-process recoveries {c.inprocess_recoveries} (local tier {c.inprocess_from_local}), spares out "
              f"{c.spares_out}{other}" if cfg.spares else "")
    log(f"  {cfg.name:<16} {'overlap: ' + ', '.join(overlap_notes) + '; ' if overlap else ''}"
        f"kills {c.kills} ({kinds}), in save {c.kills_in_save}, resumes {c.resumes}"
        f"{f', jit saves {c.jit_saves}' if cfg.jit else ''}{inproc} -> "
        f"{'OK' if not c.violations() else 'FAIL'}")
    for n in notes:
        log(f"    ! {n}")
    if not keep and not c.violations():
        shutil.rmtree(trial_dir, ignore_errors=True)
    return c


# --- the suite -------------------------------------------------------------------------------------------------------


def configurations(backends: list[str] | None = None, world_sizes: tuple[int, ...] = (1, 2),
                   jit: bool = True, spares: int = 0) -> list[Config]:
    """Every backend x world size, 2 ranks with --jit-checkpoint, and (``spares`` > 0) 2 ranks under launcher.py with
    that many spares and the node-local tier (a file backend: DCP is refused with the local tier), last."""
    from checkpoint.backend_table import combination_refusal
    from checkpoint.backends import BACKENDS

    names = [b for b in BACKENDS if backends is None or b in backends]
    configs = [Config(b, w) for w in world_sizes for b in names]
    if jit and 2 in world_sizes and names:
        configs.append(Config(names[0], 2, jit=True))
    tiered = [b for b in names if combination_refusal(b, local_tier=True) is None]
    if spares > 0 and 2 in world_sizes and tiered:
        configs.append(Config(tiered[0], 2, spares=spares))
    return configs


def trial_kind(i: int, kinds: tuple[str, ...] = KINDS) -> str:
    """The kind of trial ``i`` (counted over the configurations that have overlap trials: not the in-process one): with
    both kinds every OVERLAP_EVERY-th trial is an overlap (the first is trial 3, so a quick run of 7+ trials has one),
    the others kill."""
    if set(kinds) == set(KINDS):
        return "overlap" if i % OVERLAP_EVERY == OVERLAP_EVERY - 1 else "kill"
    return kinds[0]


def run_suite(trials: int, seed: int, dataset: str, workdir: Path, *, steps: int = 5, max_kills: int = 2,
              backends: list[str] | None = None, world_sizes: tuple[int, ...] = (1, 2), jit: bool = True,
              keep: bool = False, kinds: tuple[str, ...] = KINDS, spares: int = 0,
              log: Callable[[str], None] = print) -> tuple[Counters, dict[str, Counters], float]:
    """``spares`` > 0 adds the in-process configuration (launcher.py, that many spares; kill trials only)."""
    t0 = time.monotonic()
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"trial kinds {sorted(unknown) or '(none)'}: choose from {', '.join(KINDS)}")
    rng = random.Random(seed)
    configs = configurations(backends, world_sizes, jit, spares if "kill" in kinds else 0)
    per_config = {cfg.name: Counters() for cfg in configs}
    refs: dict[str, Reference] = {}
    workdir.mkdir(parents=True, exist_ok=True)
    inproc = [cfg for cfg in configs if cfg.spares]
    log(f"fault injection: {trials} trials over {len(configs)} configurations ({', '.join(per_config)}), "
        f"{steps} steps each, saving every step, seed {seed}; trial kinds: {', '.join(kinds)}"
        f"{f' (every {OVERLAP_EVERY}th trial an overlap)' if len(set(kinds)) > 1 else ''}"
        + "".join(f"; {cfg.name}: launcher.py, {cfg.spares} spare(s), local tier every step, shared every "
                  f"{INPROC_SHARED_EVERY}, rank kills (kill trials)" for cfg in inproc))
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
    plain = 0  # trials of the configurations that have overlap trials (all but the in-process one) so far
    for i in range(trials):
        cfg = configs[i % len(configs)]
        if cfg.spares:
            kind = "kill"  # no overlap variant under launcher.py
        else:
            kind, plain = trial_kind(plain, kinds), plain + 1
        if not refs[cfg.name].ok:
            continue
        per_config[cfg.name].add(run_trial(cfg, refs[cfg.name], dataset, workdir, steps, rng, max_kills, log, keep,
                                           kind=kind))
    total = Counters()
    for c in per_config.values():
        total.add(c)
    return total, per_config, time.monotonic() - t0


def report(total: Counters, per_config: dict[str, Counters], seconds: float, seed: int, trials: int,
           kinds: tuple[str, ...] = KINDS) -> str:
    cols = ("trials", "kills", "kills_in_save", "resumes", "jit_saves", "checkpoints_lost", "partial_resumes",
            "final_mismatches", "unexpected_exits", "unfinished_trials", "overlaps", "fenced_exits", "stale")
    heads = ("trials", "kills", "in save", "resumes", "jit saves", "lost", "partial resumes", "mismatches",
             "unexpected", "unfinished", "overlaps", "fenced", "stale")
    inproc = any(name.endswith("+inproc") for name in per_config)
    if inproc:
        cols += ("inprocess_recoveries", "spares_out")
        heads += ("in-proc", "spares out")

    def value(c: Counters, k: str) -> int:  # stale: commits and successes of a fenced incarnation, both must be 0
        return c.stale_commits + c.stale_successes if k == "stale" else getattr(c, k)

    width = max(len(n) for n in [*per_config, "total"]) + 2
    lines = [f"{'configuration':<{width}}" + " ".join(f"{h:>{max(len(h), 6)}}" for h in heads)]
    for name, c in [*per_config.items(), ("total", total)]:
        lines.append(f"{name:<{width}}" + " ".join(f"{value(c, k):>{max(len(h), 6)}}" for k, h in zip(cols, heads)))
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted(total.kills_by_kind.items())) or "none"
    v = total.violations()
    lines += [
        f"kills by kind: {by_kind}",
        f"trials {total.trials}, kills {total.kills}, kills inside a save {total.kills_in_save}, resumes "
        f"{total.resumes}, checkpoints lost {total.checkpoints_lost}, resumes from a partial checkpoint "
        f"{total.partial_resumes}, final-weight mismatches {total.final_mismatches}",
        f"overlaps {total.overlaps} (A frozen inside a save {total.overlaps_in_save}): second starts refused "
        f"{total.refused_starts}, not refused {total.unrefused_starts}; A fenced (exit {EXIT_FENCED}) "
        f"{total.fenced_exits}; stale commits {total.stale_commits}, stale successes {total.stale_successes}",
        *([f"in-process (launcher.py, spares): rank kills "
           f"{sum(c.kills for n, c in per_config.items() if n.endswith('+inproc'))}, in-process recoveries "
           f"{total.inprocess_recoveries} (from the local tier {total.inprocess_from_local}), spares ran out "
           f"{total.spares_out} (exit 3, then a restart from `latest`); restarts also after a kill before the first "
           f"checkpoint {total.early_kills}, as the run ended {total.late_kills}; missed recoveries "
           f"{total.missed_recoveries}, survivors replaced {total.replaced_survivors}"]
          if inproc else []),
        f"{'PASS' if not v else 'FAIL: ' + ', '.join(f'{k}={n}' for k, n in v.items())} "
        f"({seconds:.0f}s; reproduce with: python -m tests.faults --trials {trials} --seed {seed}"
        f"{'' if tuple(kinds) == KINDS else ' --kinds ' + ','.join(kinds)})",
    ]
    return "\n".join(lines)
