"""What a run reports, step by step: progress (a bar on a terminal, plain lines in a batch log), the loss CSV, MFU,
the recovery time of a resume, the profiler trace -- and the repair of a loss-CSV row that a dead rank 0 never wrote."""

from __future__ import annotations

import csv
import logging
import os
import sys
import time
from pathlib import Path

import torch

from checkpoint import knobs
from checkpoint.logs import EVERY_RANK
from checkpoint.fsio import fsync_dir, make_dirs
from warm import process_age

_log = logging.getLogger("pyrecover.metrics")


_STARTED_AT: float | None = None  # time.monotonic() of the rank's start, where it is not this process's (warm.py)


def started_at(t: float) -> None:
    global _STARTED_AT
    _STARTED_AT = t


def process_age_s(fallback_start: float) -> float:
    """Seconds since this rank started: this process's age (warm.process_age), or since the rank process handed itself
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

    def __init__(self, path: Path, resumed_step: int | None):
        self.path = path
        make_dirs(path.parent)
        rows = []
        if path.exists():
            with open(path, newline="") as f:
                rows = [r for r in _whole_rows(csv.DictReader(f)) if int(r["step"]) <= (resumed_step or 0)]
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


def _whole_rows(reader):
    """The rows before the first one that does not parse: appends after the last sync may survive a power cut torn
    or as zeros (tests/powerloss found a resume dying on a NUL-filled row). Those rows are past the checkpoint the
    run resumes from, and get rewritten."""
    for r in reader:
        try:
            int(r["step"]), float(r["loss"]), float(r["lr"]), int(r["tokens_seen"])
        except (KeyError, TypeError, ValueError):
            return
        yield r


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU, for MFU. None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H100", 989e12), ("GH200", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40", 181e12),
                       ("A10", 125e12), ("V100", 125e12)):
        if key in name:
            return flops
    return None


class Metrics:
    """Every rank keeps the row of the last completed step (a just-in-time save by a survivor needs it); rank 0 writes
    the CSV and the progress. ``imports`` = (monotonic time the heavy imports began, ended), for the recovery line."""

    def __init__(self, *, writer: bool, csv_path: Path | None, resumed_step: int | None = None, start_step: int = 0,
                 total_steps: int = 0, every: int = 1, tokens_per_step: int = 0, flops_per_token: float = 0.0,
                 peak_flops: float | None = None, world_size: int = 1, imports: tuple[float, float] = (0.0, 0.0),
                 profiler=None, trackers: list | None = None, tracker_dir: Path | None = None,
                 tracker_names: tuple[str, ...] = (), save_records=None):
        self.writer, self.csv_path, self.resumed_step = writer, csv_path, resumed_step
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
                                 disable=not sys.stderr.isatty() and not knobs.force_progress())

    def start(self, load_s: float) -> None:
        """The loop begins (what a restart cost is measured up to the end of the first step after this)."""
        self._t_loop, self._load_s = time.monotonic(), load_s
        if self.profiler is not None:
            self.profiler.start()

    def step(self, step: int, loss: float, lr: float, grad_norm, step_s: float, tokens_seen: int, restarts: int) -> None:
        self.last_loss, self.last_lr = loss, lr
        self._interval.append(loss)
        self._row = {"step": step, "loss": repr(loss), "lr": repr(lr), "tokens_seen": tokens_seen, "restart": restarts}
        if self.writer and self.resumed_step is not None and step == self.resumed_step + 1:
            _log.info(self.recovery_line())  # what the restart cost (docs/checkpointing.md: restart cost)
        if self.csv:
            self.csv.row(**self._row, wall_time=f"{time.time():.3f}")
        tok_s = self.tokens_per_step / step_s if step_s > 0 else 0.0
        mfu = self.flops_per_token * tok_s / self.world_size / self.peak_flops if self.peak_flops else None
        if self.trackers:
            self._track(step, loss, lr, grad_norm, step_s, tok_s, mfu, tokens_seen)
        if self.progress is not None and (step % self.every == 0 or step == self.total_steps):
            postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}", "step_s": f"{step_s:.3f}"}
            if grad_norm is not None:
                postfix["gnorm"] = f"{float(grad_norm):.2f}"
            if mfu is not None:
                postfix["mfu"] = f"{100 * mfu:.1f}%"
            self.progress.set_postfix(postfix, refresh=False)
            self.progress.update(step - self.progress.n)
            if self.progress.disable:  # not a terminal (batch job log): plain lines instead of a bar
                # The bar shows rate and remaining time itself; a batch log needs them spelled out.
                plain = {"loss": postfix["loss"], "lr": f"{lr:.3e}", **{k: v for k, v in postfix.items() if k != "loss"},
                         "eta": self._eta(step)}
                _log.info(f"step {step}/{self.total_steps} " + " ".join(f"{k} {v}" for k, v in plain.items()))
        if self.profiler is not None:
            self.profiler.step()

    def _eta(self, step: int) -> str:
        """Remaining time at this incarnation's mean step time (its first step, with the restart's costs, included:
        an overestimate that fades)."""
        done = step - self._start_step
        if done <= 0:
            return "?"
        left = (time.monotonic() - self._t_loop) / done * max(0, self.total_steps - step)
        h, rem = divmod(int(left + 0.5), 3600)
        return f"{h}:{rem // 60:02d}:{rem % 60:02d}"

    def _track(self, step: int, loss: float, lr: float, grad_norm, step_s: float, tok_s: float, mfu: float | None,
               tokens_seen: int) -> None:
        values = {"train/loss": loss, "train/lr": lr, "train/tokens_seen": float(tokens_seen),
                  "perf/step_s": step_s, "perf/tokens_per_s": tok_s}
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

    def note_eval(self, step: int, evaluation: dict | None) -> None:
        """The held-out losses of the card saved at ``step`` (evaluation.py), logged at that step."""
        if evaluation and self.trackers:
            for tracker in self.trackers:
                tracker.log(step, {"eval/loss": evaluation["eval_loss"], "eval/probe_loss": evaluation["probe_loss"]})

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
