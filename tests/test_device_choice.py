"""Which CUDA device a rank uses (distributed.cuda_device_index), and that distributed.init uses it.

The rule is a pure function, tested on its own. init's use of it needs CUDA, which this CPU machine does not have: there
torch.cuda.is_available / device_count / set_device and the NCCL process-group start are replaced by stand-ins that
report N visible GPUs and record the calls -- the one place in the suite where a fake is the only way to run the code
(the launch environment, LOCAL_RANK / LOCAL_WORLD_SIZE / CUDA_VISIBLE_DEVICES, is real).
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT))
import distributed  # noqa: E402
from distributed import LaunchError, cuda_device_index  # noqa: E402


@pytest.mark.parametrize("local_rank, local_world, visible, expected", [
    (0, 1, 1, 0),
    (0, 4, 4, 0), (3, 4, 4, 3),  # torchrun / srun with every GPU visible to every task: the rank's own
    (1, 2, 8, 1),                # more GPUs than ranks: still the rank's own
    (0, 4, 1, 0), (3, 4, 1, 0),  # srun --gpus-per-task=1 / --gpu-bind: each task sees only its GPU, index 0
])
def test_device_index_rule(local_rank, local_world, visible, expected):
    assert cuda_device_index(local_rank, local_world, visible, "0,1,2,3") == expected


@pytest.mark.parametrize("local_rank, local_world, visible", [(3, 4, 2), (1, 4, 2), (2, 3, 2)])
def test_fewer_gpus_than_ranks_is_refused_in_one_line(local_rank, local_world, visible):
    """Several GPUs visible but fewer than the node's ranks: two ranks would share a GPU (or one would name a device
    that is not there). Refused, naming CUDA_VISIBLE_DEVICES, LOCAL_RANK and the count."""
    with pytest.raises(LaunchError) as e:
        cuda_device_index(local_rank, local_world, visible, "2,3")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"LOCAL_RANK {local_rank}" in msg and f"{visible} CUDA device(s)" in msg
    assert "CUDA_VISIBLE_DEVICES '2,3'" in msg and "--gpus-per-task=1" in msg
    with pytest.raises(LaunchError, match="CUDA_VISIBLE_DEVICES unset"):
        cuda_device_index(local_rank, local_world, visible, None)


class FakeCuda:
    """Stand-in for torch.cuda (no GPU here): ``visible`` devices, records set_device and the process-group start."""

    def __init__(self, monkeypatch, visible: int):
        self.set_to, self.pg = [], {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_to.append)
        monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: self.pg.update(kw))


def _launch(monkeypatch, *, rank: int, local_rank: int, local_world: int, visible_env: str | None):
    for name, value in {"RANK": rank, "WORLD_SIZE": local_world, "LOCAL_RANK": local_rank,
                        "LOCAL_WORLD_SIZE": local_world}.items():
        monkeypatch.setenv(name, str(value))
    if visible_env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_env)


def test_init_one_gpu_per_task_uses_device_0(monkeypatch):
    """Rank 1 of 2 on a node with --gpus-per-task=1: it sees one GPU; before the fix it asked for cuda:1 and failed
    with 'invalid device ordinal'."""
    fake = FakeCuda(monkeypatch, visible=1)
    _launch(monkeypatch, rank=1, local_rank=1, local_world=2, visible_env="1")
    env = distributed.init(True)
    assert fake.set_to == [0] and env.device == torch.device("cuda", 0)
    assert (env.rank, env.local_rank, env.backend) == (1, 1, "nccl")
    assert fake.pg["device_id"] == torch.device("cuda", 0) and fake.pg["backend"] == "nccl"


def test_init_all_gpus_visible_uses_local_rank(monkeypatch):
    fake = FakeCuda(monkeypatch, visible=4)
    _launch(monkeypatch, rank=3, local_rank=3, local_world=4, visible_env=None)
    env = distributed.init(True)
    assert fake.set_to == [3] and env.device == torch.device("cuda", 3)


def test_init_refuses_two_gpus_for_four_ranks(monkeypatch):
    fake = FakeCuda(monkeypatch, visible=2)
    _launch(monkeypatch, rank=2, local_rank=2, local_world=4, visible_env="0,1")
    with pytest.raises(LaunchError, match="LOCAL_RANK 2 of 4 ranks on this node sees 2 CUDA device"):
        distributed.init(True)
    assert fake.set_to == [] and fake.pg == {}  # refused before touching a device or the process group
