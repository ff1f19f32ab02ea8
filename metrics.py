"""What a run reports, step by step: progress (a bar on a terminal, plain lines in a batch log), the loss CSV, MFU,
the recovery time of a resume, the profiler trace -- and the repair of a loss-CSV row that a dead rank 0 never wrote."""

from __future__ import annotations

import csv
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

from checkpoint import knobs
from checkpoint.logs import EVERY_RANK
from checkpoint.fsio import fsync_dir, make_dirs
from procs import process_age

_log = logging.getLogger("pyrecover.metrics")


_STARTED_AT: float | None = None  # time.monotonic() of the rank's start, where it is not this process's (warm.py)


def started_at(t: float) -> None:
    global _STARTED_AT
    _STARTED_AT = t


def process_age_s(fallback_start: float) -> float:
    """Seconds since this rank started: this process's age (procs.process_age), or since the rank process handed itself
    to a warm standby's child; without /proc, since ``fallback_start``."""
    if _STARTED_AT is not None:
        return time.monotonic() - _STARTED_AT
    age = process_age()
    return age if age is not None else time.monotonic() - fallback_start


class LossCSV:
    """One row per step. At start the file is rewritten with the rows up to the step the run continues from (0 for a
    fresh start; later rows belong to work that was lost and will be redone), so it ends up with every step exactly
    once. The rewrite is a new file renamed over the old one, never a truncation: a fenced stale incarnation that still
    appends to the old file writes into an unlinked inode, not into this run's log."""

    FIELDS = ["step", "loss", "lr", "tokens_seen", "wall_time", "restart"]
    NUMBERS = {"step": int, "loss": float, "lr": float, "tokens_seen": int}  # what a whole row's values parse as

    def __init__(self, path: Path, resumed_step: int | None):
        self.path = path
        make_dirs(path.parent)
        rows = []
        if path.exists():
            with open(path, newline="") as f:
                rows = [r for r in _whole_rows(csv.DictReader(f), self.NUMBERS)
                        if int(r["step"]) <= (resumed_step or 0)]
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.FIELDS)
            w.writeheader()
            w.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.FIELDS)

    def row(self, **values) -> None:
        self.writer.writerow(values)
        self.file.flush()

    def sync(self) -> None:
        """Make rows durable up to a checkpoint: a resume must never find fewer rows than the step it resumes."""
        os.fsync(self.file.fileno())
        fsync_dir(self.path.parent)


VAL_CSV = "val.csv"  # beside loss.csv: one row per evaluation (--eval-every, and each periodic save)


class ValCSV(LossCSV):
    """The evaluations' rows (evaluation.py): the loss CSV's rule -- rewritten at start with the rows up to the resumed
    step, so every evaluation appears exactly once however often the run was killed (an evaluation a kill interrupted
    is redone from the same weights: the same value)."""

    FIELDS = ["step", "val_loss", "val_ppl", "val_tokens", "wall_time"]
    NUMBERS = {"step": int, "val_loss": float, "val_ppl": float, "val_tokens": int}


def val_csv_path(loss_csv: Path) -> Path:
    """The val CSV beside a loss CSV: val.csv next to the default loss.csv, else <name>.val.csv."""
    return loss_csv.with_name(VAL_CSV if loss_csv.name == "loss.csv" else f"{loss_csv.stem}.val{loss_csv.suffix}")


def _whole_rows(reader, numbers: dict | None = None):
    """The rows before the first one that does not parse: appends after the last sync may survive a power cut torn
    or as zeros (tests/powerloss found a resume dying on a NUL-filled row). Those rows are past the checkpoint the
    run resumes from, and get rewritten."""
    for r in reader:
        try:
            for key, kind in (numbers or LossCSV.NUMBERS).items():
                kind(r[key])
        except (KeyError, TypeError, ValueError):
            return
        yield r


