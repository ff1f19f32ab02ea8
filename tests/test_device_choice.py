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


# --- --device and --model-dtype auto (distributed.choose_device / resolve_dtype) -----------------------------------------

SLURM_JOB = {"SLURM_JOB_ID": "7"}


@pytest.mark.parametrize("environ, shown", [
    ({}, None),
    ({"SLURM_GPUS_ON_NODE": "4"}, None),  # not a SLURM job: a stale variable allocates nothing
    ({"CUDA_VISIBLE_DEVICES": "0"}, None),
    ({**SLURM_JOB, "SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
    ({**SLURM_JOB, "SLURM_GPUS_ON_NODE": "0"}, None),
    ({**SLURM_JOB, "CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1"),
    ({**SLURM_JOB, "CUDA_VISIBLE_DEVICES": ""}, None), ({**SLURM_JOB, "CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({**SLURM_JOB, "CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),  # what SLURM sets when a job has no GPUs
])
def test_gpus_allocated_reads_the_slurm_variables(environ, shown):
    assert distributed.gpus_allocated(environ) == shown


def test_choose_device_rule():
    assert distributed.choose_device("auto", {}, cuda=True) == "cuda"
    assert distributed.choose_device("auto", {}, cuda=False) == "cpu"
    assert distributed.choose_device("cpu", {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "4"}, cuda=True) == "cpu"
    assert distributed.choose_device("cuda", {}, cuda=True) == "cuda"
    for requested, environ, needle in [("cuda", {}, "--device cuda, but torch.cuda.is_available() is False"),
                                       ("auto", {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "2"}, "SLURM_GPUS_ON_NODE=2")]:
        with pytest.raises(LaunchError) as e:
            distributed.choose_device(requested, environ, cuda=False)
        assert "\n" not in str(e.value) and needle in str(e.value) and "--device cpu" in str(e.value), str(e.value)


def test_model_dtype_auto_is_bf16_on_a_gpu_with_it_and_fp32_otherwise():
    assert distributed.resolve_dtype("auto", "cpu") == "fp32"
    assert distributed.resolve_dtype("auto", "cuda", bf16_ok=True) == "bf16"
    assert distributed.resolve_dtype("auto", "cuda", bf16_ok=False) == "fp32"
    assert distributed.resolve_dtype("fp16", "cuda", bf16_ok=True) == "fp16"  # given: unchanged


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch cannot use CUDA")
def test_no_cuda_is_one_line_through_the_cli(tmp_path):
    """--device cuda without CUDA, and a SLURM job given GPUs (simulated by its variables) whose torch cannot use them:
    one line each, exit 2, before any training (nothing written)."""
    from helpers import TINY, run_train

    base = TINY + ["--training-steps", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    cuda = run_train(base + ["--device", "cuda"])
    slurm = run_train(base, env={"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "4"})
    for proc, needle in [(cuda, "error: --device cuda, but torch.cuda.is_available() is False"),
                         (slurm, "error: this SLURM job has GPUs (SLURM_GPUS_ON_NODE=4), but torch.cuda.is_available() "
                                 "is False")]:
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith(needle), proc.stderr
        if torch.version.cuda is None:
            assert "CPU-only build (torch.version.cuda is None)" in proc.stderr, proc.stderr
    assert not (tmp_path / "ck").exists()


# --- MFU: the peak of the dtype in use, GPU names matched whole (metrics.peak_flops) -------------------------------------

@pytest.mark.parametrize("name, model", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA GH200 144G HBM3e", "GH200"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A10", "A10"),
    ("NVIDIA B200", "B200"), ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"), ("  NVIDIA  H200 ", "H200 SXM"),
    # substrings of a known name are not that GPU: no MFU rather than a wrong one
    ("NVIDIA A10G", None), ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None), ("Tesla V100-SXM2-32GB", None),
    ("NVIDIA GeForce RTX 4090", None), ("", None),
])
def test_gpu_names_map_to_the_datasheet_model(name, model):
    from metrics import gpu_model

    assert gpu_model(name) == model


def test_peak_flops_is_the_dtype_in_use():
    from metrics import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == peak_flops("NVIDIA H100 80GB HBM3", "fp16") == 989.5e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops("NVIDIA H200", "fp64") is None and peak_flops("NVIDIA A10G", "bf16") is None
