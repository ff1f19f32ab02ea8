"""The one place that decides device, process-group backend and dtypes.

Launchers: `torchrun` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) or `srun` directly (SLURM_PROCID/
SLURM_NTASKS/SLURM_LOCALID, master = first host of SLURM_JOB_NODELIST). CUDA -> NCCL, one GPU per local rank
(cuda_device_index: the local rank's among all of the node's GPUs, or the only one a task bound to one GPU sees);
otherwise CPU -> gloo. A rank started by torchrun ends when its torchrun dies (follow_launcher). --device and
--model-dtype auto are resolved here too (choose_device, resolve_dtype): a SLURM job given GPUs that torch cannot use
is refused, not trained on CPU.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import re
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint import slurm
from checkpoint.backends.base import RankInfo
from checkpoint.sockets import open_sockets, shut_down
from checkpoint.state import unwrap_model  # noqa: F401 - the module under parallelize's wrappers (DDP, compile)
from procs import die_with_parent  # stdlib only
from devices import DEVICES, DTYPE_NAMES  # noqa: F401 - DEVICES re-exported; the names, stdlib only

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
if tuple(DTYPES) != DTYPE_NAMES:  # the names flags.py offers before torch loads are these
    raise ImportError(f"devices.py lists {DTYPE_NAMES}, distributed.DTYPES {tuple(DTYPES)}")


class LaunchError(Exception):
    """One line: what is wrong with how the job was launched, and how to fix it."""


@dataclass(frozen=True)
class DistEnv(RankInfo):
    """This process's place in the job (the checkpoint package's RankInfo: rank, world size, local rank) and what runs
    it: device, process-group backend, launcher."""

    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None = single process, no process group
    launcher: str = "none"

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def follow_launcher(parent: int, environ=os.environ) -> None:
    """A rank started by torchrun (its elastic agent, the parent process, sets TORCHELASTIC_RUN_ID) is SIGKILLed by the
    kernel when that parent dies (Linux PR_SET_PDEATHSIG), so a killed launcher leaves no rank training on in its own
    session and holding the run directory; the restart takes the run over (the holder's process is gone) and resumes
    from the last committed checkpoint -- saves are atomic, so a kill never leaves a half checkpoint. SIGKILL, not
    SIGTERM: a save needs every peer, and with the launcher gone some may be gone too, so a collective could hang.
    The agent starts its workers from its main thread, whose exit is what the kernel watches. ``parent``: the parent
    pid read at process start; if it is gone already, the rank ends now. Nothing to follow under srun (the parent is
    slurmstepd, which ends the tasks itself) or for one process started by hand."""
    if "PYRECOVER_LAUNCHER_PID" in environ and sys.platform.startswith("linux"):  # launcher.py's members too
        parent = int(environ["PYRECOVER_LAUNCHER_PID"])
    elif "TORCHELASTIC_RUN_ID" not in environ or not sys.platform.startswith("linux"):
        return
    refused = die_with_parent(parent)
    if refused:
        print(f"warning: this rank cannot be tied to its torchrun (prctl: {refused}); if torchrun is killed, end the "
              "rank yourself", file=sys.stderr, flush=True)


def _launcher_env() -> tuple[int, int, int, str] | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun"
    task = slurm.task(env)
    if task is not None:
        rank, world_size, local_rank, master_addr, master_port = task
        env.setdefault("MASTER_ADDR", master_addr)
        env.setdefault("MASTER_PORT", str(master_port))
        return rank, world_size, local_rank, "srun"
    return None


def _local_world_size(environ=os.environ) -> int:
    """Ranks started on this node: torchrun's LOCAL_WORLD_SIZE, else SLURM's tasks on this node ("2(x3)": 2 each)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        m = re.match(r"\d+", environ.get(name, ""))
        if m and int(m.group()) > 0:
            return int(m.group())
    return 1


def cuda_device_index(local_rank: int, local_world_size: int, visible: int, cuda_visible_devices: str | None) -> int:
    """The CUDA device this rank uses, among the ``visible`` ones. Every GPU of the node visible to every task
    (torchrun, plain srun): the rank's own, ``local_rank``. One GPU bound to each task (srun --gpus-per-task=1,
    --gpu-bind, CUDA_VISIBLE_DEVICES set per task): the task sees only its own, device 0, whatever its local rank.
    Anything else -- several visible but fewer than the ranks on the node -- would put two ranks on one GPU or name a
    device that is not there (invalid device ordinal): LaunchError, one line."""
    if visible == 1:
        return 0
    if visible > local_rank and visible >= local_world_size:
        return local_rank
    shown = "unset" if cuda_visible_devices is None else repr(cuda_visible_devices)
    raise LaunchError(
        f"LOCAL_RANK {local_rank} of {local_world_size} ranks on this node sees {visible} CUDA device(s) "
        f"(CUDA_VISIBLE_DEVICES {shown}): give every task one GPU (srun --gpus-per-task=1) or every task all of the "
        f"node's GPUs (one rank per GPU), or start as many ranks per node as there are GPUs")


_NO_GPUS = ("", "-1", "none", "nodevfiles")  # CUDA_VISIBLE_DEVICES values that hide every GPU (SLURM: NoDevFiles)


def gpus_allocated(environ=os.environ) -> str | None:
    """The variable that shows this SLURM job was given GPUs on this node (``NAME=value``), or None: not a SLURM job, or
    no GPUs. SLURM sets SLURM_GPUS_ON_NODE for --gpus*/--gres=gpu jobs, and CUDA_VISIBLE_DEVICES to the GPUs bound."""
    if "SLURM_JOB_ID" not in environ and "SLURM_JOBID" not in environ:
        return None  # outside SLURM CUDA_VISIBLE_DEVICES is often exported by habit; it allocates nothing
    gpus = environ.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        return f"SLURM_GPUS_ON_NODE={gpus}"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip().lower() not in _NO_GPUS:
        return f"CUDA_VISIBLE_DEVICES={visible}"
    return None


def cuda_unusable() -> str:
    """Why torch.cuda.is_available() is False, in words for the user: a CPU-only torch, or no GPU/driver it can use."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None): install a CUDA "
                "build of torch in the job's environment (PYTHON / --setup)")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: check `nvidia-smi` on the "
            "node (driver missing or older than this CUDA?)")


def choose_device(requested: str = "auto", environ=os.environ, *, cuda: bool | None = None) -> str:
    """--device -> "cuda" or "cpu"; the only place that decides it. auto: CUDA when torch can use it, else CPU -- except
    in a SLURM job that was given GPUs, where training on CPU is almost surely a broken environment (a CPU-only torch,
    the wrong venv): LaunchError, one line, instead of hours of slow training. cpu: always. ``cuda``: whether torch can
    use CUDA here (default: torch.cuda.is_available())."""
    if requested not in DEVICES:
        raise LaunchError(f"--device {requested!r}: give one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return "cuda"
    if requested == "cuda":
        raise LaunchError(f"--device cuda, but torch.cuda.is_available() is False: {cuda_unusable()}; or pass "
                          "--device cpu (or auto) to train on CPU")
    shown = gpus_allocated(environ)
    if shown:
        raise LaunchError(f"this SLURM job has GPUs ({shown}), but torch.cuda.is_available() is False: "
                          f"{cuda_unusable()}; pass --device cpu to train on CPU anyway")
    return "cpu"


def resolve_dtype(name: str, device_type: str, bf16_ok: bool | None = None) -> str:
    """--model-dtype auto -> the concrete dtype for ``device_type``: bf16 (autocast, fp32 master weights) on a GPU that
    has it, else fp32. Other names unchanged. ``bf16_ok``: whether the GPU supports bf16 (default: ask torch; a GPU not
    on this machine, e.g. --check on a login node: assumed)."""
    if name != "auto":
        return name
    if device_type != "cuda":
        return "fp32"
    if bf16_ok is None:
        bf16_ok = torch.cuda.is_bf16_supported(including_emulation=False)  # a V100 would emulate it: slow, no tensor cores
    return "bf16" if bf16_ok else "fp32"  # e.g. V100: no bf16; fp16 would need loss scaling, fp32 is the safe choice


def init(distributed: bool, timeout_s: float = 600.0, device: str = "auto", member=None) -> DistEnv:
    """Initialise the process group when asked; pick the device (choose_device). Raises LaunchError with one clear
    line. ``member`` (recovery.Member, under launcher.py): the group is its generation's (join); a spare has none
    yet: a one-process view of the job until a plan gives it a rank."""
    cuda = choose_device(device) == "cuda"
    if not distributed:
        return DistEnv(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    if member is not None:
        local = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if member.plan is None:  # a spare: no rank, no group, until it takes one (join)
            return DistEnv(device=local, launcher="pyrecover")
        return join(member, timeout_s, cuda)
    launch = _launcher_env()
    if launch is None:
        raise LaunchError(
            "--distributed needs a launcher: run `torchrun --nproc_per_node=N train.py --distributed ...` or "
            "`srun python train.py --distributed ...` (or drop --distributed for one process)"
        )
    rank, world_size, local_rank, launcher = launch
    if cuda:
        index = cuda_device_index(local_rank, max(_local_world_size(), local_rank + 1), torch.cuda.device_count(),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(index)
        device, backend = torch.device("cuda", index), "nccl"
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


def join(member, timeout_s: float, cuda: bool) -> DistEnv:
    """This member's process group in its plan's generation: built under the generation's own store prefix, so no key
    of a dead group's is ever read. One node: the local rank is the rank (launcher.py starts every member here)."""
    rank, world_size = member.plan.ranks[member.member], member.plan.world_size
    if cuda:
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not member.gather():
        from checkpoint.errors import GroupDown

        raise GroupDown(f"generation {member.generation} failed before its group was built")
    before = open_sockets()
    dist.init_process_group(backend=backend, store=dist.PrefixStore(member.prefix, member.store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if cuda else {}))
    _GROUP_SOCKETS.clear()
    _GROUP_SOCKETS.update(open_sockets() - before)  # gloo connects the full mesh as the group is made
    from checkpoint import knobs

    knobs.crash_in_recovery(member.plan.generation, rank)  # test-only: a second failure, during this recovery
    return DistEnv(rank, world_size, rank, device, backend, "pyrecover")


#: the sockets of this process's current group (gloo's connections to its peers), made by join
_GROUP_SOCKETS: set[str] = set()


def from_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure (a peer died or left its group), not this rank's own: gloo's and
    NCCL's errors, and a collective's timeout."""
    from checkpoint.errors import GroupDown

    if isinstance(error, (GroupDown, getattr(dist, "DistError", ()))):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Timed out"))


def failure_line(error: BaseException) -> str:
    """An error in one short line: a gloo error's source path and advice are cut ("Connection closed by peer
    [127.0.0.1]:45448")."""
    text = " ".join(str(error).split())
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically", 1)[0]
    return f"{type(error).__name__}: {text}"[:240]


def release_wrapper(model: torch.nn.Module) -> weakref.ref:
    """Before a broken group is torn down: DDP's gradient hooks off the parameters, so the module trains on under the
    next group's wrapper without the old one all-reducing into a dead group. Returns a weak reference to the wrapper,
    for ``leave`` once the caller has dropped its own."""
    reducer = getattr(model, "reducer", None)
    if reducer is not None and hasattr(reducer, "_remove_autograd_hooks"):
        reducer._remove_autograd_hooks()
    return weakref.ref(model)


def leave(env: DistEnv, wrapper: weakref.ref | None) -> None:
    """Leave this rank's broken process group: the released DDP wrapper (``release_wrapper``'s reference) is freed
    before the group goes -- by a full garbage collection only if a cycle still holds it, which costs 0.2-0.7 s here
    and is not needed once its hooks are off and the exception's frames are gone -- then ``abort``."""
    if wrapper is not None and wrapper() is not None:
        gc.collect()
    abort(env)


def abort(env: DistEnv) -> None:
    """Tear this rank's process group down after a peer failed, without another collective: its connections close,
    so a peer still blocked in a collective with it fails at once too. NCCL's communicators are aborted first (not
    run here: no GPU in the tests)."""
    if not (env.distributed and dist.is_initialized()):
        return
    if env.backend == "nccl":
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # torch versions differ; destroy below still frees the group
            pass
    else:  # destroying a gloo group leaves its connections open while the process lives (checkpoint/sockets.py)
        shut_down(_GROUP_SOCKETS)
        _GROUP_SOCKETS.clear()
    try:
        dist.destroy_process_group()
    except Exception:  # a group that failed half-way: nothing left to free
        pass


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


def _proc_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """`Key:   123 kB` lines of a /proc file (meminfo, self/status) -> {key: bytes}; missing keys are absent."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys and rest.split():
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _ranks_on_this_node(env: DistEnv) -> int:
    """How many ranks share this node's memory (CPU training: every rank is a process in the same RAM)."""
    if not env.distributed:
        return 1
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        m = re.match(r"\d+", os.environ.get(name, ""))  # SLURM: "2(x3)" = 2 tasks on each of 3 nodes
        if m and int(m.group()) > 0:
            return int(m.group())
    return env.world_size


def device_memory(env: DistEnv) -> tuple[int | None, str]:
    """Memory one rank can use on its device, in bytes (None: unknown), and where that figure comes from.

    CUDA: free memory of the rank's GPU (torch.cuda.mem_get_info). CPU: MemAvailable from /proc/meminfo (else total
    RAM from os.sysconf), capped by a cgroup v2 memory limit, divided among the ranks on this node.
    """
    if env.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(env.device)
        return int(free), f"GPU {env.device.index} ({torch.cuda.get_device_name(env.device)}) has free"
    avail = _proc_kib("/proc/meminfo", ("MemAvailable",)).get("MemAvailable")
    where = "MemAvailable"
    if avail is None:
        try:
            avail, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "total RAM"
        except (ValueError, OSError):
            return None, "unknown"
    try:  # a container's limit is lower than the machine's RAM
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                left = int(limit) - int(f.read())
            if left < avail:
                avail, where = left, "the cgroup memory limit leaves"
    except (OSError, ValueError):
        pass
    ranks = _ranks_on_this_node(env)
    if ranks > 1:
        return avail // ranks, f"CPU RAM ({where}) / {ranks} ranks on this node gives each"
    return avail, f"CPU RAM ({where}) has"


class PeakMemory:
    """Peak memory a rank's training adds over a baseline taken at construction (after imports and data loading).

    CUDA: torch.cuda.max_memory_allocated growth (the caching allocator's reserve excluded). CPU: growth of the
    process's anonymous memory: the kernel's resident-set high-water mark (VmHWM, reset here through
    /proc/self/clear_refs) minus file-backed pages (shared libraries, the memory-mapped token cache), compared with
    RssAnon at the baseline. Without clear_refs (non-Linux, locked-down kernels) the high-water mark may predate the
    baseline, so the figure is an upper bound.
    """

    def __init__(self, env: DistEnv, held: int = 0) -> None:
        """``held``: bytes of host memory already allocated that are training's own (a restart's checkpoint state,
        parsed ahead while the process set up): taken off the baseline, so the peak counts them as before."""
        self.device = env.device
        self.exact = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self._peak = self.baseline  # the highest peak seen before the last reset (``interval`` resets it)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5": reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        except OSError:
            self.exact = False
        self.baseline = max(0, _proc_kib("/proc/self/status", ("RssAnon",)).get("RssAnon", 0) - held)
        self._peak = self.baseline

    def peak_growth(self) -> int:
        """Bytes: the peak since the baseline minus the baseline (0 if nothing grew)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(0, max(self._peak, torch.cuda.max_memory_allocated(self.device)) - self.baseline)
        anon_peak, _ = self._host_peaks()
        return max(0, max(self._peak, anon_peak) - self.baseline)

    def _host_peaks(self) -> tuple[int, int]:
        """(anonymous, whole) resident-set peak in bytes since the last reset of VmHWM."""
        status = _proc_kib("/proc/self/status", ("VmHWM", "RssFile", "RssShmem"))
        if "VmHWM" not in status:
            import resource

            status["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            self.exact = False
        return status["VmHWM"] - status.get("RssFile", 0) - status.get("RssShmem", 0), status["VmHWM"]

    def interval(self) -> dict[str, int]:
        """The peaks since the last call (bytes), then a reset, for the per-step log (metrics.py); ``peak_growth``
        still sees the run's peak. CUDA: the caching allocator's allocated and reserved peaks (host-side counters:
        no synchronisation). CPU: the process's resident set peak (VmHWM: with the memory-mapped token pages it
        touched), reset through /proc/self/clear_refs; where that cannot be reset (``exact`` False) it is the
        process's lifetime peak."""
        if self.device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            self._peak = max(self._peak, allocated)
            torch.cuda.reset_peak_memory_stats(self.device)
            return {"peak_allocated": allocated, "peak_reserved": reserved}
        anon, whole = self._host_peaks()
        self._peak = max(self._peak, anon)
        if self.exact:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.exact = False
        return {"peak_rss": whole}

    def describe(self) -> str:
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated growth"
        return "peak anonymous RSS growth" + ("" if self.exact else " (upper bound: VmHWM could not be reset)")


