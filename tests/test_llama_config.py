"""Any Llama shape in, Hugging Face weights in and out, and the optimizer flags, through the real CLI:

* `--model CONFIG.json` (a transformers Llama config: GQA, its own intermediate size, RoPE theta, norm eps, tied or
  untied embeddings) trains, exports with `python hf.py export --to hf`, and transformers'
  LlamaForCausalLM loads the export with our logits;
* `--init-from DIR` starts from an export of ours, or from a model transformers made, with exactly its weights;
* `--gradient-accumulation-steps 4 --batch-size 2` killed mid-run and resumed equals the uninterrupted run bitwise;
* bad input (an unsupported config, mismatched, integer or NaN weights, a changed optimizer flag on resume): one
  line, exit 2.

Runs are shared between assertions and started two at a time (2 cores, one thread each) to stay near a minute.

Seeing --init-from's weights in a checkpoint needs a step: the runs that check them take one step at --learning-rate
1e-30 with --weight-decay 0. AdamW moves a weight by at most lr (|m / (sqrt(v) + eps)| <= 1 on the first step), and
1e-30 is below half an ulp of every weight these models hold (|w| > 1e-22: RMSNorm weights are 1, the others drawn
from N(0, 0.02)), so the saved weights are the loaded ones bitwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (PY, ROOT, check_weights, csv_rows, env_for_tests, kill_run_at_row, loss_rows,
                     optional_module, require, start_train)

sys.path.insert(0, str(ROOT))
from hf import hf_names  # noqa: E402
from checkpoint.reader import read_section  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

transformers = optional_module("transformers")

# Both sides compute in fp32 with the same operations in the same order (embedding, RMSNorm, rotate-half RoPE, SDPA,
# SwiGLU): measured max |difference| 0.0 on torch's CPU kernels. The tolerance leaves room for a transformers release
# that reorders a reduction (RMSNorm's mean, its own attention path instead of SDPA), a few float32 ulps; a mapping
# mistake (w1/w3 swapped, q/k permuted, a tied head read as untied) moves logits by 1e-3 or more.
LOGIT_TOLERANCE = 1e-5
STEPS = 4
SEQ = 32
VOCAB = 32000  # mistral-sp-32k, the default tokenizer


def llama_config(**over) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
              "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_theta": 50000.0, "rms_norm_eps": 1e-6,
              "hidden_act": "silu", "tie_word_embeddings": True}
    return config | over


def base(corpus: str, ckdir: Path, *extra: str) -> list[str]:
    return ["--dataset", corpus, "--sequence-length", str(SEQ), "--batch-size", "2", "--lr-warmup-steps", "2",
            "--logging-frequency", "1", "--checkpoint-dir", str(ckdir), "--log-loss-to-csv", *extra]


def finish(*procs: subprocess.Popen, timeout: float = 240) -> list[tuple[int, str, str]]:
    """Wait for runs started together; (exit code, stdout, stderr) each."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


def ok(result: tuple[int, str, str]) -> str:
    rc, stdout, stderr = result
    assert rc == 0, f"exit {rc}\nSTDOUT:\n{stdout[-3000:]}\nSTDERR:\n{stderr[-3000:]}"
    assert "Traceback" not in stdout + stderr
    return stdout


def refused(result: tuple[int, str, str], *says: str) -> str:
    rc, stdout, stderr = result
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, stdout[-2000:], stderr[-3000:])
    assert "Traceback" not in stdout + stderr
    assert all(s in lines[0] for s in says), lines[0]
    return lines[0]


