"""The one place that decides device, process-group backend and dtypes.

Launchers: `torchrun` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) or `srun` directly (SLURM_PROCID/
SLURM_NTASKS/SLURM_LOCALID, master = first host of SLURM_JOB_NODELIST). CUDA -> NCCL, one GPU per local rank;
otherwise CPU -> gloo.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


class LaunchError(Exception):
    """One line: what is wrong with how the job was launched, and how to fix it."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None = single process, no process group
    launcher: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM node list, e.g. 'nid[001-004,007]' -> 'nid001'. Uses scontrol when available."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"^([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _launcher_env() -> tuple[int, int, int, str] | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))))
        # A port derived from the job id keeps two jobs sharing a node from colliding.
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "srun"
    return None


def init(distributed: bool, timeout_s: float = 600.0) -> DistEnv:
    """Initialise the process group when asked; pick the device. Raises LaunchError with one clear line."""
    cuda = torch.cuda.is_available()
    if not distributed:
        return DistEnv(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    launch = _launcher_env()
    if launch is None:
        raise LaunchError(
            "--distributed needs a launcher: run `torchrun --nproc_per_node=N train.py --distributed ...` or "
            "`srun python train.py --distributed ...` (or drop --distributed for one process)"
        )
    rank, world_size, local_rank, launcher = launch
    if cuda:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if cuda else {}),
    )
    return DistEnv(rank, world_size, local_rank, device, backend, launcher)


def autocast(env: DistEnv, dtype_name: str):
    """Mixed precision: bf16/fp16 run under autocast with fp32 master weights; fp32/fp64 run in that dtype."""
    dtype = DTYPES[dtype_name]
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device_type=env.device.type, dtype=dtype)
    import contextlib

    return contextlib.nullcontext()


def param_dtype(dtype_name: str) -> torch.dtype:
    """Parameters stay fp32 under mixed precision (the optimizer needs it); fp64 runs fully in fp64."""
    return torch.float64 if dtype_name == "fp64" else torch.float32


def all_reduce_max(value: float, env: DistEnv) -> float:
    """Max of a scalar over ranks (used by stop/save decisions so all ranks agree)."""
    if not env.distributed:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def replicas_identical(model: torch.nn.Module, env: DistEnv) -> bool:
    """True when every rank holds bitwise the same parameters (data parallelism's invariant). Cheap: one crc per rank."""
    import zlib

    crc = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP shards differ by design; compare DDP replicas
        crc = zlib.crc32(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    if not env.distributed:
        return True
    crcs: list = [None] * env.world_size
    dist.all_gather_object(crcs, crc)
    return len(set(crcs)) == 1


def set_timeout(seconds: float) -> None:
    """Timeout of every later collective on the default group. train.py sets a short one for the training loop once
    setup (tokenizing, resuming: ranks may legitimately be minutes apart) is over, so a hung rank is noticed in time."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds))


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()
