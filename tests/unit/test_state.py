"""A plain model's (single process, DDP) state dicts are built without torch.distributed.checkpoint, whose import
costs about a second of every start: they must be exactly what DCP's helpers return (same keys, order, containers and
tensors), so a checkpoint's bytes do not depend on which path made them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import PY, ROOT, assert_same_tree  # noqa: E402

sys.path.insert(0, str(ROOT))
from checkpoint.state import ModelState, OptimizerState  # noqa: E402
from model import Transformer, get_config  # noqa: E402


def trained(tie: bool, groups: bool):
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(get_config("tiny", vocab_size=512, max_seq_len=16), tie_embeddings=tie))
    params = list(model.named_parameters())
    if groups:  # weight decay on matrices only, as many recipes do: two groups, names interleaved across them
        param_groups = [{"params": [p for n, p in params if p.ndim > 1], "weight_decay": 0.1},
                        {"params": [p for n, p in params if p.ndim <= 1], "weight_decay": 0.0}]
    else:
        param_groups = [p for _, p in params]
    opt = torch.optim.AdamW(param_groups, lr=1e-3)
    for _ in range(2):
        loss = model(torch.randint(0, 512, (2, 8))).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("tie,groups", [(False, False), (True, False), (False, True)])
def test_plain_state_dicts_equal_dcps(tie, groups):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    model, opt = trained(tie, groups)
    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    assert_same_tree(ModelState(model).state_dict(), get_model_state_dict(model, options=full), "model",
                     exact_containers=True)
    assert_same_tree(OptimizerState(model, opt).state_dict(), get_optimizer_state_dict(model, opt, options=full),
                     "optimizer", exact_containers=True)


def test_a_fresh_optimizer_still_goes_through_dcp():
    torch.manual_seed(0)
    model = Transformer(get_config("tiny", vocab_size=512, max_seq_len=16))
    opt = torch.optim.AdamW(model.parameters())
    assert OptimizerState(model, opt).state_dict()["state"]  # DCP's helper made the state a save needs


def test_a_plain_round_trip_never_imports_dcp():
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests' / 'unit')!r})
from test_state import trained
from checkpoint.state import ModelState, OptimizerState
model, opt = trained(False, True)
m, o = ModelState(model).state_dict(), OptimizerState(model, opt).state_dict()
model2, opt2 = trained(True, True)
ModelState(model).load_state_dict(m)
OptimizerState(model, opt).load_state_dict(o)
loaded = [k for k in sys.modules if k.startswith("torch.distributed.checkpoint")]
assert not loaded, loaded
"""
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
