"""Issue #42, items 3, 4 and 7, through the real CLI on shared runs (one module fixture, so the suite pays for each
training once):

* --lr-schedule: a wsd run stopped by SIGTERM and resumed ends bitwise as the uninterrupted one, and its loss.csv lr
  column is the formula's, written out here independently; another schedule on resume is applied and named; the
  other schedules' formulas and their LambdaLR state round trip are checked in-process.
* --init-from: a folder with its own tokenizer trains with it; a mismatched --tokenizer-name-or-path is one line; an
  export, then --init-from it at twice the sequence length, trains.
* `python evaluation.py sample`: a vanilla, a concurrent (the same training, interrupted and resumed) and a 2-rank dcp
  checkpoint give the same text for a seed every time, vanilla and concurrent the same text; a corrupt one is refused.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (PY, ROOT, TINY, check_weights, env_for_tests, loss_rows, run_torchrun, run_train, start_train,
                     wait_rows)

sys.path.insert(0, str(ROOT))

STEPS = 10
PEAK = 1e-3  # --learning-rate's default
# wsd with 2 warm-up steps and the last 3 of 10 decaying to --min-lr-ratio 0.1: the lr each loss.csv row trained with
WSD = ["--lr-schedule", "wsd", "--lr-warmup-steps", "2", "--lr-decay-steps", "3"]
WSD_LR = [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7e-4, 4e-4, 1e-4]


def _train(corpus: str, ckdir: Path, *extra: str) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ckdir), "--log-loss-to-csv", *extra]


def _one_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    return lines[0]


def _sample(*args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "evaluation.py"), "sample", *map(str, args)], capture_output=True,
                          text=True, timeout=180, env=env_for_tests(), cwd=ROOT)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, Path]:
    """Run folders: wsd uninterrupted (vanilla); the same stopped by SIGTERM and resumed (concurrent backend); a 2-rank
    dcp run of 4 steps (TINY's 5 warm-up steps: the warning)."""
    top = tmp_path_factory.mktemp("continued")
    ref, stopped, dcp = top / "ref", top / "stopped", top / "dcp"
    run_train(_train(corpus, ref, *WSD, "--training-steps", str(STEPS), "--checkpoint-frequency", "4"), check=True)
    flags = _train(corpus, stopped, *WSD, "--training-steps", str(STEPS), "--checkpoint-frequency", "4",
                   "--checkpoint-backend", "concurrent")
    proc = start_train(flags, env={"PYRECOVER_STEP_SLEEP": "0.1"})
    try:
        wait_rows(stopped / "default" / "loss.csv", 5, proc)
        proc.send_signal(signal.SIGTERM)  # saved at the next step boundary, exit 4
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 4, (out[-2000:], err[-2000:])
    run_train(flags + ["--resume-from-checkpoint", "latest"], check=True)
    proc = run_torchrun(2, _train(corpus, dcp, "--training-steps", "4", "--checkpoint-frequency", "4",
                                  "--checkpoint-backend", "dcp"), check=True)
    assert "warning: --lr-warmup-steps 5 exceeds --training-steps 4" in proc.stdout, proc.stdout[-3000:]
    return {"ref": ref / "default", "stopped": stopped / "default", "dcp": dcp / "default"}


# ----------------------------------------------------------------------------------------------------------------------
# 3. schedules
# ----------------------------------------------------------------------------------------------------------------------


def test_wsd_resumed_is_bitwise_and_follows_its_formula(runs):
    ref, resumed = loss_rows(runs["ref"] / "loss.csv"), loss_rows(runs["stopped"] / "loss.csv")
    assert [int(r[0]) for r in ref] == list(range(1, STEPS + 1))
    assert resumed == ref  # step, loss, lr, tokens: every row, across the stop
    lrs = [float(r[2]) for r in ref]
    assert lrs[1:7] == [PEAK] * 6  # the stable phase: exactly the peak
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(lrs, WSD_LR)), lrs
    same = check_weights(runs["ref"], runs["stopped"], "--optimizer")
    assert same.returncode == 0, same.stdout + same.stderr
    card = json.loads((runs["ref"] / f"step-{STEPS:08d}" / "manifest.json").read_text())["meta"]["card"]
    assert card["hyperparameters"]["lr_schedule"].startswith("wsd: 2 warm-up step(s), stable to step 7, then linear "
                                                             "decay over 3 step(s) to 0.1 x peak")


