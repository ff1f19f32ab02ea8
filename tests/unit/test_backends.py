"""The backends' capabilities and the one place refusals come from (checkpoint.backends.check_combination); the state
pieces' full / sharded modes. Fast: no training run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from checkpoint.backends import (CAPABILITIES, BACKENDS, backend_class, check_combination,  # noqa: E402
                                 combination_refusal)
from checkpoint.errors import CheckpointError  # noqa: E402
from checkpoint.state import ModelState, OptimizerState  # noqa: E402

DCP_HOW = "--checkpoint-backend dcp (or --use-torch-distributed-ckpt)"


def test_capabilities_table_is_the_classes_attributes():
    assert set(CAPABILITIES) == set(BACKENDS)
    for name in BACKENDS:
        cls = backend_class(name)
        assert cls.name == name and cls.capabilities() == CAPABILITIES[name]
        assert cls.read_section is not None
    assert [n for n, c in CAPABILITIES.items() if c.sharded] == ["dcp"]
    assert [n for n, c in CAPABILITIES.items() if c.remote_ok] == ["dcp"]


@pytest.mark.parametrize("name,kwargs,expected", [
    ("vanilla", {"sharded": True},
     f"--parallel fsdp shards the model over ranks; save it with {DCP_HOW}: the vanilla backend writes one full copy "
     "from rank 0 (convert a DCP checkpoint afterwards with `python -m checkpoint convert SRC DST --to vanilla`)"),
    ("concurrent", {"checkpoint_dir": "s3://bucket/x"},
     f"--checkpoint-dir s3://bucket/x is object storage: it needs {DCP_HOW}"),
    ("dcp", {"checkpoint_dir": "s3://bucket/x", "jit": True},
     "--jit-checkpoint writes to a local --checkpoint-dir; it does not support s3://"),
    ("vanilla", {"async_save": "thread"},
     f"--async-checkpoint is for {DCP_HOW}; the concurrent backend is always asynchronous"),
    ("concurrent", {"async_save": True},
     f"--async-checkpoint is for {DCP_HOW}; the concurrent backend is always asynchronous"),
    ("dcp", {"sharded": True, "jit": True},
     "--jit-checkpoint needs every rank to hold the full state (DDP); with sharded (FSDP) state no survivor can save "
     "it: drop --jit-checkpoint"),
    ("dcp", {"sharded": True, "checkpoint_dir": "s3://bucket/x", "async_save": "process"}, None),
    ("vanilla", {"checkpoint_dir": "/tmp/x", "jit": True}, None),
    ("concurrent", {}, None),
    # the node-local tier: the backend writes only there (whole files per rank), the drain copies to any medium
    ("dcp", {"local_tier": True},
     "--local-checkpoint-dir works with --checkpoint-backend vanilla or --checkpoint-backend concurrent; the dcp "
     "backend writes one collective metadata file that no node holds alone"),
    ("concurrent", {"checkpoint_dir": "s3://bucket/x", "local_tier": True}, None),
    ("vanilla", {"checkpoint_dir": "s3://bucket/x", "local_tier": True, "jit": True},
     "--jit-checkpoint writes to a local --checkpoint-dir; it does not support s3://"),
])
def test_refusals_are_derived_from_capabilities(name, kwargs, expected, train_spelling):
    assert combination_refusal(name, **kwargs) == expected
    if expected is None:
        check_combination(name, **kwargs)
    else:
        with pytest.raises(CheckpointError, match="^" + expected[:30].replace("(", r"\(")):
            check_combination(name, **kwargs)


def test_refusals_import_no_backend_module():
    code = ("import sys, checkpoint; from checkpoint.backends import check_combination, capabilities; "
            "check_combination('dcp', sharded=True, checkpoint_dir='s3://b/x', async_save=True); capabilities('dcp'); "
            "import checkpoint.reader, checkpoint.convert; "
            "bad = [m for m in sys.modules if m.startswith(('torch.distributed.checkpoint', 'checkpoint.backends.dcp'))"
            " and m != 'torch.distributed.checkpoint.state_dict']; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_full_and_sharded_pieces_have_the_same_keys():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    full, sharded = ModelState(model), ModelState(model, sharded=True)
    assert not full.sharded and sharded.sharded
    a, b = full.state_dict(), sharded.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = OptimizerState(model, opt).state_dict(), OptimizerState(model, opt, sharded=True).state_dict()
    assert list(oa["state"]) == list(ob["state"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert oa["param_groups"] == ob["param_groups"]
    sharded.load_state_dict(a)  # either mode loads the other's
    OptimizerState(model, opt, sharded=True).load_state_dict(oa)


def test_convert_imports_no_private_name():
    tree = ast.parse((ROOT / "checkpoint" / "convert.py").read_text())
    private = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names
               if a.name.startswith("_")]
    assert not private