def export(src: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([PY, str(ROOT / "hf.py"), "export", str(src), str(out), "--to", "hf"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_tests(), cwd=ROOT)


@pytest.fixture(autouse=True)
def _needs_transformers():
    require(transformers, "transformers")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> dict[str, dict]:
    """Two runs from a config.json (tied and untied embeddings), STEPS steps each, and their exports."""
    root = tmp_path_factory.mktemp("llama-config")
    runs = {}
    for tied in (True, False):
        name = "tied" if tied else "untied"
        config = root / f"{name}.json"
        config.write_text(json.dumps(llama_config(tie_word_embeddings=tied)))
        runs[name] = {"config": config, "ckdir": root / f"ck-{name}", "hf": root / f"hf-{name}"}
    procs = [start_train(base(corpus, r["ckdir"], "--model", str(r["config"]), "--training-steps", str(STEPS),
                              "--checkpoint-frequency", str(STEPS))) for r in runs.values()]
    for r, result in zip(runs.values(), finish(*procs)):
        r["stdout"] = ok(result)
        r["step_dir"] = r["ckdir"] / "default" / f"step-{STEPS:08d}"
    for result in finish(*[export(r["ckdir"] / "default", r["hf"]) for r in runs.values()]):
        ok(result)
    return runs


def our_model(step_dir: Path) -> Transformer:
    info = torch.load(step_dir / "run_info.pt", weights_only=True)
    model = Transformer(ModelConfig(**json.loads(info["config_json"])["model_config"]))
    model.load_state_dict(torch.load(step_dir / "model.pt", weights_only=True))
    return model.eval()


def test_a_config_json_model_trains_exports_and_loads_in_transformers_with_our_logits(trained):
    for name, run in trained.items():
        tied = name == "tied"
        assert f"model {run['config']}: " in run["stdout"]
        ours = our_model(run["step_dir"])
        c = ours.config
        assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, c.rope_theta, c.norm_eps,
                c.tie_embeddings) == (64, 2, 4, 2, 176, VOCAB, 50000.0, 1e-6, tied)
        assert (ours.output.weight is ours.tok_embeddings.weight) == tied
        exported = json.loads((run["hf"] / "config.json").read_text())
        assert (exported["tie_word_embeddings"], exported["intermediate_size"], exported["num_key_value_heads"],
                exported["rope_theta"], exported["rms_norm_eps"]) == (tied, 176, 2, 50000.0, 1e-6)
        from safetensors import safe_open

        with safe_open(run["hf"] / "model.safetensors", "pt") as f:
            assert ("lm_head.weight" in f.keys()) != tied  # transformers' own layout for tied embeddings
        theirs = transformers.LlamaForCausalLM.from_pretrained(run["hf"], dtype=torch.float32).eval()
        assert (theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()) == tied
        batch = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            a, b = ours(batch), theirs(batch).logits
        assert a.shape == b.shape == (3, SEQ, VOCAB)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), name
        assert (a - b).abs().max().item() <= LOGIT_TOLERANCE, name