def test_another_schedule_on_resume_is_applied_and_named(runs, corpus, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["ref"], run / "default")
    proc = run_train(_train(corpus, run, *WSD, "--lr-schedule", "constant", "--training-steps", "12",
                            "--checkpoint-frequency", "0", "--resume-from-checkpoint", "latest"), check=True)
    lines = proc.stdout.splitlines()
    assert "resume: applying --lr-schedule constant (checkpoint had wsd)" in lines, proc.stdout[-3000:]
    assert "resume: applying --training-steps 12 (checkpoint had 10)" in lines, proc.stdout[-3000:]
    rows = loss_rows(run / "default" / "loss.csv")
    assert [r[2] for r in rows[STEPS:]] == [repr(PEAK), repr(PEAK)]  # constant: the peak from the first resumed step


def test_every_schedule_formula_and_its_state_round_trip():
    import torch

    import flags
    import schedules

    W, T, m = 3, 12, 0.1
    expect = {  # factor at optimizer step s (0-based), written out independently of schedules.py
        "cosine": lambda s: m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (s - W) / (T - W))),
        "linear": lambda s: 1 - (1 - m) * (s - W) / (T - W),
        "wsd": lambda s: 1.0 if s < T - 2 else 1 - (1 - m) * (s - (T - 2) + 1) / 2,  # decay fraction 0.2: 2 steps
        "constant": lambda s: 1.0,
    }
    for name, formula in expect.items():
        args = flags.parse_args(["--lr-schedule", name, "--lr-warmup-steps", str(W), "--training-steps", str(T)])
        factor = schedules.from_flags(args)
        got = [factor(s) for s in range(T)]
        want = [(s + 1) / W if s < W else formula(s) for s in range(T)]
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(got, want)), (name, got, want)
        # LambdaLR's checkpointed state, restored into a fresh scheduler of the same flags mid-run, continues the run
        def scheduler():
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedules.from_flags(args))
        opt, sched = scheduler()
        lrs = []
        for s in range(T):
            if s == 5:
                state = (opt.state_dict(), sched.state_dict())
                opt, sched = scheduler()
                opt.load_state_dict(state[0])
                sched.load_state_dict(state[1])
            lrs.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        assert lrs == [PEAK * f for f in got], name
    bad = flags.parse_args(["--lr-schedule", "wsd", "--lr-warmup-steps", "9", "--training-steps", "10"])
    with pytest.raises(flags.BadInput, match=r"^--lr-schedule wsd: --lr-warmup-steps 9 \+ 2 decay step\(s\) "
                                             r"\(--lr-decay-fraction 0.2\) exceed --training-steps 10; "):
        flags.check_flags(bad)


# ----------------------------------------------------------------------------------------------------------------------
# 7. sample
# ----------------------------------------------------------------------------------------------------------------------


def _texts(proc: subprocess.CompletedProcess) -> dict[str, str]:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    parts = proc.stdout.split("--- ")[1:]
    return {p.split("\n", 1)[0]: p.split("\n", 1)[1] for p in parts}


def test_sample_is_deterministic_for_a_seed_on_every_backend(runs, tmp_path):
    ckpts = [runs["ref"], runs["stopped"], runs["dcp"]]
    first = _texts(_sample(*ckpts, "--prompt", "ROMEO.", "--max-new-tokens", "8", "--seed", "7"))
    again = _texts(_sample(*ckpts, "--prompt", "ROMEO.", "--max-new-tokens", "8", "--seed", "7"))
    greedy = _texts(_sample(*ckpts, "--prompt", "ROMEO.", "--max-new-tokens", "8", "--temperature", "0"))
    last = f"step-{STEPS:08d}"
    names = [str(runs["ref"] / last), str(runs["stopped"] / last), str(runs["dcp"] / "step-00000004")]
    for texts in (first, again, greedy):
        assert list(texts) == names
        assert all(t.startswith("ROMEO.") and len(t) > len("ROMEO.\n") for t in texts.values()), texts
        assert texts[names[0]] == texts[names[1]]  # vanilla and concurrent: one training, one text
    assert first == again
    assert first[names[0]] != greedy[names[0]]

    broken = tmp_path / last
    shutil.copytree(runs["ref"] / last, broken)
    model = broken / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, the size unchanged: only the checksum can tell
    model.write_bytes(bytes(data))
    line = _one_error(_sample(broken, "--prompt", "ROMEO.", "--max-new-tokens", "2"))
    assert "model.pt" in line and "checksum" in line, line