def checkpoint_activations(model: torch.nn.Module, mode: str, every: int = 2) -> torch.nn.Module:
    """Activation checkpointing as a transform of the model (before parallelize): each block model.recomputed_layers
    names keeps only its input in the forward pass and runs its forward again in backward (torch.utils.checkpoint,
    non-reentrant). Only the block's ``forward`` attribute changes -- no wrapper module -- so parameter names, and with
    them checkpoints, are the same for every mode. FSDP2's per-block hooks stay around the recomputed forward: the
    block's all-gather in backward (its pre-backward hook) happens before the recompute needs the weights. The recompute
    restores the RNG state the forward saw and runs the same kernels on the same inputs: on CPU gradients are bitwise
    those of mode "none" (tests/test_activation_checkpointing.py), so the mode may change on resume."""
    from model import recomputed_layers

    for i in recomputed_layers(len(model.layers), mode, every):
        block = model.layers[i]
        block.forward = functools.partial(_recomputed, block.forward)  # the class's forward, bound to the block
    return model


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward, nothing to recompute
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def parallelize(model: torch.nn.Module, env: DistEnv, parallel: str, *, sync: bool = True) -> torch.nn.Module:
    """Data parallelism as a transform of the model: DDP (full replicas), or FSDP2 with every transformer block one
    all-gather / reduce-scatter unit, then the root (embeddings, norm, output). One process: the model unchanged.
    Activation checkpointing (checkpoint_activations) is applied first, so FSDP's unit is the recomputed block.
    ``sync=False``: DDP skips broadcasting rank 0's weights (every rank loads the same checkpoint next: after an
    in-process recovery that broadcast is the whole model, redone for nothing)."""
    if not env.distributed:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda"
                                                     else None,  # the device index, not local_rank: one GPU per task
                                                     init_sync=sync)


def mean_over_ranks(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (in place; identical on every rank)."""
    if env.distributed:
        dist.all_reduce(value)
        value /= env.world_size
    return value


def all_reduce_max(value: float, env: DistEnv) -> float:
    """Max of a scalar over ranks (used by stop/save decisions so all ranks agree)."""
    if not env.distributed:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_over_ranks(values: list[float], env: DistEnv) -> list[float]:
    """The sums of a few scalars over ranks, in float64 (e.g. an evaluation's loss sum and window count: the mean is
    exact whatever share each rank had). Identical on every rank."""
    if not env.distributed:
        return list(values)
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def first_error(error: str | None, env: DistEnv) -> str | None:
    """A barrier that carries one message: every rank passes its error (or None) and gets the lowest rank's."""
    if not env.distributed:
        return error
    errors: list = [None] * env.world_size
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


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
