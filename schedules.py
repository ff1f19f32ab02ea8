"""Learning-rate schedules: the factor LambdaLR multiplies --learning-rate by at optimizer step s (0-based: the step
that trains row s + 1 of loss.csv). Every schedule starts with the same linear warm-up, (s + 1) / W for s < W, then:

    cosine    min + (1 - min) * (1 + cos(pi * p)) / 2,  p = (s - W) / (T - W)    (the default; ends near min)
    linear    1 - (1 - min) * p                                                  (straight down to min)
    wsd       warm-up, stable at 1, then the last D steps decay linearly: 1 - (1 - min) * (s - (T - D) + 1) / D,
              so the final step trains at exactly min (MiniCPM, OLMo 2); the stable phase is what a resume with a
              larger --training-steps extends, so a run can be lengthened before it anneals
    constant  1 after the warm-up (--min-lr-ratio unused)

W = --lr-warmup-steps, T = --training-steps, min = --min-lr-ratio, D = --lr-decay-steps, else round(--lr-decay-fraction
x T). The formulas live here alone: train.py builds the scheduler from them, flags.py re-applies them on resume.
"""

from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("cosine", "linear", "wsd", "constant")
DEFAULT_DECAY_FRACTION = 0.2  # wsd: the share of the run spent annealing (MiniCPM: ~10 %, OLMo 2 ~ the last 5-20 %)


def decay_steps(total: int, steps: int | None, fraction: float) -> int:
    """wsd's D: --lr-decay-steps when given, else --lr-decay-fraction of the run (at least one step)."""
    return steps if steps is not None else max(1, round(fraction * total))


def lr_lambda(warmup: int, total: int, min_ratio: float = 0.1, schedule: str = "cosine",
              decay: int = 0) -> Callable[[int], float]:
    """step -> factor of the peak learning rate (``decay``: wsd's D, see decay_steps)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        if schedule == "wsd":
            start = total - decay
            if step < start:
                return 1.0
            return 1.0 - (1.0 - min_ratio) * min(1.0, (step - start + 1) / decay)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return factor


def from_flags(args) -> Callable[[int], float]:
    """The schedule train.py's flags ask for (--lr-schedule, --lr-warmup-steps, --training-steps, --min-lr-ratio,
    --lr-decay-steps / --lr-decay-fraction)."""
    return lr_lambda(args.lr_warmup_steps, args.training_steps, args.min_lr_ratio, args.lr_schedule,
                     decay_steps(args.training_steps, args.lr_decay_steps, args.lr_decay_fraction))


def described(args) -> str:
    """describe() for train.py's flags."""
    return describe(args.lr_schedule, args.lr_warmup_steps, args.training_steps, args.min_lr_ratio,
                    decay_steps(args.training_steps, args.lr_decay_steps, args.lr_decay_fraction))


def describe(schedule: str, warmup: int, total: int, min_ratio: float, decay: int = 0) -> str:
    """One phrase for the checkpoint's card: the schedule with its numbers."""
    ends = {"cosine": f"cosine to {min_ratio:g} x peak at step {total}",
            "linear": f"linear to {min_ratio:g} x peak at step {total}",
            "wsd": f"stable to step {total - decay}, then linear decay over {decay} step(s) to {min_ratio:g} x peak",
            "constant": "constant at the peak"}[schedule]
    return f"{schedule}: {warmup} warm-up step(s), {ends}"