# ----------------------------------------------------------------------------------------------------------------------
# 4. --init-from
# ----------------------------------------------------------------------------------------------------------------------


def test_export_then_init_from_at_twice_the_sequence_length_trains(runs, tmp_path):
    out = tmp_path / "hf"
    proc = subprocess.run([PY, str(ROOT / "hf.py"), "export", str(runs["dcp"]), str(out), "--to", "hf"],
                          capture_output=True, text=True, timeout=180, env=env_for_tests(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["max_position_embeddings"], config["pyrecover_training_sequence_length"]) == (32, 32)
    assert (out / "tokenizer.model").is_file()  # the training tokenizer travels with the weights

    dataset = json.loads((runs["dcp"] / "config.resolved.json").read_text())["dataset"]
    args = ["--init-from", str(out), "--dataset", dataset, "--sequence-length", "64", "--batch-size", "2",
            "--training-steps", "2", "--lr-warmup-steps", "1", "--checkpoint-dir", str(tmp_path / "ck")]
    proc = run_train(args, check=True)
    assert f"init-from {out}: its tokenizer mistral-sp-32k (32000 tokens)" in proc.stdout, proc.stdout[-3000:]
    assert "note: --sequence-length 64 exceeds" in proc.stdout and "max_position_embeddings 32" in proc.stdout
    import hf
    from checkpoint import layout

    step = tmp_path / "ck" / "default" / "step-00000002"
    saved = hf.saved_model(step, layout.verify(step))
    assert (saved.tokenizer, saved.config["max_seq_len"], saved.max_positions) == ("mistral-sp-32k", 64, 64)
    assert hf.hf_config(saved.config, None, None, None, 4096)["max_position_embeddings"] == 4096  # a longer one kept


def _model_folder(folder: Path, vocab: int) -> None:
    """A Hugging Face Llama folder of the tiny shape with ``vocab`` tokens: config.json + model.safetensors."""
    import safetensors.torch
    import torch

    import hf
    from model import Transformer, get_config

    torch.manual_seed(0)
    config = vars(get_config("tiny", vocab_size=vocab, max_seq_len=32))
    state = Transformer(get_config("tiny", vocab_size=vocab, max_seq_len=32)).state_dict()
    names = hf.hf_names(config)
    safetensors.torch.save_file({names[k]: v.contiguous() for k, v in state.items() if k in names},
                                folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf.hf_config(config, torch.float32, None, None)))


def test_init_from_a_folder_with_its_own_tokenizer_uses_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from test_tokenizer_hf import TEXTS, make_tokenizer_json

    own = tmp_path / "own"
    own.mkdir()
    (own / "tokenizer.json").write_bytes(make_tokenizer_json(vocab_size=300))
    import tokenizer as tk

    vocab = tk.load_tokenizer(str(own)).vocab_size
    _model_folder(own, vocab)
    data = tmp_path / "small.parquet"
    pq.write_table(pa.table({"text": [t + f" ({i})" for i in range(60) for t in TEXTS]}), data)
    args = TINY + ["--init-from", str(own), "--dataset", str(data), "--training-steps", "2",
                   "--checkpoint-dir", str(tmp_path / "ck")]
    proc = run_train(args, check=True)
    assert f"init-from {own}: its tokenizer hf-own-" in proc.stdout, proc.stdout[-3000:]
    resolved = json.loads((tmp_path / "ck" / "default" / "config.resolved.json").read_text())
    assert resolved["tokenizer_name_or_path"] == str(own)

    line = _one_error(run_train(args + ["--tokenizer-name-or-path", "cl100k_base"], timeout=180))
    assert line.startswith("error: --tokenizer-name-or-path cl100k_base (cl100k_base) is not the tokenizer of "
                           f"--init-from {own} (hf-own-") and "--force-tokenizer" in line, line
    assert f"100277 vs {vocab} tokens" in line, line