def bar_fits() -> bool:
    """Whether stderr can show a progress bar: a terminal with a width. Some `srun --pty` wrappers give a pty of 0
    columns, where tqdm draws nothing at all (not even its postfix): plain lines there, as in a batch log."""
    if not sys.stderr.isatty():
        return False
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0  # what tqdm's dynamic_ncols asks the pty too
    except OSError:
        return False


# Peak FLOP/s per GPU model, dense (without 2:4 sparsity): (fp32 on the CUDA cores, bf16 = fp16 on the tensor cores).
# fp32 is the non-tensor-core figure because PyTorch's fp32 matmuls do not use TF32 unless asked to
# (torch.backends.cuda.matmul.allow_tf32 is off by default). Vendor datasheets; where they give the tensor-core figure
# "with sparsity" only, it is halved here:
#   H100 SXM / H100 NVL: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/): fp32 67 / 60 TF,
#     bf16 1,979 / 1,671 TF with sparsity; H100 PCIe: the 2022 edition of that datasheet: fp32 51 TF, bf16 1,513 TF
#     with sparsity
#   H200 / H200 NVL: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200/): as H100 SXM / H100 NVL
#   GH200: NVIDIA GH200 Grace Hopper Superchip datasheet: fp32 67 TF, bf16 1,979 TF with sparsity
#   A100 (SXM4 and PCIe, 40 and 80 GB): NVIDIA A100 datasheet: fp32 19.5 TF, bf16 312 TF dense
#   A10: NVIDIA A10 datasheet: fp32 31.2 TF, bf16 125 TF dense. (A10G, AWS's variant, has no NVIDIA datasheet: no MFU)
#   B200: NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx/), 8 GPUs: fp32 600 TF, bf16 36 PF with
#     sparsity -> per GPU 75 TF, 2.25 PF dense
#   L40S / L40: NVIDIA L40S / L40 datasheets: fp32 91.6 / 90.5 TF, bf16 362 / 181 TF dense
GPU_PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H100 SXM": (67e12, 989.5e12), "H100 PCIe": (51e12, 756.5e12), "H100 NVL": (60e12, 835.5e12),
    "H200 SXM": (67e12, 989.5e12), "H200 NVL": (60e12, 835.5e12), "GH200": (67e12, 989.5e12),
    "A100": (19.5e12, 312e12), "A10": (31.2e12, 125e12), "B200": (75e12, 2250e12),
    "L40S": (91.6e12, 362.05e12), "L40": (90.5e12, 181.05e12),
}
# torch.cuda.get_device_name -> model, the whole name matched (case and spacing aside): a substring would take an
# "A10G" for an A10 or an "H100 PCIe" for an H100 SXM. A name not listed gets no MFU rather than a wrong one.
_GPU_NAMES = (
    (r"NVIDIA H100 80GB HBM3", "H100 SXM"), (r"NVIDIA H100 PCIe", "H100 PCIe"), (r"NVIDIA H100 NVL", "H100 NVL"),
    (r"NVIDIA H200", "H200 SXM"), (r"NVIDIA H200 NVL", "H200 NVL"), (r"NVIDIA GH200 \d+GB?( HBM3e?)?", "GH200"),
    (r"NVIDIA A100-SXM4-(40|80)GB", "A100"), (r"NVIDIA A100-PCIE-40GB", "A100"), (r"NVIDIA A100 80GB PCIe", "A100"),
    (r"NVIDIA A10", "A10"), (r"NVIDIA B200", "B200"), (r"NVIDIA L40S", "L40S"), (r"NVIDIA L40", "L40"),
)


def gpu_model(name: str) -> str | None:
    """A GPU_PEAK_FLOPS key for a torch.cuda.get_device_name string, or None (not a GPU the table knows)."""
    normal = " ".join(name.split())
    return next((model for pattern, model in _GPU_NAMES if re.fullmatch(pattern, normal, re.IGNORECASE)), None)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the GPU named ``device_name`` for the dtype the run computes in (--model-dtype: fp32, or
    bf16/fp16 under autocast), for MFU. None: a GPU the table does not know, or fp64."""
    model = gpu_model(device_name)
    if model is None:
        return None
    fp32, half = GPU_PEAK_FLOPS[model]
    return {"fp32": fp32, "bf16": half, "fp16": half}.get(dtype)


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """peak_flops of the run's device; None on CPU."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


