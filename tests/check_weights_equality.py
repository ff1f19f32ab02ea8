#!/usr/bin/env python3
"""Compare the weights (and optionally optimizer state) of two PyRecover checkpoints.

    python tests/check_weights_equality.py CKPT_A CKPT_B [--tolerance 0] [--optimizer] [--verbose]

A checkpoint is a step folder, an experiment folder (its `latest` is used) or a single .pt file, from any backend and
any world size. Exit 0: equal within tolerance (0 = bitwise); 1: different; 2: error (one line). No GPU needed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from checkpoint.errors import CheckpointError  # noqa: E402
from checkpoint.reader import read_section  # noqa: E402


BITS_DIFFER = 5e-324  # reported when values compare equal but bits do not (-0.0 vs 0.0, NaN payloads)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 only when the tensors are bitwise identical."""
    if a.numel() == 0:
        return 0.0
    if torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)):
        return 0.0
    if a.dtype.is_floating_point:
        diff = float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max())
    else:
        diff = float((a.long() - b.long()).abs().max())
    return diff if diff > 0 else BITS_DIFFER


def _plain(v):
    return [_plain(i) for i in v] if isinstance(v, (list, tuple)) else v


def compare(a: dict, b: dict, tolerance: float, verbose: bool, label: str) -> list[str]:
    problems = []
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a:
        problems.append(f"{label}: {len(only_a)} keys only in the first, e.g. {only_a[0]}")
    if only_b:
        problems.append(f"{label}: {len(only_b)} keys only in the second, e.g. {only_b[0]}")
    rows = []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if _plain(x) != _plain(y):  # (0.9, 0.95) and [0.9, 0.95] are the same hyper-parameter
                problems.append(f"{label}: {key} differs ({x!r} vs {y!r})")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{label}: {key} is {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            continue
        diff = max_abs_diff(x, y)
        rows.append((key, list(x.shape), str(x.dtype).replace("torch.", ""), diff))
        if diff > tolerance:
            problems.append(f"{label}: {key} differs by max |a-b| = {diff:.3e} > {tolerance:g}")
    if verbose:
        width = max([len(r[0]) for r in rows] + [10])
        print(f"{'tensor':<{width}}  {'shape':<16} {'dtype':<9} max|a-b|")
        for key, shape, dtype, diff in rows:
            print(f"{key:<{width}}  {str(shape):<16} {dtype:<9} {diff:.3e}{'  <-- DIFF' if diff > tolerance else ''}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--tolerance", type=float, default=1e-7, help="max allowed |a-b| per element (0 = bitwise)")
    p.add_argument("--optimizer", action="store_true", help="also compare optimizer state (moments, steps)")
    p.add_argument("--distributed", action="store_true",
                   help="accepted for compatibility: sharded (DCP) checkpoints are read without a process group")
    p.add_argument("--verbose", action="store_true", help="print a per-tensor table")
    args = p.parse_args(argv)
    if not math.isfinite(args.tolerance) or args.tolerance < 0:  # nan would call every difference equal
        print(f"error: --tolerance {args.tolerance:g} is not a finite number >= 0; give 0 (bitwise) or a positive "
              "bound on |a-b|", file=sys.stderr)
        return 2
    try:
        problems = []
        sections = ["model"] + (["optimizer"] if args.optimizer else [])
        counted = 0
        for section in sections:
            a, b = read_section(args.first, section), read_section(args.second, section)
            counted += len(a)
            problems += compare(a, b, args.tolerance, args.verbose, section)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if problems:
        for line in problems[:20]:
            print(line)
        print(f"DIFFERENT: {len(problems)} problem(s)")
        return 1
    bound = "bitwise" if args.tolerance == 0 else f"within {args.tolerance:g}"
    print(f"EQUAL: {counted} entries ({', '.join(sections)}) {bound}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
