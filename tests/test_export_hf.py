"""`python hf.py export SRC OUT --to hf` end to end: tiny runs trained through the real CLI (1 process vanilla;
2 ranks FSDP with the dcp backend under torchrun), exported, then loaded by a real client,
`transformers.LlamaForCausalLM.from_pretrained(OUT)` on CPU in fp32, whose logits on a fixed batch must match our
model.Transformer loaded from the same checkpoint: the same argmax everywhere, max |difference| <= LOGIT_TOLERANCE.

The reference model is loaded without checkpoint/reader.py (torch.load of model.pt; DCP's own load into the model's
state dict), so the export's reassembly of FSDP shards is checked against DCP, not against itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PY, ROOT, TINY, env_for_tests, optional_module, require, run_torchrun, run_train

sys.path.insert(0, str(ROOT))
from checkpoint import layout  # noqa: E402
from hf import saved_model  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

transformers = optional_module("transformers")

# fp32 on both sides runs the same operations in the same order (measured max |difference|: 0.0). The one mistake
# this export could plausibly make, q/k rows in the interleaved-pairs RoPE order instead of rotate-half, moves
# these logits by ~6e-3, far above the tolerance.
LOGIT_TOLERANCE = 1e-5
STEPS = 4


@pytest.fixture(autouse=True)
def _needs_transformers():
    require(transformers, "transformers")


def _train_args(corpus: str, ckdir: Path, *extra: str) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(STEPS),
                   "--checkpoint-dir", str(ckdir), *extra]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, Path]:
    """Experiment folders of two tiny runs: 1 process vanilla, 2 ranks FSDP + dcp."""
    vanilla = tmp_path_factory.mktemp("export-vanilla")
    run_train(_train_args(corpus, vanilla), check=True)
    fsdp = tmp_path_factory.mktemp("export-fsdp")
    run_torchrun(2, _train_args(corpus, fsdp, "--parallel", "fsdp", "--checkpoint-backend", "dcp"), check=True)
    return {"vanilla": vanilla / "default", "fsdp": fsdp / "default"}


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "hf.py"), "export", *map(str, args)], capture_output=True, text=True,
                          timeout=180, env=env_for_tests(), cwd=ROOT)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    return proc


def _refused(proc: subprocess.CompletedProcess, text: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], \
        proc.stdout + proc.stderr


def our_model(step_dir: Path) -> Transformer:
    """model.Transformer with the checkpoint's weights, read the way torch and DCP read them."""
    info = torch.load(step_dir / "run_info.pt", weights_only=True)
    model = Transformer(ModelConfig(**json.loads(info["config_json"])["model_config"]))
    if (step_dir / "model.pt").exists():
        model.load_state_dict(torch.load(step_dir / "model.pt", weights_only=True))
    else:
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
        model.load_state_dict(state["model"])
    return model.eval()


def assert_same_logits(step_dir: Path, out: Path) -> None:
    ours = our_model(step_dir)
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = torch.randint(0, ours.config.vocab_size, (3, ours.config.max_seq_len),
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(batch), theirs(batch).logits
    assert a.shape == b.shape
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max().item() <= LOGIT_TOLERANCE


def test_vanilla_export_loads_in_transformers_with_the_same_logits_and_tokens(runs, tmp_path):
    out = tmp_path / "hf"
    proc = _ok(export(runs["vanilla"], out, "--to", "hf"))  # the experiment folder: its latest
    assert "model.safetensors (tiny, 4.19M parameters, float32)" in proc.stdout
    step_dir = runs["vanilla"] / f"step-{STEPS:08d}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["tie_word_embeddings"]) == \
        (["LlamaForCausalLM"], "llama", False)
    assert_same_logits(step_dir, out)

    # The tokenizer: the training tokenizer's ids (no BOS/EOS added), and its text back.
    import tokenizer as ours

    text = "ROMEO.\n  But soft, what light through yonder window breaks?\n\n1 Kings 3:9 -- café 日本 🙂"
    hf = transformers.AutoTokenizer.from_pretrained(out)
    ids = ours.load_tokenizer(ours.DEFAULT_TOKENIZER).encode_batch([text])[0]
    assert hf(text)["input_ids"] == ids
    assert hf.decode(ids) == text
    assert (hf.eos_token_id, config["eos_token_id"]) == (2, 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's own load, in this one process
def test_fsdp_dcp_export_reassembles_the_shards_into_several_safetensors_files(runs, tmp_path):
    out = tmp_path / "hf"
    step_dir = runs["fsdp"] / f"step-{STEPS:08d}"
    _ok(export(step_dir, out, "--to", "hf", "--max-shard-size", "3MB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]  # embeddings | blocks + norm | head
    assert sorted(set(index["weight_map"].values())) == files and len(index["weight_map"]) == 21
    assert index["metadata"]["total_size"] == 4_194_624 * 4  # tiny at vocab 32000, fp32
    assert_same_logits(step_dir, out)


def test_refusals_are_one_line_and_force_replaces_only_an_export(runs, tmp_path):
    src = runs["vanilla"]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _refused(export(src, out, "--to", "hf"), "is not empty")
    assert (out / "notes.txt").read_text() == "mine"

    uncommitted = tmp_path / "uncommitted" / f"step-{STEPS:08d}"
    shutil.copytree(src / f"step-{STEPS:08d}", uncommitted)
    (uncommitted / "COMMITTED").unlink()
    _refused(export(uncommitted, tmp_path / "x", "--to", "hf"), "not committed")
    _refused(export(src, tmp_path / "x", "--to", "hf", "--max-shard-size", "lots"), "is not a size")
    _refused(export(src, src, "--to", "hf", "--force"), "holds checkpoints")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))

    _refused(export(src, out, "--to", "hf", "--force"), "is not an earlier export")  # someone's folder stays
    assert (out / "notes.txt").read_text() == "mine"

    again = tmp_path / "hf-again"
    _ok(export(src, again, "--to", "hf"))
    _ok(export(src, again, "--to", "hf", "--force", "--dtype", "bfloat16"))  # replaces an earlier export
    assert not list(tmp_path.glob(".hf-again.*"))
    assert json.loads((again / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_the_model_shape_comes_from_the_card_when_there_is_one_else_from_run_info(runs):
    step_dir = runs["vanilla"] / f"step-{STEPS:08d}"
    manifest = layout.verify(step_dir)
    from_run_info = saved_model(step_dir, dict(manifest, meta={}))
    assert (from_run_info.config["dim"], from_run_info.preset, from_run_info.tokenizer) == (64, "tiny", "mistral-sp-32k")
    card = {"model": {"preset": "card-preset", "config": dict(from_run_info.config, n_layers=3)}}
    from_card = saved_model(step_dir, dict(manifest, meta={"card": card}))
    assert (from_card.config["n_layers"], from_card.preset) == (3, "card-preset")
