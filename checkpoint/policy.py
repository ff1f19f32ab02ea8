"""WHEN to save and when to stop. Pure decisions over a clock and counters, so they are testable without SLURM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IntervalPolicy:
    """Save every ``every_steps`` steps (0 = never on a schedule) and always at the final step."""

    every_steps: int
    final_step: int

    def due(self, step: int) -> bool:
        return step == self.final_step or (self.every_steps > 0 and step % self.every_steps == 0)
