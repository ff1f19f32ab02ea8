"""The user documentation stays true to the code: every link between README.md and docs/ leads to a file that exists,
and the flags table of docs/training.md names every flag `python train.py --help` has, and no other."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import ROOT  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_leads_to_a_file():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not bad, bad
    assert len(PAGES) > 5  # the README and its docs/ pages were found


def test_the_flags_table_matches_train_help():
    import flags

    table = set(re.findall(r"^\| `(--[A-Za-z0-9_-]+)", (ROOT / "docs" / "training.md").read_text(), re.M))
    missing, known = [], set()
    for action in flags.build_parser()._actions:
        names = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        known.update(names)
        if names and not table & set(names):
            missing.append(names[0])
    assert not missing, f"flags missing from docs/training.md's table: {missing}"
    assert table <= known, f"docs/training.md lists flags train.py does not have: {sorted(table - known)}"
