"""The training CLI end to end: flags, bad input, determinism, DDP on gloo, loss going down."""

from __future__ import annotations

import re
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import PY, ROOT, TINY, env_for_tests, loss_rows, run_torchrun, run_train

REFERENCE_FLAGS = [
    "--dataset", "--tokenizer-name-or-path", "--sequence-length", "--batch-size", "--learning-rate",
    "--lr-warmup-steps", "--training-steps", "--logging-frequency", "--profile", "--profile-step-start",
    "--profile-step-end", "--grad-max-norm", "--model-dtype", "--compile", "--distributed", "--checkpoint-dir",
    "--checkpoint-frequency", "--resume-from-checkpoint", "--experiment_name", "--use-torch-distributed-ckpt",
    "--timeaware-checkpointing", "--use_flash_attention", "--log-loss-to-csv", "--fused-optimizer", "--seed", "--model",
]


def test_help_lists_every_reference_flag_and_batch_size_semantics():
    out = subprocess.run([PY, str(ROOT / "train.py"), "--help"], capture_output=True, text=True, env=env_for_tests(),
                         timeout=120)
    assert out.returncode == 0
    for flag in REFERENCE_FLAGS:
        assert flag in out.stdout, flag
    assert "PER RANK" in out.stdout


def test_both_spellings_parse():
    import sys

    sys.path.insert(0, str(ROOT))
    import train

    parser = train.build_parser()
    for a, b in [("--experiment_name", "--experiment-name"), ("--use_flash_attention", "--use-flash-attention"),
                 ("--sequence-length", "--sequence_length"), ("--log-loss-to-csv", "--log_loss_to_csv")]:
        args_a = parser.parse_args([a] if "flash" in a or "csv" in a else [a, "7"])
        args_b = parser.parse_args([b] if "flash" in b or "csv" in b else [b, "7"])
        assert vars(args_a) == vars(args_b), (a, b)
    assert parser.parse_args(["--exp_name", "x"]).experiment_name == "x"


def _bad(tmp_path, args, *, extra_env=None) -> str:
    proc = run_train(args + ["--checkpoint-dir", str(tmp_path / "ck")], env=extra_env, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(err) == 1, proc.stderr  # one clear line, no traceback (progress/info lines may precede it)
    assert "Traceback" not in proc.stderr
    return err[0]


def test_bad_inputs_one_line_exit_2(tmp_path, corpus):
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"body": ["hello world"] * 3}), no_text)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    short = tmp_path / "short.parquet"
    pq.write_table(pa.table({"text": ["a tiny document"]}), short)

    assert "does-not-exist.parquet" in _bad(tmp_path, TINY + ["--dataset", str(tmp_path / "does-not-exist.parquet")])
    assert "text" in _bad(tmp_path, TINY + ["--dataset", str(no_text)])
    assert "no" in _bad(tmp_path, TINY + ["--dataset", str(empty)]).lower()
    line = _bad(tmp_path, TINY + ["--dataset", str(short), "--sequence-length", "512"])
    assert "sequence" in line.lower() or "tokens" in line.lower()
    assert "no-such-tokenizer" in _bad(tmp_path, TINY + ["--dataset", corpus, "--tokenizer-name-or-path", "no-such-tokenizer"])
    assert "flash" in _bad(tmp_path, TINY + ["--dataset", corpus, "--use_flash_attention"]).lower()
    assert "launcher" in _bad(tmp_path, TINY + ["--dataset", corpus, "--distributed"])
    # unknown preset: argparse's own one-line usage error, exit 2
    proc = run_train(["--model", "huge"], timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'huge'" in proc.stderr


@pytest.mark.slow
def test_same_seed_same_losses_and_loss_falls(tmp_path, corpus):
    args = TINY + ["--dataset", corpus, "--training-steps", "40", "--checkpoint-frequency", "0", "--log-loss-to-csv",
                   "--learning-rate", "3e-3"]
    run_train(args + ["--checkpoint-dir", str(tmp_path / "a")], check=True)
    run_train(args + ["--checkpoint-dir", str(tmp_path / "b")], check=True)
    a, b = loss_rows(tmp_path / "a/default/loss.csv"), loss_rows(tmp_path / "b/default/loss.csv")
    assert len(a) == 40 and a == b
    first, last = float(a[0][1]), sum(float(r[1]) for r in a[-5:]) / 5
    assert last < first - 1.0, (first, last)


def test_bf16_and_fused_optimizer_run_on_cpu(tmp_path, corpus):
    proc = run_train(TINY + ["--dataset", corpus, "--training-steps", "3", "--model-dtype", "bf16", "--fused-optimizer",
                             "--checkpoint-dir", str(tmp_path)], check=True)
    assert "done: 3 steps" in proc.stdout


def test_grad_clipping_really_clips(tmp_path, corpus):
    """With a tiny max norm the update per step is bounded by lr * (clipped) Adam step: compare against no clipping."""
    import sys

    import torch

    sys.path.insert(0, str(ROOT))
    from model import Transformer, get_config

    torch.manual_seed(0)
    model = Transformer(get_config("tiny", vocab_size=100, max_seq_len=16))
    x = torch.randint(0, 100, (2, 16))
    model(x).float().pow(2).mean().mul(1e4).backward()
    params = list(model.parameters())
    before = torch.nn.utils.clip_grad_norm_(params, 0.5)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    assert before > 0.5 and abs(float(after) - 0.5) < 1e-3


@pytest.mark.slow
def test_ddp_two_ranks_on_gloo_keeps_replicas_identical(tmp_path, corpus):
    proc = run_torchrun(2, TINY + ["--dataset", corpus, "--training-steps", "6", "--checkpoint-frequency", "3",
                                   "--checkpoint-dir", str(tmp_path)], check=True)
    assert "2 rank(s) on cpu (gloo)" in proc.stdout
    assert "replica check: parameters identical across 2 ranks" in proc.stdout
    assert re.search(r"checkpoint step 6 committed", proc.stdout)


def test_a_terminal_without_a_width_gets_plain_lines(tmp_path, corpus):
    """Some `srun --pty` wrappers give a pty of 0 x 0: tqdm draws nothing there, so the run prints its plain lines (a
    real pty, its size set to 0 x 0 as such a wrapper leaves it)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    import time

    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    env = env_for_tests()
    for name in ("COLUMNS", "LINES"):
        env.pop(name, None)
    proc = subprocess.Popen([PY, str(ROOT / "train.py"), *TINY, "--dataset", corpus, "--training-steps", "2",
                             "--checkpoint-dir", str(tmp_path)], stdin=child, stdout=child, stderr=child, env=env,
                            cwd=ROOT)
    os.close(child)
    out, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline:  # until the pty closes (EIO once the run, its only writer, has exited)
        if not select.select([parent], [], [], 1)[0]:
            continue
        try:
            data = os.read(parent, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
    os.close(parent)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        proc.kill()  # a no-op unless it timed out
    assert rc == 0, out.decode(errors="replace")[-3000:]
    text = out.decode(errors="replace")
    assert re.search(r"^step 1/2 loss \S+ lr \S+ .* peak_rss [\d,]+MiB eta ", text, re.M), text[-3000:]
    assert re.search(r"^step 2/2 loss ", text, re.M) and "done: 2 steps" in text, text[-3000:]