def test_init_from_an_export_or_a_transformers_model_loads_its_weights_bitwise(trained, corpus, tmp_path):
    # a model transformers made itself: untied, plain multi-head attention, a vocabulary padded past the tokenizer's,
    # saved in shards with an index
    made = tmp_path / "made"
    config = transformers.LlamaConfig(**{k: v for k, v in llama_config().items() if k != "architectures"}
                                      | {"num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 32064})
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(made, safe_serialization=True, max_shard_size="3MB")
    assert (made / "model.safetensors.index.json").is_file() and len(list(made.glob("model-*.safetensors"))) > 1
    one_step = ["--training-steps", "1", "--learning-rate", "1e-30", "--weight-decay", "0"]
    from_export, from_made = tmp_path / "from-export", tmp_path / "from-made"
    results = finish(start_train(base(corpus, from_export, "--init-from", str(trained["tied"]["hf"]), *one_step)),
                     start_train(base(corpus, from_made, "--init-from", str(made), *one_step)))
    for result in results:
        assert "tensors loaded" in ok(result)

    # our export of the tied run: the same weights as the checkpoint it was exported from
    same = check_weights(from_export / "default", trained["tied"]["step_dir"], "--tolerance", "0")
    assert same.returncode == 0 and "bitwise" in same.stdout, same.stdout + same.stderr

    # transformers' model: every tensor of its safetensors file, bitwise, under our names
    from safetensors.torch import load_file

    theirs = {k: v for f in made.glob("model-*.safetensors") for k, v in load_file(f).items()}
    ours = read_section(from_made / "default", "model")
    saved = json.loads(torch.load(from_made / "default" / "step-00000001" / "run_info.pt",
                                  weights_only=True)["config_json"])
    assert saved["model"] == str(made / "config.json")  # the shape came from --init-from's config.json
    mapping = hf_names(saved["model_config"])
    assert sorted(mapping.values()) == sorted(theirs) and set(mapping) == set(ours)
    for our_name, their_name in mapping.items():
        assert torch.equal(ours[our_name].view(torch.int32), theirs[their_name].view(torch.int32)), our_name

    # a resume loads the checkpoint, whatever --init-from says
    resumed = finish(start_train(base(corpus, from_made, "--init-from", str(made), "--training-steps", "2",
                                      "--learning-rate", "1e-30", "--weight-decay", "0",
                                      "--resume-from-checkpoint", "latest")))[0]
    assert "--init-from" in ok(resumed) and "applies to a fresh start only" in resumed[1]


def test_gradient_accumulation_resumes_bitwise_after_a_kill(trained, corpus, tmp_path):
    steps = 8
    args = ["--model", str(trained["tied"]["config"]), "--gradient-accumulation-steps", "4", "--training-steps",
            str(steps), "--checkpoint-frequency", "2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    reference = start_train(base(corpus, straight, *args))
    csv = killed / "default" / "loss.csv"
    kill_run_at_row([PY, str(ROOT / "train.py"), *base(corpus, killed, *args)], csv, 5,
                    env=env_for_tests({"PYRECOVER_STEP_SLEEP": "0.05"}))
    ok(finish(reference)[0])
    resumed = finish(start_train(base(corpus, killed, *args, "--resume-from-checkpoint", "latest")))[0]
    stdout = ok(resumed)
    assert "global batch 256 tokens (2 x 4 accumulation x 1 rank(s) x 32)" in stdout
    assert "(step 4, vanilla backend" in stdout  # killed after step 5: resumed from the step-4 checkpoint
    same = check_weights(killed / "default", straight / "default", "--tolerance", "0", "--optimizer")
    assert same.returncode == 0 and "bitwise" in same.stdout, same.stdout + same.stderr
    rows = loss_rows(csv)
    assert rows == loss_rows(straight / "default" / "loss.csv")  # one row per optimizer step, the same values
    assert [int(r[0]) for r in rows] == list(range(1, steps + 1))
    assert [int(r[3]) for r in rows] == [s * 2 * 4 * SEQ for s in range(1, steps + 1)]
    assert csv_rows(csv) == steps


def test_bad_model_configs_mismatched_weights_and_changed_optimizer_flags_are_one_line(trained, corpus, tmp_path):
    cases = {"rope_scaling": llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
             "mistral": llama_config(model_type="mistral"),
             "small-vocab": llama_config(vocab_size=1000)}
    for name, config in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    mismatched = tmp_path / "mismatched"  # an export whose config.json says another intermediate size
    shutil.copytree(trained["untied"]["hf"], mismatched)
    (mismatched / "config.json").write_text(json.dumps(llama_config(tie_word_embeddings=False,
                                                                     intermediate_size=128)))
    # exports whose weights are not finite floats: one tensor of integers; every weight NaN (a diverged model)
    from safetensors.torch import load_file, save_file

    spoiled = {"int-weights": lambda ts: ts | {"model.layers.1.mlp.up_proj.weight":
                                                  ts["model.layers.1.mlp.up_proj.weight"].to(torch.int32)},
               "nan-weights": lambda ts: {k: torch.full_like(t, float("nan")) for k, t in ts.items()}}
    for name, spoil in spoiled.items():
        shutil.copytree(trained["untied"]["hf"], tmp_path / name)
        weights = tmp_path / name / "model.safetensors"
        save_file(spoil(load_file(weights)), weights, metadata={"format": "pt"})
    runs = [*(start_train(base(corpus, tmp_path / "ck", "--model", str(tmp_path / f"{n}.json"))) for n in cases),
            start_train(base(corpus, tmp_path / "ck", "--init-from", str(mismatched))),
            start_train(base(corpus, tmp_path / "ck", "--model", "tiny", "--init-from",
                             str(trained["untied"]["hf"]))),
            # the optimizer flags are the checkpoint's: another value is refused on resume
            *(start_train(base(corpus, trained[name]["ckdir"], "--model", str(trained[name]["config"]),
                               "--training-steps", str(STEPS + 2), "--resume-from-checkpoint", "latest", *change))
              for name, change in (("tied", ["--gradient-accumulation-steps", "2"]),
                                   ("untied", ["--adam-betas", "0.9,0.99", "--min-lr-ratio", "0"]))),
            *(start_train(base(corpus, tmp_path / "ck", "--init-from", str(tmp_path / name))) for name in spoiled)]
    results = finish(*runs)
    refused(results[0], "rope_scaling", "not supported")
    refused(results[1], "model_type 'mistral' is not supported")
    refused(results[2], "vocab_size 1000 is smaller than tokenizer mistral-sp-32k's 32000 tokens")
    refused(results[3], "--init-from", "has shape [176, 64]", "[128, 64]")
    refused(results[4], "--init-from", "differs from --model tiny", "ffn_dim 176 (--model: 192)")
    refused(results[5], "--gradient-accumulation-steps 2", "checkpoint's 1", "cannot change on resume")
    refused(results[6], "--adam-betas 0.9,0.99", "checkpoint's 0.9,0.95", "cannot change on resume")
    refused(results[7], f"--init-from {tmp_path / 'int-weights'}",
            "tensor 'model.layers.1.mlp.up_proj.weight' is int32, not floating point")
    refused(results[8], f"--init-from {tmp_path / 'nan-weights'}",
            "tensor 'model.embed_tokens.weight' holds NaN values")
    for name in trained:
        assert sorted(p.name for p in (trained[name]["ckdir"] / "default").glob("step-*")) == [f"step-{STEPS:08d}"]
    assert not (tmp_path / "ck" / "default").exists() or not list((tmp_path / "ck" / "default").glob("step-*"))
