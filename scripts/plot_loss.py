#!/usr/bin/env python3
"""Overlay loss curves of several runs: `python scripts/plot_loss.py a.csv b.csv -o loss.png`.

Reads the CSVs `train.py --log-loss-to-csv` writes (step, loss, lr, tokens_seen, wall_time, restart).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", type=Path, help="loss CSV files")
    p.add_argument("-o", "--output", type=Path, default=Path("loss.png"), help="output image")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in steps")
    p.add_argument("--labels", nargs="*", help="legend labels (default: parent folder names)")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, path in enumerate(args.csv):
        if not path.is_file():
            print(f"error: {path} does not exist; pass loss CSVs written with --log-loss-to-csv", file=sys.stderr)
            return 2
        df = pd.read_csv(path)
        if not {"step", "loss"} <= set(df.columns):
            print(f"error: {path} has no step/loss columns; is it a train.py loss CSV?", file=sys.stderr)
            return 2
        label = args.labels[i] if args.labels and i < len(args.labels) else path.parent.name or path.stem
        ax.plot(df["step"], df["loss"].rolling(args.smooth, min_periods=1).mean(), label=label, lw=1.2)
        restarts = df.index[df["restart"].diff().fillna(0) > 0] if "restart" in df else []
        for r in restarts:
            ax.axvline(df["step"][r], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
