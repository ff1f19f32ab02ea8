"""WHAT a checkpoint holds: named pieces, each behind the Stateful protocol (``state_dict`` / ``load_state_dict``).

Keys (as in torchtitan): model, optimizer, lr_scheduler, grad_scaler, dataloader, train_state, rng, run_info.
``rng`` and ``dataloader`` are per rank (each rank saves its own); everything else is identical on all ranks of a
data-parallel job and is saved once. Every value is made of tensors, numbers, strings, lists and dicts only, so a
checkpoint loads with ``torch.load(weights_only=True)`` and loading a stranger's checkpoint cannot run code.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .backend_table import capabilities  # names and capabilities only: no backend module is imported
from .errors import CheckpointError
from .naming import setting

# torch.distributed.checkpoint's state_dict helpers (FSDP2, DTensor) are imported where they are used: importing them
# costs ~1 s of every start, and a plain model (single process, DDP) needs them neither to save nor to resume.

PER_RANK_KEYS = ("rng", "dataloader")
#: the sections that hold tensors (sharded under FSDP, resharded by DCP, exported, converted); the rest is small
TENSOR_SECTIONS = ("model", "optimizer")


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP (`.module`) and torch.compile (`._orig_mod`) wrappers so checkpoint keys never carry their prefixes
    and a checkpoint moves freely between single-process, DDP and compiled runs."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


class ModelState:
    """Model weights keyed by fully-qualified parameter name, without wrapper prefixes.

    Goes through torch.distributed.checkpoint's state_dict helpers, which handle DDP, torch.compile and FSDP2 alike.
    Two modes, chosen by what the backend saves (its ``sharded`` class attribute, backends/base.py):

    ``sharded=False`` (full): an FSDP model's shards are gathered into whole tensors (rank 0 gets them on CPU) -- one
        full copy, written once by rank 0 (vanilla, concurrent).
    ``sharded=True``: each rank's FSDP shard as a DTensor (plain tensors for DDP), every rank saving its own share
        (dcp). Loading full tensors (a vanilla checkpoint, which every rank reads whole) into a sharded model scatters
        them into the shards, so a vanilla checkpoint resumes an FSDP run without conversion.

    The keys are the same in both modes (and a plain model's tensors too): only where the bytes of a sharded model
    come from differs.
    """

    def __init__(self, model: torch.nn.Module, sharded: bool = False):
        self.wrapped = model
        self.model = unwrap_model(model)
        self.sharded = bool(sharded)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if _is_plain(self.model):  # what DCP's helper returns for it: torch's own state_dict, in fresh containers
            return dict(self.model.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = not self.sharded
        options = StateDictOptions(full_state_dict=full, cpu_offload=full and _is_fsdp(self.model))
        return get_model_state_dict(self.model, options=options)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        if _is_plain(self.model):  # nothing sharded: torch's own load copies the same values into the same parameters
            check_compatible(self.model.state_dict(), state_dict)
            self.model.load_state_dict(state_dict, strict=True)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        check_compatible(self.state_dict(), state_dict)
        full = _loads_full(self.sharded, self.model, state_dict)
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(full_state_dict=full, strict=True))


class OptimizerState:
    """AdamW moments and step counts, keyed by parameter NAME (not by position), so they survive resharding and
    format conversion. DCP's helpers restore *all* state: loading into a fresh optimizer keeps the moments.
    ``sharded``: as for :class:`ModelState` (full tensors load into a sharded model too)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool = False):
        self.model = unwrap_model(model)
        self.optimizer = optimizer
        self.sharded = bool(sharded)

    def state_dict(self) -> dict[str, Any]:
        named = _by_name(self.model, self.optimizer) if _is_plain(self.model) else None
        if named is not None:
            return named
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = not self.sharded
        options = StateDictOptions(full_state_dict=full, cpu_offload=full and _is_fsdp(self.model))
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        native = _by_position(self.model, self.optimizer, state_dict) if _is_plain(self.model) else None
        if native is not None:
            self.optimizer.load_state_dict(native)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = _loads_full(self.sharded, self.model, state_dict)
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=StateDictOptions(full_state_dict=full))


def _loads_full(sharded: bool, model: torch.nn.Module, state_dict: dict[str, Any]) -> bool:
    """Whether ``state_dict`` is applied as full tensors: always in full mode; in sharded mode when the model holds
    DTensors (FSDP) but the state dict has none (a full-tensor checkpoint, e.g. vanilla, resuming a sharded run)."""
    return not sharded or (holds_dtensors(model) and not _has_dtensor(state_dict))


def holds_dtensors(model: torch.nn.Module) -> bool:
    """Some parameter is a DTensor (FSDP2): full and sharded state dicts of this model differ."""
    from torch.distributed.tensor import DTensor  # imported with torch._dynamo, which torch.optim imports: no cost

    return any(isinstance(p, DTensor) for p in model.parameters())


def _has_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    def walk(o: Any) -> bool:
        return isinstance(o, DTensor) or (isinstance(o, dict) and any(walk(v) for v in o.values()))

    return walk(obj)


def _is_plain(model: torch.nn.Module) -> bool:
    """No FSDP, no DTensor: every parameter is a whole, ordinary tensor."""
    return not _is_fsdp(model) and not holds_dtensors(model)


