"""Documented and validated checkpoints: the card each checkpoint carries, and the prediction that validates a load.

The HPC practice this follows: document every checkpoint (architecture, data, hyperparameters, metrics), and after
loading one, make a prediction and check it -- checksums catch corrupt bytes, not a wrong load (two tensors of the same
shape swapped pass every checksum).

    held out   the last --eval-windows windows of the data (dataset.hold_out), or the last --val-fraction of them:
               training never sees them
    eval set   what an evaluation reads: --val-dataset's windows when given (a separate set: training is unchanged by
               it), else the held-out windows
    probe      the first EVAL_BATCH windows of the eval set: its loss at save time goes into the card together with its
               tokens, so `python evaluation.py validate` and --validate-on-resume recompute it from the checkpoint
    val loss   the mean loss over the first --eval-tokens' worth of windows of the eval set (the same windows, in the
               same order, every time: curves are comparable), at every --eval-every step and every periodic save;
               the card's eval_loss is it, and it is what --keep-best ranks checkpoints by

Every rank evaluates its share of the windows (batch b on rank b % world size) and the sums are all-reduced, so the
value is the same on every rank and exact whatever the split. Nothing draws RNG or changes a weight: a run with
evaluations trains bitwise as the run without.

The card lives in the manifest (``meta.card``), so the manifest's checksum covers it.

    python evaluation.py validate PATH [--device cpu]
        recompute the probe loss of one step folder or of every committed one under PATH from the weights alone and
        compare it with the card's (exit 1 if a checkpoint does not predict as saved); PATH may be s3://bucket/prefix
    python evaluation.py sample CKPT --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
        continue TEXT with the checkpoint's model (sample.py): any backend and world size, no export needed
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (validate, sample), torch-free: run as a program, this module parses it before it imports
    torch (below), so --help and a bad flag or path answer at once."""
    from checkpoint import storage  # stdlib, numpy

    p = argparse.ArgumentParser(prog="python evaluation.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    val = sub.add_parser("validate", help="recompute each checkpoint's probe loss and compare it with its card")
    val.add_argument("path", type=storage.as_path, help="step folder, or experiment folder (each committed one)")
    val.add_argument("--device", default="cpu", help="where to recompute (default cpu)")
    smp = sub.add_parser("sample", help="generate text from a checkpoint (no export needed; sample.py)")
    smp.add_argument("path", type=storage.as_path, nargs="+",
                     help="step folder, or run folder (its newest valid checkpoint); several: one sample each, after a "
                          "'--- STEP_FOLDER' line")
    smp.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    smp.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    smp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    smp.add_argument("--top-k", type=int, default=200, help="sample among the K most likely tokens (default 200)")
    smp.add_argument("--seed", type=int, default=1337, help="the draws' seed (default 1337)")
    smp.add_argument("--device", default="cpu", help="where to run the model (default cpu)")
    smp.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the one the run trained with)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line and what can be checked of it with nothing loaded: a bad path or number is a CheckpointError
    (one line); argparse's usage errors exit 2."""
    from checkpoint.errors import CheckpointError

    args = build_parser().parse_args(argv)  # inside: an s3:// path without a bucket is a CheckpointError too
    if args.cmd == "validate" and not args.path.exists():
        raise CheckpointError(f"{args.path} does not exist")
    if args.cmd == "sample":
        for what, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 1)):
            if value < low:
                raise CheckpointError(f"{what} {value} is out of range; give a number >= {low}")
        if not args.temperature >= 0 or args.temperature == float("inf"):
            raise CheckpointError(f"--temperature {args.temperature} is out of range; give a finite number >= 0")
    return args


_PARSED: argparse.Namespace | None = None  # the command line as parsed below, run as a program (main takes it)
if __name__ == "__main__":
    from badinput import parse_first
    from checkpoint.errors import CheckpointError

    _PARSED = parse_first(parse_args, (CheckpointError, OSError))

import torch  # noqa: E402 - after the command line (above)
import torch.nn.functional as F  # noqa: E402

from checkpoint import knobs  # noqa: E402

EVAL_BATCH = 2  # windows per evaluation forward; the probe is the first batch
DEFAULT_EVAL_TOKENS = 1 << 20  # --eval-tokens unset: an evaluation reads at most this many tokens of the eval set
# Across devices, dtypes or rank layouts kernels differ, so the recomputed probe loss may differ in its last bits:
# relative tolerance per training dtype. On the same layout the loss must be bitwise the recorded one.
TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
LAYOUT_KEYS = ("device", "dtype", "attention", "world_size", "parallel", "hardware", "torch")


