"""What --dataset and --val-dataset name, judged from the path alone (stdlib only): train.py refuses a missing data file
before torch is imported, with the line dataset.py's loaders give (they use these functions too)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from tokenizer import DataError


def is_sharded(spec: str | os.PathLike) -> bool:
    """Whether ``--dataset`` names several shards: a folder, or a glob pattern (quoted on the command line)."""
    return glob.has_magic(str(spec)) or Path(spec).is_dir()


def check_exists(path: Path) -> None:
    """One data file (not sharded) is there and is a file."""
    if not path.exists():
        raise DataError(f"data file {path} does not exist; pass --dataset PATH or create the default one with: "
                        f"python dataset.py build-default --output {path}")
    if path.is_dir():
        raise DataError(f"data path {path} is a directory; pass it as --dataset to train on its *.parquet or *.jsonl "
                        "shards")


def check_val_exists(spec: str) -> None:
    """--val-dataset, when it names one file, is there."""
    if not is_sharded(spec) and not Path(spec).exists():
        raise DataError(f"--val-dataset {spec} does not exist; give a parquet file, a folder of them or a quoted glob")