class Metrics:
    """Every rank keeps the row of the last completed step (a just-in-time save by a survivor needs it); rank 0 writes
    the CSV and the progress. ``imports`` = (monotonic time the heavy imports began, ended), for the recovery line (None: a resume in the same
    process, which train.py's in-process recovery line reports)."""

    def __init__(self, *, writer: bool, csv_path: Path | None, resumed_step: int | None = None, start_step: int = 0,
                 total_steps: int = 0, every: int = 1, tokens_per_step: int = 0, flops_per_token: float = 0.0,
                 peak_flops: float | None = None, world_size: int = 1, imports: tuple[float, float] | None = (0.0, 0.0),
                 profiler=None, trackers: list | None = None, tracker_dir: Path | None = None,
                 tracker_names: tuple[str, ...] = (), save_records=None, memory=None, val_csv_path: Path | None = None,
                 evaluations=None):
        self.writer, self.csv_path, self.resumed_step = writer, csv_path, resumed_step
        # ``evaluations(a, b)``: how many evaluations the steps in (a, b] make (the ETA counts them at their measured
        # duration, and the step time without them)
        self.evaluations, self._eval_s, self._evals = evaluations, 0.0, 0
        # the evaluations' rows (``val_csv_path``: given when the run evaluates, or has evaluated: see train.py)
        self.val_csv = ValCSV(val_csv_path, resumed_step) if (val_csv_path and writer) else None
        # distributed.PeakMemory: rank 0's peaks per step, for the log line and the trackers (never the CSV: a
        # resumed run's rows must be bitwise the uninterrupted one's, and memory is not)
        self.memory = memory if writer else None
        self._memory_peaks: dict[str, int] = {}  # the highest of each since the last log line
        self.total_steps, self.every, self.world_size = total_steps, every, world_size
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.imports, self.profiler = imports, profiler
        self.csv = LossCSV(csv_path, resumed_step) if (csv_path and writer) else None
        # --tracker (trackers.py): opened on rank 0 only; every rank knows the names and folder for ensure_logged.
        self.trackers = trackers or []
        self.tracker_dir, self.tracker_names = tracker_dir, tuple(tracker_names)
        self.save_records = save_records  # () -> the manager's SaveRecords: blocked/persist times for the trackers
        self._saves_logged = 0
        self._start_step = start_step
        self.last_loss = float("nan")
        self.last_lr: float | None = None
        self._interval: list[float] = []  # the losses since the last save (the checkpoint card's mean)
        self._row: dict | None = None
        self._t_loop = time.monotonic()
        self._load_s = 0.0
        self.progress = None
        if writer:
            from tqdm import tqdm

            self.progress = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                                 disable=not bar_fits() and not knobs.force_progress())

    def start(self, load_s: float) -> None:
        """The loop begins (what a restart cost is measured up to the end of the first step after this)."""
        self._t_loop, self._load_s = time.monotonic(), load_s
        if self.profiler is not None:
            self.profiler.start()

    def step(self, step: int, loss: float, lr: float, grad_norm, step_s: float, tokens_seen: int, restarts: int) -> None:
        self.last_loss, self.last_lr = loss, lr
        self._interval.append(loss)
        self._row = {"step": step, "loss": repr(loss), "lr": repr(lr), "tokens_seen": tokens_seen, "restart": restarts}
        if self.writer and self.resumed_step is not None and step == self.resumed_step + 1 and self.imports:
            _log.info(self.recovery_line())  # what the restart cost (docs/checkpointing.md: restart cost)
        if self.csv:
            self.csv.row(**self._row, wall_time=f"{time.time():.3f}")
        tok_s = self.tokens_per_step / step_s if step_s > 0 else 0.0
        mfu = self.flops_per_token * tok_s / self.world_size / self.peak_flops if self.peak_flops else None
        memory = self.memory.interval() if self.memory is not None else {}
        for key, value in memory.items():
            self._memory_peaks[key] = max(value, self._memory_peaks.get(key, 0))
        if self.trackers:
            self._track(step, loss, lr, grad_norm, step_s, tok_s, mfu, tokens_seen, memory)
        # the first step of this incarnation too: a start (or a resume) shows that it trains without waiting for
        # --logging-frequency steps
        due = step % self.every == 0 or step == self.total_steps or step == self._start_step + 1
        if self.progress is not None and due:
            postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}", "step_s": f"{step_s:.3f}"}
            if grad_norm is not None:
                postfix["gnorm"] = f"{float(grad_norm):.2f}"
            if mfu is not None:
                postfix["mfu"] = f"{100 * mfu:.1f}%"
            # the peaks since the last line, in MiB: peak_allocated / peak_reserved on CUDA, peak_rss on CPU
            postfix.update({key: f"{value / 2**20:,.0f}MiB" for key, value in self._memory_peaks.items()})
            self._memory_peaks = {}
            self.progress.set_postfix(postfix, refresh=False)
            self.progress.update(step - self.progress.n)
            if self.progress.disable:  # no terminal (batch job log), or one 0 columns wide: plain lines, no bar
                # The bar shows rate and remaining time itself; a batch log needs them spelled out.
                plain = {"loss": postfix["loss"], "lr": f"{lr:.3e}", **{k: v for k, v in postfix.items() if k != "loss"},
                         "eta": self._eta(step)}
                _log.info(f"step {step}/{self.total_steps} " + " ".join(f"{k} {v}" for k, v in plain.items()))
        if self.profiler is not None:
            self.profiler.step()

    def _eta(self, step: int) -> str:
        """Remaining time at this incarnation's mean step time (its first step, with the restart's costs, included:
        an overestimate that fades), plus the evaluations still to come at their mean measured duration."""
        done = step - self._start_step
        if done <= 0:
            return "?"
        training = max(0.0, time.monotonic() - self._t_loop - self._eval_s)
        left = training / done * max(0, self.total_steps - step)
        if self.evaluations is not None and self._evals:
            left += self.evaluations(step, self.total_steps) * self._eval_s / self._evals
        h, rem = divmod(int(left + 0.5), 3600)
        return f"{h}:{rem // 60:02d}:{rem % 60:02d}"

    def _track(self, step: int, loss: float, lr: float, grad_norm, step_s: float, tok_s: float, mfu: float | None,
               tokens_seen: int, memory: dict[str, int]) -> None:
        values = {"train/loss": loss, "train/lr": lr, "train/tokens_seen": float(tokens_seen),
                  "perf/step_s": step_s, "perf/tokens_per_s": tok_s}
        values.update({f"memory/{key}_mib": value / 2**20 for key, value in memory.items()})
        if grad_norm is not None:
            values["train/grad_norm"] = float(grad_norm)
        if mfu is not None:  # known only on a GPU whose peak device_peak_flops knows
            values["perf/mfu"] = mfu
        values.update(self._durable_saves())
        for tracker in self.trackers:
            tracker.log(step, values)

    def _durable_saves(self) -> dict[str, float]:
        """A save's times, once it is durable (async: in the background): logged at the first step after that (the
        last save's at close). Several at once (rare): the last one's."""
        values = {}
        records = self.save_records() if self.save_records else []
        while self._saves_logged < len(records) and records[self._saves_logged].durable_s > 0:
            r = records[self._saves_logged]
            values = {"checkpoint/blocked_s": r.blocking_s, "checkpoint/persist_s": r.durable_s,
                      "checkpoint/step": float(r.step)}
            self._saves_logged += 1
        return values

    def note_eval(self, step: int, evaluation: dict, seconds: float = 0.0) -> None:
        """An evaluation after step ``step`` that took ``seconds`` (evaluation.Evaluator): one log line, a val CSV row,
        the trackers' val/loss and val/ppl (and eval/loss, eval/probe_loss, as a card records them) at that step.
        Rank 0 writes."""
        self._eval_s, self._evals = self._eval_s + seconds, self._evals + 1
        if not self.writer:
            return
        loss, ppl, tokens = evaluation["val_loss"], evaluation["val_ppl"], evaluation["val_tokens"]
        _log.info(f"eval step {step}: val loss {loss:.4f} ppl {ppl:.2f} ({tokens} tokens, {seconds:.1f}s)")
        if self.val_csv:
            self.val_csv.row(step=step, val_loss=repr(loss), val_ppl=repr(ppl), val_tokens=tokens,
                             wall_time=f"{time.time():.3f}")
        for tracker in self.trackers:
            tracker.log(step, {"val/loss": loss, "val/ppl": ppl, "eval/loss": evaluation["eval_loss"],
                               "eval/probe_loss": evaluation["probe_loss"]})

    def recovery_line(self) -> str:
        """What a restart cost this rank, from its process start to the end of its first step after the resume."""
        t_imports, t_imported = self.imports
        now, total = time.monotonic(), process_age_s(t_imports)
        parts = {"python start-up": max(0.0, total - (now - t_imports)), "imports": t_imported - t_imports,
                 "setup": self._t_loop - t_imported - self._load_s, "checkpoint load": self._load_s,
                 "first step": now - self._t_loop}
        return (f"recovery: first step after resume {total:.2f}s after process start ("
                + ", ".join(f"{name} {s:.2f}s" for name, s in parts.items()) + ")")

    def take_interval(self) -> list[float]:
        """The losses of the steps since the last call (the last save)."""
        losses, self._interval = self._interval, []
        return losses

    def sync(self) -> None:
        """Before a save: the rows up to it are durable (a resume must never find fewer rows than its step)."""
        if self.csv:
            self.csv.sync()
        if self.val_csv:
            self.val_csv.sync()
        for tracker in self.trackers:
            tracker.sync()

    def ensure_logged(self, step: int) -> None:
        """A survivor's just-in-time save of ``step`` (jit.py): if rank 0 died before writing that step's row, append
        it, so the CSV still has every step exactly once."""
        if "tensorboard" in self.tracker_names and self._row is not None and int(self._row["step"]) == step:
            try:  # best effort: a failed repair must not cost the just-in-time save it accompanies
                from trackers import repair_tensorboard

                repair_tensorboard(self.tracker_dir / "tensorboard", step, self._row)
            except Exception as e:  # noqa: BLE001
                _log.info(f"jit: could not log step {step} to TensorBoard ({e}); it may lack that step",
                          extra=EVERY_RANK)
        if self.csv_path is None or not self.csv_path.exists():
            return
        if self._row is None or int(self._row["step"]) != step:
            _log.info(f"jit: the loss of step {step} is unknown here; the loss CSV may lack that row", extra=EVERY_RANK)
            return
        with open(self.csv_path, newline="") as f:
            steps = [int(r["step"]) for r in _whole_rows(csv.DictReader(f))]
        if steps and max(steps) >= step:
            return
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, LossCSV.FIELDS).writerow({**self._row, "wall_time": f"{time.time():.3f}"})
            f.flush()
            os.fsync(f.fileno())
        _log.info(f"jit: appended the loss of step {step} to {self.csv_path} (rank 0 did not live to write it)",
                  extra=EVERY_RANK)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self.trackers and self._row is not None and (saves := self._durable_saves()):
            for tracker in self.trackers:  # the last save completed after the last step was logged
                tracker.log(int(self._row["step"]), saves)
        for tracker in self.trackers:
            tracker.close()
        if self.progress is not None:
            self.progress.close()
