"""python -m tests.faults [--trials K] [--seed S] ... -- see tests/faults/harness.py. Exit 1 if a required zero is not."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from . import _TESTS  # noqa: F401  (sets sys.path so that `helpers` and the project import)
from .harness import KINDS, OVERLAP_EVERY, report, run_suite

DEFAULT_DATASET = _TESTS.parent / "data" / "train_data.parquet"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    p.add_argument("--trials", type=int, default=20, help="trials in total, spread round-robin over the configurations")
    p.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: random, printed)")
    p.add_argument("--steps", type=int, default=5, help="training steps per run (a checkpoint every step)")
    p.add_argument("--max-kills", type=int, default=2, help="kills per trial: uniform in 1..N (0..N in an overlap trial)")
    p.add_argument("--backends", default=None, help="comma-separated subset of checkpoint.backends.BACKENDS")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    p.add_argument("--no-jit", action="store_true", help="leave out the 2-rank --jit-checkpoint configuration")
    p.add_argument("--spares", type=int, default=1,
                   help="spares of the in-process configuration (2 ranks under launcher.py, node-local tier; kill "
                        "trials only); with --max-kills 2 a trial's second kill finds none left: exit 3 and a restart. "
                        "0 leaves the configuration out (default: %(default)s)")
    p.add_argument("--dataset", default=str(DEFAULT_DATASET), help="parquet file (make data builds the default)")
    p.add_argument("--workdir", default=None,
                   help="where runs write checkpoints (default: a temporary folder in /dev/shm if there is one: the "
                        "many fsyncs are cheap there and SIGKILL, unlike power loss, does not depend on them)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"trial kinds, comma-separated: kill (SIGKILL and resume), overlap (a frozen incarnation, a "
                        f"refused start, a --force-takeover one; the frozen one must stop fenced); with both, every "
                        f"{OVERLAP_EVERY}th trial is an overlap (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint folders of every trial")
    p.add_argument("--json", default=None, help="also write the counts to this JSON file")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds {args.kinds!r}: choose from {', '.join(KINDS)}")
    if not Path(args.dataset).exists():
        print(f"error: dataset {args.dataset} does not exist; run `make data` or pass --dataset", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    shm = "/dev/shm" if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="pyrecover-faults-", dir=shm))
    try:
        total, per_config, seconds = run_suite(
            args.trials, seed, args.dataset, workdir, steps=args.steps, max_kills=args.max_kills,
            backends=args.backends.split(",") if args.backends else None,
            world_sizes=tuple(int(w) for w in args.world_sizes.split(",")), jit=not args.no_jit,
            keep=args.keep, kinds=kinds, spares=max(0, args.spares), log=lambda m: print(m, flush=True))
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report(total, per_config, seconds, seed, args.trials, kinds), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "seconds": round(seconds, 1), "total": asdict(total),
                                               "per_config": {k: asdict(v) for k, v in per_config.items()}}, indent=1))
    return 1 if total.violations() or total.trials == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
