"""How long the command line takes to answer, against `import torch` in the same run (issue 54: flags first, torch
later): `python train.py --help`, `python train.py --bogus-flag` and the other programs' --help, each a whole process
from start to exit, as a user waits for it.

    python -m benchmarks.cli [--repeats 15 | --quick] [--json results/bench_cli.json]

The commands alternate within each round (the round's order rotates), and each one's ratio is taken against the
`import torch` of its own round, so a machine whose speed drifts during the run still gives meaningful ratios: the
median is reported with its (min-max) spread. Targets: train.py's --help and a bad flag <= 0.35 x `import torch`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TARGET = 0.35  # x `import torch`, for train.py --help and a bad flag

#: label -> (argv, the exit code it must end with)
COMMANDS: dict[str, tuple[list[str], int]] = {
    "import torch": ([PY, "-c", "import torch"], 0),
    "train.py --help": ([PY, str(ROOT / "train.py"), "--help"], 0),
    "train.py --bogus-flag": ([PY, str(ROOT / "train.py"), "--bogus-flag"], 2),
    "train.py --batch-size 0": ([PY, str(ROOT / "train.py"), "--batch-size", "0"], 2),
    "python -m checkpoint --help": ([PY, "-m", "checkpoint", "--help"], 0),
    "evaluation.py --help": ([PY, str(ROOT / "evaluation.py"), "--help"], 0),
    "hf.py --help": ([PY, str(ROOT / "hf.py"), "--help"], 0),
    "dataset.py prepare --help": ([PY, str(ROOT / "dataset.py"), "prepare", "--help"], 0),
}
BASE = "import torch"


def once(argv: list[str], code: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)
    seconds = time.perf_counter() - t0
    if proc.returncode != code:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}, not {code}: {proc.stderr[-500:]}")
    return seconds


def measure(repeats: int) -> dict:
    labels = list(COMMANDS)
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    ratios: dict[str, list[float]] = {label: [] for label in labels if label != BASE}
    for label in labels if repeats > 1 else []:  # warm-up: the page cache holds torch's files from here on
        once(*COMMANDS[label])
    for r in range(repeats):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        this = {label: once(*COMMANDS[label]) for label in order}
        for label, s in this.items():
            seconds[label].append(s)
            if label != BASE:
                ratios[label].append(s / this[BASE])
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(), "repeats": repeats,
            "seconds": seconds, "ratios": ratios}


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(res: dict) -> str:
    rows = [f"`python -m benchmarks.cli --repeats {res['repeats']}` - {res['date']}, {res['cores']} CPU cores; "
            "whole processes, median (min-max) over the rounds",
            "", "| command | seconds | x `import torch` (same round) |", "|---|---:|---:|"]
    for label, s in res["seconds"].items():
        ratio = "1" if label == BASE else spread(res["ratios"][label], ".3f")
        rows.append(f"| `{label}` | {spread(s, '.3f')} | {ratio} |")
    met = all(statistics.median(res["ratios"][k]) <= TARGET for k in ("train.py --help", "train.py --bogus-flag"))
    rows += ["", f"train.py --help and --bogus-flag <= {TARGET} x `import torch`: {'met' if met else 'NOT met'}"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15,
                   help="rounds of every command (default 15; 1: a smoke run without the warm-up round)")
    p.add_argument("--quick", action="store_true", help="= --repeats 1: a smoke run (its figures mean little)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    res = measure(1 if args.quick else max(1, args.repeats))
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
