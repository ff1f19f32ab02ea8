"""The records a checkpoint benchmark run measures (`python -m benchmarks.backends`): one Row per backend and state,
one TrainRun per training run. backends.py fills them, report.py renders them, and both read them from here, so the
report of a previous run's JSON (``--replot``) needs nothing of the measuring code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Row:
    state: str
    backend: str
    stall_s: float = float("nan")  # save() + wait_staged() right away (no forward/backward to overlap with)
    call_s: float = float("nan")  # save() alone = the stall when the copy fully overlaps forward/backward
    durable_s: float = float("nan")
    mib: float = 0.0
    load_s: float = float("nan")
    host_mib: float = 0.0
    burst_stall_s: float = float("nan")
    burst_total_s: float = float("nan")
    burst_saves: int = 0
    disk_mib_s: float = float("nan")  # write+fsync of the same number of bytes, measured right before this row
    note: str = ""

    @property
    def mib_s(self) -> float:
        return self.mib / self.durable_s if self.durable_s > 0 else float("nan")


@dataclass
class TrainRun:
    backend: str
    every: int
    steps: int
    saves: int = 0
    blocked_s: float = 0.0
    loop_s: float = float("nan")
    tok_s_out: float = float("nan")
    tok_s_during: float = float("nan")
    n_during: int = 0
    persist_s: float = float("nan")
    overhead_wall_pct: float = float("nan")
    overhead_est_pct: float = float("nan")
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def dip_pct(self) -> float:
        return 100 * (1 - self.tok_s_during / self.tok_s_out) if self.n_during else float("nan")


def from_dict(cls, d: dict):
    """A record from its JSON form: its fields, less the derived values written beside them (mib_s, dip_pct)
    and any key another version of the benchmark wrote."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
