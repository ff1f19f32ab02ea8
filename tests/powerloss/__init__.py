"""A crash-consistency test layer: a FUSE passthrough that records every filesystem operation (recorder.py), a
persistence model that turns the record into the states a power cut could leave (model.py), and the campaign that
resumes training from each of them (campaign.py). See docs/reliability.md, "Power loss"."""

import sys
from pathlib import Path

# Importable as ``tests.powerloss`` (python -m, from the repo root) and from pytest: the campaign shares tests/helpers.py
# and tests/check_weights_equality.py, found through tests/ on sys.path (as tests/faults does).
_TESTS = Path(__file__).resolve().parent.parent
for _p in (str(_TESTS), str(_TESTS.parent)):
    if _p not in sys.path:
        sys.path.append(_p)
