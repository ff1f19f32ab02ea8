"""Fault-injection suite: kill training runs at random moments and at named points inside the save path, resume from
`latest`, and prove that nothing committed is ever lost and the final weights are bit-identical to an uninterrupted run.

    python -m tests.faults --trials 20            # quick (CI), a few minutes
    python -m tests.faults --trials 500 --seed 1  # long run (`make faults K=500`)

See harness.py for what is counted and how. Importable both as ``tests.faults`` (python -m, from the repo root) and as
``faults`` (pytest puts tests/ on sys.path), hence the path set-up below.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
for _p in (str(_TESTS), str(_TESTS.parent)):
    if _p not in sys.path:
        sys.path.append(_p)