@torch.no_grad()
def batch_loss(model: torch.nn.Module, windows: torch.Tensor, device: torch.device, autocast) -> float:
    """Mean next-token loss of ``windows`` [B, T+1] in eval mode (the training mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        inputs, targets = windows[:, :-1].to(device), windows[:, 1:].to(device)
        with autocast:
            logits = model(inputs)
        return float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1)))
    finally:
        model.train(was_training)


def eval_window_count(eval_tokens: int | None, seq_len: int, available: int) -> int:
    """How many windows (the first ones) an evaluation reads: --eval-tokens' worth, rounded down to whole windows and
    at least one; 0 means all; unset, at most DEFAULT_EVAL_TOKENS' worth. More than ``available`` only when asked
    for explicitly (the caller refuses that)."""
    if eval_tokens == 0:
        return available
    wanted = max(1, (eval_tokens or DEFAULT_EVAL_TOKENS) // seq_len)
    return wanted if eval_tokens else min(wanted, available)


def evaluate(model: torch.nn.Module, windows, device: torch.device, autocast, *, count: int | None = None,
             rank: int = 0, world_size: int = 1, lockstep: bool = False, reduce=None, stop=None) -> dict | None:
    """The mean loss over the first ``count`` windows (default all) in batches of EVAL_BATCH, batch b on rank
    b % world_size; ``reduce(values) -> sums over ranks`` (distributed.sum_over_ranks) makes the (loss x windows) sum
    and the probe loss (the first batch's, rank 0's) every rank's. ``lockstep`` (FSDP: each forward
    gathers the shards, a collective): every rank runs as many forwards, one out of batches repeats its first and
    counts it not. No RNG is drawn and no weight changes, so a run with evaluation is bitwise the run without.
    ``stop(first) -> bool`` (Session.interrupt: a collective, the stop policy's agreed vote), asked before each round
    of batches on every rank (as many rounds everywhere; ``first``: before the first): True ends the evaluation
    there, and it returns None -- a stop signal's save does not wait for the evaluation."""
    n = len(windows) if count is None else count
    batches = [range(i, min(i + EVAL_BATCH, n)) for i in range(0, n, EVAL_BATCH)]
    mine = batches[rank::world_size]
    rounds = -(-len(batches) // world_size) if lockstep or stop is not None else len(mine)
    pause = knobs.eval_sleep()  # test-only: a kill or a stop signal lands inside this evaluation
    total, probe = 0.0, 0.0
    for j in range(rounds):
        if pause is not None and j > 0:  # the pause spread over the rounds after the first (its probe is known)
            time.sleep(pause / (rounds - 1))
        if stop is not None and stop(j == 0):
            return None
        if j >= len(mine) and not lockstep:  # a round this rank has no batch in: it only agreed
            continue
        batch = mine[j] if j < len(mine) else batches[0]
        loss = batch_loss(model, windows.batch(batch), device, autocast)
        if j < len(mine):
            total += loss * len(batch)
            if rank == 0 and j == 0:
                probe = loss
        if pause is not None and rounds == 1:
            time.sleep(pause)
    if reduce is not None:  # the other ranks add 0.0 to rank 0's probe loss: exactly it, everywhere
        total, probe = reduce([total, probe])
    mean = total / n
    return {"probe_loss": probe, "eval_loss": mean, "eval_windows": n, "val_loss": mean, "val_ppl": perplexity(mean),
            "val_tokens": n * windows.seq_len}


def perplexity(loss: float) -> float:
    """exp(loss); a loss past what a float holds gives infinity, not an error."""
    return math.exp(loss) if loss < 709.0 else float("inf")


class Evaluator:
    """The run's evaluations of the eval set: at every --eval-every step and at every periodic save, at most once per
    step (a save at an --eval-every step reuses that step's). ``report(step, result, seconds)`` (rank 0's
    Metrics.note_eval): the log line, the val CSV row, the trackers; ``observe(seconds)`` (Session.observe_eval): the
    walltime rule counts the duration. Every rank calls it at the same steps (its forwards and the all-reduce are
    collective ones).

    A stop signal (or the walltime) during an evaluation ends it between two batches (``evaluate_at`` returns None):
    nothing is reported, and the stop's checkpoint, of that step, records no val loss. The resumed run evaluates that
    step first (``owed``): every evaluation is reported once, with the value an uninterrupted run reports."""

    def __init__(self, evaluate_at, every: int, report, *, count: int, probe_at, observe=lambda seconds: None):
        self.evaluate_at, self.every, self.report, self.observe = evaluate_at, every, report, observe
        self.count, self.probe_at = count, probe_at  # windows each evaluation reads; the probe batch's loss
        self._last: tuple[int, dict] | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def __call__(self, step: int) -> dict | None:
        """This step's evaluation (made once); None: a stop came during it."""
        if self._last is None or self._last[0] != step:
            began = time.monotonic()
            result = self.evaluate_at()
            if result is None:
                return None
            seconds = time.monotonic() - began
            self._last = (step, result)
            self.observe(seconds)
            self.report(step, result, seconds)
        return self._last[1]

    def owed(self, step: int, card: dict, scheduled: bool) -> bool:
        """Whether the run resumed at ``step`` (from a checkpoint whose ``card`` it is) owes that step's evaluation:
        one was due there (--eval-every, or ``scheduled``: a periodic save's), and the checkpoint -- a stop's, which
        does not wait for one -- records only its probe (a run without validation data then records no eval at all)."""
        return (self.due(step) or scheduled) and "eval" in card and "eval_loss" not in card["eval"]

    def probe_only(self, step: int) -> dict:
        """A stop's card: this step's evaluation if --eval-every already made it, else only the probe loss (what
        --validate-on-resume and `evaluation.py validate` check): one forward, nothing reported."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        return {"probe_loss": self.probe_at()}


def git_commit(where: Path = Path(__file__).resolve().parent) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git, or a filesystem too slow to ask: the card says null
        return None
    return out.stdout.strip() + ("-dirty" if dirty else "")


def hardware(device: torch.device) -> str:
    """The kernels' hardware: the GPU's name, or the CPU architecture (another GPU model may round differently)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace("/", " ")
    return platform.machine() or "cpu"


def run_layout(args: argparse.Namespace, env) -> dict:
    """What a recomputed loss depends on besides the weights: on the same layout it must be bitwise the same."""
    return {"device": env.device.type, "dtype": args.model_dtype,
            "attention": "flash" if args.use_flash_attention else "sdpa", "world_size": env.world_size,
            "parallel": args.parallel if args.distributed else "none", "hardware": hardware(env.device),
            "torch": str(torch.__version__)}


class CardMaker:
    """Builds the card of a checkpoint: what is fixed for the run once, what changes per save when asked."""

    def __init__(self, args: argparse.Namespace, env, config, num_params: int, tokenizer_name: str,
                 fingerprint: str | None,
                 probe: torch.Tensor | None, started_unix: float, version: str, resolved_flags: dict,
                 shards: list | None = None, max_positions: int | None = None):
        """``max_positions``: the max_position_embeddings of the config.json the run's shape came from, which an
        export keeps (hf.py; None: a preset, whose positions are --sequence-length)."""
        import schedules

        self.started = started_unix
        self.static = {
            "model": {"preset": args.model, "params": num_params, "config": dict(vars(config))},
            "data": {"dataset": str(Path(args.dataset).resolve()), "fingerprint": fingerprint,
                     "tokenizer": tokenizer_name, "sequence_length": args.sequence_length,
                     "eval_windows": args.eval_windows},
            "hyperparameters": {"learning_rate": args.learning_rate, "lr_warmup_steps": args.lr_warmup_steps,
                                "lr_schedule": schedules.described(args),
                                "training_steps": args.training_steps, "batch_size_per_rank": args.batch_size,
                                "global_batch_tokens": args.batch_size * args.gradient_accumulation_steps
                                * args.sequence_length * env.world_size,
                                "grad_max_norm": args.grad_max_norm,
                                "optimizer": f"AdamW(betas=({args.adam_betas[0]}, {args.adam_betas[1]}), "
                                             f"wd={args.weight_decay}), min lr ratio {args.min_lr_ratio}, "
                                             f"{args.gradient_accumulation_steps} accumulation step(s)",
                                "seed": args.seed, "checkpoint_backend": args.checkpoint_backend},
            "retention": {"keep": args.max_kept_checkpoints, "keep_every": args.keep_every,
                          "keep_best": args.keep_best},
            "layout": run_layout(args, env),
            "versions": {"pyrecover": version, "torch": str(torch.__version__), "git_commit": git_commit()},
        }
        # Every flag's final value (command line, --config file, defaults), as <run>/config.resolved.json has it: the
        # card alone says how its checkpoint was trained, wherever it is copied to.
        self.static["flags"] = resolved_flags
        if shards is not None:  # a folder or glob: the shards a resume keeps to (dataset.pin_shards)
            self.static["data"]["shards"] = shards
        # The validation set, if any: not in the fingerprint when separate (--val-dataset changes no training, so a
        # resume may add or change it); --val-fraction's windows are the data's, in it, and that flag cannot change.
        if getattr(args, "val_dataset", None) is not None:
            self.static["data"]["val_dataset"] = str(Path(args.val_dataset).resolve())
        if getattr(args, "val_fraction", None) is not None:
            self.static["data"]["val_fraction"] = args.val_fraction
        if args.checkpoint_note:
            self.static["note"] = args.checkpoint_note
        if max_positions is not None:
            self.static["model"]["max_position_embeddings"] = max_positions
        self.probe_tokens = probe.tolist() if probe is not None else None

    def __call__(self, *, step: int, tokens_seen: int, losses: list[float], lr: float | None,
                 evaluation: dict | None) -> dict:
        card = dict(self.static)
        card["progress"] = {"step": step, "tokens_seen": tokens_seen,
                            "loss_last": losses[-1] if losses else None,
                            "loss_mean": sum(losses) / len(losses) if losses else None,
                            "loss_steps": len(losses), "learning_rate": lr}
        card["time"] = {"saved_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "run_wall_s": round(time.time() - self.started, 3)}
        if evaluation is not None:
            card["eval"] = dict(evaluation, probe_tokens=self.probe_tokens)
        return card


def check_prediction(card: dict, loss: float, here: dict) -> tuple[bool, str]:
    """Compare a recomputed probe loss with the one recorded at save time: bitwise on the same layout (device, dtype,
    attention, ranks), else within TOLERANCE. Returns (ok, one line saying what was compared)."""
    recorded = card["eval"]["probe_loss"]
    saved_layout = card.get("layout", {})
    same = all(saved_layout.get(k) == here.get(k) for k in LAYOUT_KEYS)
    where = "/".join(str(here.get(k)) for k in LAYOUT_KEYS)
    if same:
        ok = loss == recorded
        rule = f"bitwise on the saving layout {where}"
    else:
        tol = TOLERANCE.get(saved_layout.get("dtype", "fp32"), 1e-4)
        ok = abs(loss - recorded) <= tol * max(1.0, abs(recorded))
        rule = (f"within {tol:g} relative: saved on {'/'.join(str(saved_layout.get(k)) for k in LAYOUT_KEYS)}, "
                f"recomputed on {where}")
    return ok, f"probe loss {loss!r} recomputed, {recorded!r} recorded at save ({rule})"


def validate_checkpoint(step_dir: Path, manifest: dict, device: str = "cpu") -> tuple[bool, str]:
    """`python evaluation.py validate`: rebuild the model from the card, load the checkpoint's weights (any backend,
    any world size), recompute the probe loss in one process on ``device`` and compare. Raises CheckpointError when
    the checkpoint holds nothing to compare with."""
    import distributed
    from checkpoint.errors import CheckpointError, first_line
    from checkpoint.reader import read_section
    from model import ModelConfig, Transformer

    card = manifest.get("meta", {}).get("card")
    if not card or "eval" not in card or not card["eval"].get("probe_tokens"):
        why = "a just-in-time save" if manifest.get("meta", {}).get("jit") else "saved without held-out data"
        raise CheckpointError(f"{step_dir}: no probe loss recorded ({why}); nothing to validate by prediction; "
                              "`python -m checkpoint verify` checks its bytes")
    dtype = card["layout"]["dtype"]
    torch.manual_seed(0)  # the weights are overwritten below; seeding only keeps construction quiet and repeatable
    try:
        model = Transformer(ModelConfig(**card["model"]["config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{step_dir}: the card's model shape is not one this model.py builds ({e})") from None
    model.to(dtype=distributed.param_dtype(dtype))
    weights = {k: v for k, v in read_section(step_dir, "model").items() if isinstance(v, torch.Tensor)}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{step_dir}: the weights do not fit the model of its card: "
                              f"{first_line(e)}") from None
    try:
        device = torch.device(device)
        model.to(device)
        here = {"device": device.type, "dtype": dtype, "attention": "sdpa", "world_size": 1, "parallel": "none",
                "hardware": hardware(device), "torch": str(torch.__version__)}
    except (RuntimeError, AssertionError) as e:  # e.g. --device cuda on a machine without one
        raise CheckpointError(f"cannot validate on device {device}: {first_line(e)}; use --device cpu") from None
    autocast = (torch.autocast(device_type=here["device"], dtype=distributed.DTYPES[dtype])
                if dtype in ("bf16", "fp16") else torch.autocast(here["device"], enabled=False))
    probe = torch.tensor(card["eval"]["probe_tokens"], dtype=torch.long)
    return check_prediction(card, batch_loss(model, probe, device, autocast), here)


def main(argv: list[str] | None = None) -> int:
    """`python evaluation.py validate PATH [--device cpu]`: each committed checkpoint, OK or FAILED. `python
    evaluation.py sample CKPT --prompt TEXT`: text from the checkpoint (sample.py)."""
    global _PARSED
    from checkpoint import setup_logging
    from checkpoint.errors import CheckpointError
    from checkpoint.reader import check_each

    setup_logging()
    try:
        args = _PARSED if argv is None and _PARSED is not None else parse_args(argv)
        _PARSED = None  # taken once
        if args.cmd == "sample":
            import sample  # text from a checkpoint

            return sample.run(args)

        def check(info, manifest: dict) -> tuple[bool, str]:
            ok, line = validate_checkpoint(info.path, manifest, args.device)
            return ok, f"{'OK' if ok else 'FAILED'}: {line}"

        return check_each(args.path, check)
    except (CheckpointError, OSError) as e:  # bad input is one line, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