def _by_position(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict | None:
    """The name-keyed optimizer state (DCP's layout, which survives resharding) in torch's positional layout, for
    ``optimizer.load_state_dict``. DCP's ``set_optimizer_state_dict`` would first run a whole optimizer step on zero
    gradients to create the state it then overwrites (~half a second of every restart here). None when the names do
    not line up one to one (then DCP's helper decides, and explains)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups, state, index = [], {}, 0
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        return None
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        fqns = [names.get(id(p)) for p in group["params"]]
        if fqns != list(saved_group.get("params", [])):
            return None
        positions = list(range(index, index + len(fqns)))
        for i, fqn in zip(positions, fqns):
            if fqn in saved["state"]:
                state[i] = saved["state"][fqn]
        groups.append({**saved_group, "params": positions})
        index += len(fqns)
    return {"state": state, "param_groups": groups}


def _by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """A plain model's optimizer state keyed by parameter name, as DCP's ``get_optimizer_state_dict`` returns it (the
    same keys, order and tensors: tests/unit/test_state.py), without importing DCP. None before the first step, whose
    missing state DCP's helper creates by a zero-gradient step (then it decides)."""
    if not optimizer.state:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    packed = optimizer.state_dict()
    by_position = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    if None in by_position:
        return None
    state = {by_position[i]: dict(v) for i, v in packed["state"].items()}
    groups = [{**g, "params": [by_position[i] for i in g["params"]]} for g in packed["param_groups"]]
    return {"state": state, "param_groups": groups}


def _is_fsdp(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())


def check_compatible(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> None:
    """One clear line naming the first mismatched tensor, instead of PyTorch's wall of size-mismatch messages."""
    for key, tensor in expected.items():  # shapes first: they say most about *which* config it was saved with
        got = found.get(key)
        if got is not None and tuple(got.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint does not fit this model: tensor {key!r} has shape {list(got.shape)} in the checkpoint "
                f"but {list(tensor.shape)} in this model; use the {setting('model')} preset and tokenizer it was saved "
                "with"
            )
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise CheckpointError(
            f"checkpoint does not fit this model: {what} ({len(missing)} missing, {len(extra)} unexpected tensors); "
            f"was it saved with another {setting('model')} preset or tokenizer?"
        )


@dataclass
class TrainState:
    """Loop counters. ``restarts`` counts resumes; it is what a loss CSV row's restart column shows."""

    step: int = 0
    tokens_seen: int = 0
    restarts: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k, v in state_dict.items():
            setattr(self, k, v)


class RNGState:
    """This rank's generators: Python, NumPy, torch CPU and (when present) CUDA. Converted to tensors and plain
    lists so the file stays loadable with weights_only=True."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        sd = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {
                "name": np_name,
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "gauss": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        py = state_dict["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        npy = state_dict["numpy"]
        np.random.set_state(
            (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
        )
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


@dataclass
class RunInfo:
    """The run's configuration and versions, stored so a mismatch on resume can be explained, not guessed."""

    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    world_size: int = 1

    def state_dict(self) -> dict[str, Any]:
        return {"config_json": json.dumps(self.config, sort_keys=True, default=str),
                "versions": {str(k): str(v) for k, v in self.versions.items()}, "world_size": int(self.world_size)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The *current* run's info is kept; the saved one is only compared.
        self.saved = {"config": json.loads(state_dict["config_json"]), "versions": state_dict["versions"],
                      "world_size": state_dict["world_size"]}

    def differences(self, keys: tuple[str, ...]) -> list[str]:
        saved = getattr(self, "saved", None)
        if saved is None:
            return []
        out = [f"{k}: checkpoint {saved['config'].get(k)!r}, now {self.config.get(k)!r}" for k in keys
               if saved["config"].get(k) != self.config.get(k)]
        if saved["world_size"] != self.world_size:
            out.append(f"world size: checkpoint {saved['world_size']}, now {self.world_size}")
        if saved["versions"].get("torch") != self.versions.get("torch"):
            out.append(f"torch: checkpoint {saved['versions'].get('torch')}, now {self.versions.get('torch')}")
        return out


class CheckpointState(dict):
    """Name -> Stateful. The split into shared and per-rank pieces is decided here, once, for every backend."""

    def shared(self) -> dict[str, Stateful]:
        return {k: v for k, v in self.items() if k not in PER_RANK_KEYS}

    def per_rank(self) -> dict[str, Stateful]:
        return {k: v for k, v in self.items() if k in PER_RANK_KEYS}


    @classmethod
    def for_training(cls, *, config: dict[str, Any], versions: dict[str, str], world_size: int,
                     model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Stateful,
                     dataloader: Stateful, train_state: TrainState, backend: str,
                     grad_scaler: Stateful | None = None) -> CheckpointState:
        """A training loop's state: the run's ``config`` and ``versions`` first (a load that fails on another model is
        then explained by the saved flags: ``state["run_info"]``), the model and optimizer as ``backend`` saves them
        (a sharded format: each rank its FSDP shards), the schedule, the data position, the counters, this rank's RNG
        streams, and an enabled gradient scaler (fp16)."""
        sharded = capabilities(backend).sharded
        state = cls(run_info=RunInfo(config=config, versions=versions, world_size=world_size),
                    model=ModelState(model, sharded=sharded), optimizer=OptimizerState(model, optimizer, sharded=sharded),
                    lr_scheduler=lr_scheduler, dataloader=dataloader, train_state=train_state, rng=RNGState())
        if grad_scaler is not None and grad_scaler.is_enabled():
            state["grad_scaler"] = grad_scaler
        return state
