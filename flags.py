"""The command line of train.py: every flag, and the checks of their values that need nothing loaded.

Also the rules for flags that differ from the checkpoint's on resume (docs/checkpointing.md "Changing flags on
resume"): which take effect from the resumed step and which are refused.

Imports the stdlib and torch-free modules only (presets, devices, tokenizer's names, the checkpoint package's naming,
walltime, policy and backend_table): train.py parses and checks its flags with this module before it imports torch,
so --help, --version and a mistyped flag answer in a fraction of torch's import time.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import math
import os
import re
import reprlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from checkpoint import naming
from checkpoint import policy as stop_policy
from checkpoint.backend_table import BACKEND_NAMES, combination_refusal
from checkpoint.walltime import parse_walltime
from devices import DEVICES, DTYPE_NAMES
from tokenizer import DEFAULT_TOKENIZER, folder_tokenizer
from presets import ACTIVATION_CHECKPOINTING, PRESETS
from badinput import BadInput  # noqa: F401 - raised here, and flags.BadInput is what callers catch
from datapaths import check_exists, check_val_exists, is_sharded
import schedules

if TYPE_CHECKING:
    import torch

    from checkpoint import RunInfo

VERSION = "0.1.0"  # pyproject.toml's; train.py's __version__, which every checkpoint's card records

def _signal_flag(text: str) -> str:
    try:
        stop_policy.parse_signal(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _model_flag(text: str) -> str:
    if text in PRESETS or os.path.isfile(text):  # False, not OSError, for a name too long to be a path
        return text
    raise argparse.ArgumentTypeError(_model_problem(text))


def _model_problem(text: str) -> str:
    return (f"invalid choice: {text!r} (choose a preset: {', '.join(sorted(PRESETS))}, or give the path of a Hugging "
            "Face Llama config.json)")


def _betas_flag(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two numbers B1,B2 (e.g. 0.9,0.95)") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: each beta must be in [0, 1)")
    return b1, b2


def _walltime_flag(text: str) -> float:
    try:
        return parse_walltime(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line like every other bad input (what, and where to read more), exit 2.
    While ``raise_errors`` is set (reading a --config file) an error raises _ConfigValueError instead, so the caller
    can name the file and the key."""

    raise_errors = False

    def error(self, message: str):
        if self.raise_errors:
            raise _ConfigValueError(message)
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


class _ConfigValueError(Exception):
    pass


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag once (every flag has both spellings, which doubled the help): by the names build_parser
    declares it with (``shown_names``; the reference scripts' --experiment_name, --use_flash_attention), else without
    an --underscore_name whose --dash-name is another name of the same flag. The other spelling is still accepted. Short
    value names (N, NUM, DIR) and no "(default: None)" / "(default: False)" -- a switch is off and an optional value
    unset unless given -- so most help texts start on the flag's own line."""

    def _format_action_invocation(self, action):
        shown = [o for o in action.option_strings if "_" not in o or o.replace("_", "-") not in action.option_strings]
        declared = getattr(action, "shown_names", None)
        if declared:  # in the declared order; BooleanOptionalAction's --no-X names follow their flag's
            shown = [*declared, *(o for o in action.option_strings if o.startswith("--no-")
                                  and o.replace("--no-", "--", 1) in declared)]
        if shown != action.option_strings:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "NUM"}.get(action.type) or action.dest.rsplit("_", 1)[-1].upper()  # ..._dir: DIR

    def _get_help_string(self, action):
        return action.help if action.default in (None, False, "") else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        usage="%(prog)s [--config FILE] [options]  (options below; each also as --flag_name / --flag-name)",
        description="Pre-train a Llama-style transformer with checkpointing that survives walltime, preemption and "
        "failures.",
        formatter_class=_HelpFormatter,
    )

    g = p

    def flag(name: str, *more: str, **kw):
        """Accept both --dash-name and --underscore_name (the reference scripts mix them)."""
        names = set()
        for n in (name, *more):
            body = n[2:]
            names |= {n, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")}
        kw.setdefault("dest", name[2:].replace("-", "_"))
        action = g.add_argument(*sorted(names, key=lambda n: ("_" in n, n)), **kw)
        action.shown_names = (name, *more)  # --help lists these, not the other spelling (_HelpFormatter)
        return action

    p.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    flag("--config", default=None, metavar="FILE",
         help="read flags from a TOML (.toml), YAML (.yaml/.yml) or JSON (.json) file: keys are flag names (either "
              "spelling, dashes optional), values as on the command line (true/false for switches); flags given on "
              "the command line win. The resolved flags go to <run>/config.resolved.json")
    g = p.add_argument_group("data")
    flag("--dataset", default="data/train_data.parquet",
         help="parquet or JSON Lines (.jsonl, .jsonl.gz) file, a folder of *.parquet or of *.jsonl[.gz] shards, or a "
              "quoted glob of them")
    flag("--text-column", default="text", metavar="NAME",
         help="the parquet column / JSON Lines key holding the documents, in every form of --dataset (cannot change "
              "on resume)")
    flag("--data-cache-dir", default=None, metavar="DIR",
         help="folder for the token caches (default: beside the data when writable, else $PYRECOVER_CACHE_DIR or "
              "~/.cache/pyrecover/tokens)")
    flag("--tokenizer-name-or-path", default=DEFAULT_TOKENIZER,
         help="mistral-sp-32k, mistral-tekken, cl100k_base, o200k_base, a local tokenizer.json / HF tokenizer dir, "
              "or a Hugging Face model id (org/name[@revision]) already in the local HF cache (HF_HUB_CACHE / HF_HOME). "
              "Not given with --init-from DIR: DIR's tokenizer.json / tokenizer.model when it has one")
    flag("--force-tokenizer", action="store_true",
         help="train with --tokenizer-name-or-path although its vocabulary is not --init-from's tokenizer's, or "
              "leaves more than 1,024 of its embedding rows unused (the embeddings then mean other tokens)")
    flag("--sequence-length", type=int, default=128, help="tokens per training sample")
    flag("--batch-size", type=int, default=8, help="samples per step PER RANK (global batch = batch-size x ranks)")
    flag("--seed", type=int, default=42, help="seeds model init, data order and every RNG")

    g = p.add_argument_group("model and optimisation")
    flag("--model", type=_model_flag, default=None, metavar="PRESET|CONFIG.json",
         help=f"model preset ({', '.join(sorted(PRESETS))}) or a Hugging Face Llama config.json (its shape; the "
              "vocabulary must hold the tokenizer's). Default: small, or --init-from's config.json")
    flag("--init-from", default=None, metavar="DIR",
         help="a fresh run starts from the Hugging Face Llama weights in DIR (config.json + model.safetensors or "
              "sharded model-*.safetensors), e.g. an export of this program; a resume loads its checkpoint instead")
    flag("--learning-rate", type=float, default=1e-3, help="peak learning rate (AdamW)")
    flag("--lr-warmup-steps", type=int, default=20, help="linear warm-up steps, then --lr-schedule")
    flag("--lr-schedule", default="cosine", choices=list(schedules.SCHEDULES),
         help="after the warm-up: cosine decay to --min-lr-ratio; linear decay to it; wsd (warmup-stable-decay): "
              "stable at the peak, then a linear decay to it over the last --lr-decay-steps; constant: the peak "
              "(schedules.py has the formulas)")
    flag("--lr-decay-steps", type=int, default=None, metavar="N",
         help="wsd: the decay's length in steps (default: --lr-decay-fraction of --training-steps)")
    flag("--lr-decay-fraction", type=float, default=schedules.DEFAULT_DECAY_FRACTION, metavar="F",
         help="wsd: the decay's length as a fraction of --training-steps, unless --lr-decay-steps")
    flag("--min-lr-ratio", type=float, default=0.1, metavar="R",
         help="cosine, linear and wsd decay to R x --learning-rate (constant: unused)")
    flag("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    flag("--adam-betas", type=_betas_flag, default="0.9,0.95", metavar="B1,B2", help="AdamW betas")
    flag("--gradient-accumulation-steps", type=int, default=1, metavar="N",
         help="micro-batches of --batch-size per optimizer step (global batch = batch-size x N x ranks)")
    flag("--training-steps", type=int, default=300, help="total optimizer steps")
    flag("--grad-max-norm", type=float, default=1.0, help="clip the global gradient norm to this (0 = off)")
    flag("--model-dtype", default="auto", choices=["auto", *sorted(DTYPE_NAMES)],
         help="bf16/fp16: autocast with fp32 weights; fp32/fp64: everything in that dtype; auto: bf16 on a GPU (fp32 "
              "where the GPU has no bf16), fp32 on CPU -- resolved at start, the checkpoint records the dtype used")
    flag("--fused-optimizer", action="store_true", help="use the fused AdamW kernel")
    flag("--compile", action="store_true", help="torch.compile the model")
    flag("--deterministic", action="store_true",
         help="torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set), before any "
              "CUDA work: deterministic CUDA kernels, at a cost in speed (an op with none is an error); may change on "
              "resume")
    flag("--activation-checkpointing", default="none", choices=list(ACTIVATION_CHECKPOINTING),
         help="recompute blocks' activations in backward instead of keeping them: full = every transformer block, "
              "selective = one block in --activation-checkpointing-every; same results, less memory, ~1/3 more compute "
              "per recomputed block; may change on resume")
    flag("--activation-checkpointing-every", type=int, default=2, metavar="K",
         help="--activation-checkpointing selective: recompute blocks K, 2K, 3K, ... (K=1 is full)")
    flag("--use_flash_attention", action="store_true", help="flash-attn kernels (CUDA + flash-attn only; no fallback)")

    g = p.add_argument_group("distributed")
    flag("--pg-timeout-seconds", type=float, default=None,
         help="timeout of collectives in the training loop (setup keeps 600 s): how long a hung rank goes unnoticed; "
              "must exceed the longest blocking save. Default: 600")
    flag("--distributed", action="store_true", help="data-parallel over torchrun or srun ranks (NCCL on GPU, gloo on CPU)")
    flag("--device", default="auto", choices=list(DEVICES),
         help="auto: CUDA when torch can use it, else CPU -- but a SLURM job given GPUs (SLURM_GPUS_ON_NODE, "
              "CUDA_VISIBLE_DEVICES) that torch cannot use is refused; cuda: refused without a usable GPU; cpu: "
              "always. May change on resume (the dtype auto resolves to may not)")
    flag("--parallel", default="ddp", choices=["ddp", "fsdp"],
         help="with --distributed: ddp (full replicas) or fsdp (FSDP2 fully_shard per transformer block, then the root: "
              "parameters, gradients and optimizer state sharded over ranks; checkpoints with --checkpoint-backend dcp; "
              "refused without --distributed)")

    g = p.add_argument_group("pre-flight check")
    flag("--check", "--dry-run", action="store_true",
         help="check everything that needs no process group -- flags, --config, paths, the data's files (readable "
              "parquet with a text column; not tokenized), the tokenizer, the memory estimate, the checkpoint folder "
              "(writable) and what --resume-from-checkpoint resolves to -- print a summary and exit 0, or 2 with one "
              "error line; trains nothing, writes nothing, takes no lease")
    flag("--check-world-size", type=int, default=None, metavar="N",
         help="with --check --distributed: the ranks the run will have, for the memory estimate and the global batch "
              "(default: WORLD_SIZE, else SLURM_NTASKS, else 1)")

    g = p.add_argument_group("checkpointing")
    flag("--checkpoint-dir", default="checkpoints", help="checkpoints go to <checkpoint-dir>/<experiment_name>/step-N/")
    flag("--experiment_name", "--exp_name", default="default",
         help="run name: one folder name, no '/' (sub-folder of --checkpoint-dir and --mirror-dir)")
    flag("--checkpoint-frequency", type=int, default=100, help="save every N steps (0 = only at the end)")
    flag("--resume-from-checkpoint", default=None, metavar="latest|STEP|PATH",
         help="resume: `latest` (newest verified checkpoint; starts fresh if there is none), a step, or a path")
    flag("--checkpoint-backend", default="vanilla", choices=list(BACKEND_NAMES),
         help="how checkpoint bytes are written (concurrent: snapshot to host buffers, persist in the background)")
    flag("--max-async", type=int, default=2, metavar="N",
         help="concurrent backend: checkpoints persisting at once (= host buffer sets of the state's size)")
    flag("--use-torch-distributed-ckpt", action="store_true",
         help="alias of --checkpoint-backend dcp (another --checkpoint-backend with it is refused): "
              "torch.distributed.checkpoint, every rank writes its own shard in parallel; loads at any world size; the "
              "only backend for --parallel fsdp and s3:// checkpoint dirs")
    flag("--async-checkpoint", nargs="?", const="thread", default=False, choices=["thread", "process"],
         help="dcp backend: save in the background (dcp.async_save on its own gloo group); training waits only for "
              "the state copy, right before the next optimizer step; one save in flight. `process` (`thread` when "
              "given alone): serialize and write in DCP's background save process instead of a thread of the "
              "training process (no GIL contention; the process starts at the first save)")
    flag("--max-kept-checkpoints", type=int, default=3, help="keep the newest K committed checkpoints (0 = keep all)")
    flag("--keep-every", type=int, default=0, help="also keep every checkpoint whose step is a multiple of N")
    flag("--timeaware-checkpointing", action="store_true", help="save and stop before the SLURM walltime runs out")
    flag("--force-takeover", action="store_true",
         help="take the run directory over even if another live run holds it (one writer per run directory; the "
              "other run is fenced: it can no longer commit or delete anything, and stops); only after this start's "
              "flags passed every check, the resumed checkpoint's included")
    flag("--on-save-error", default="stop", choices=["stop", "continue"],
         help="a save that fails (e.g. disk full; the previous checkpoint stays intact and `latest`): stop = exit 1 at "
              "once; continue = warn, keep training, retry at the next interval (exit 1 if the final save fails)")
    flag("--jit-checkpoint", action="store_true",
         help="just-in-time checkpoint: if a rank fails mid-step, a surviving rank saves the last completed step and "
              "exits with code 3 (requeue); a rerun replays at most one step (see checkpoint/jit.py)")

    g = p.add_argument_group("stopping in time (SLURM): signals, walltime, requeue -- see checkpoint/policy.py")
    flag("--signal", type=_signal_flag, default="SIGUSR1",
         help="signal meaning 'save at the next step boundary, stop, requeue' (SLURM's --signal warning; `none` = off; "
              "one that cannot be caught or arrives in normal operation, e.g. KILL, STOP, CHLD, is refused); SIGTERM "
              "is always 'save and stop' (no requeue)")
    flag("--walltime", type=_walltime_flag, default=None, metavar="[D-]HH:MM:SS",
         help="with --timeaware-checkpointing: a deadline counted from the start of train.py, for runs without a "
              "SLURM time limit (under SLURM the job's end time is read from squeue; the earlier one wins)")
    flag("--walltime-margin-seconds", type=float, default=60.0,
         help="--timeaware-checkpointing stops when time left < longest save + 3 x step time + this margin")
    flag("--checkpoint-interval-minutes", type=float, default=0.0,
         help="also save every N minutes of wall-clock time (0 = off; 10-15 is the usual HPC advice)")
    flag("--requeue", action=argparse.BooleanOptionalAction, default=None,
         help="after a signal/walltime stop, `scontrol requeue` the job once the checkpoint has committed "
              "(default: on in a SLURM job, off in a job array task, whose next task resumes instead)")
    flag("--max-restarts", type=int, default=100, help="do not requeue once SLURM_RESTART_COUNT reaches this")

    g = p.add_argument_group("node-local tier: fast saves on every node, drained to --checkpoint-dir -- see "
                             "checkpoint/places/tier.py")
    flag("--local-checkpoint-dir", default=None, metavar="DIR",
         help="a folder on each node (/dev/shm/..., a local NVMe): every save lands there first, each rank its own "
              "part; every --checkpoint-frequency-th step (and the final or stop save) is then drained in the "
              "background to --checkpoint-dir, the shared tier; `latest` resumes from the nearest tier")
    flag("--local-checkpoint-frequency", type=int, default=0, metavar="N",
         help="with --local-checkpoint-dir: save to the local tier every N steps (0 = at the shared frequency); "
              "--checkpoint-frequency must be a multiple")
    flag("--local-checkpoint-keep", type=int, default=2, metavar="K",
         help="with --local-checkpoint-dir: each rank keeps its newest K local steps")
    flag("--peer-checkpoint", action="store_true",
         help="with --local-checkpoint-dir: also keep every local step of a node on the next node (its buddy), sent "
              "in the background, so losing a node loses nothing newer than --local-checkpoint-frequency")

    g = p.add_argument_group("mirror: a second location for checkpoints -- see checkpoint/places/mirror.py")
    flag("--mirror-dir", default=None, metavar="DIR|s3://BUCKET/PREFIX",
         help="also copy committed checkpoints to <mirror-dir>/<experiment_name>/ in the background (committed and "
              "verified there); a failing mirror warns and never stops training; `latest` looks in both locations")
    flag("--mirror-every", type=int, default=1, metavar="K",
         help="mirror every K-th checkpoint's step (steps that are multiples of K); the final checkpoint always")
    flag("--mirror-keep", type=int, default=None, metavar="K",
         help="keep the newest K committed checkpoints in the mirror (0 = keep all; default: --max-kept-checkpoints)")
    flag("--mirror-timeout", type=float, default=600.0, metavar="SECONDS",
         help="at the end, wait at most this long for the final checkpoint to reach the mirror")

    g = p.add_argument_group("documented and validated checkpoints -- see evaluation.py")
    flag("--eval-windows", type=int, default=2, metavar="N",
         help="hold the last N windows of the data out of training; at every save their loss (the probe: the first "
              "2) goes into the checkpoint's card, one forward pass of 2 windows per 2 held out (0 = no held-out data: "
              "no probe, no eval loss, no --keep-best; with --keep-best give 16 or more for a steadier ranking)")
    flag("--keep-best", type=int, default=0, metavar="K",
         help="retention also keeps the K checkpoints with the lowest held-out eval loss -- the val loss with "
              "--val-dataset/--val-fraction (`python -m checkpoint list` marks them)")
    flag("--val-dataset", default=None, metavar="PATH",
         help="a separate validation set, in --dataset's forms (file, folder of shards, quoted glob), tokenized alike; "
              "evaluations read it instead of the held-out windows (the probe is its first 2 windows); training is "
              "unchanged by it, so it may be added or changed on resume")
    flag("--val-fraction", type=float, default=None, metavar="F",
         help="hold the last fraction F (0 < F < 1) of the data's windows out of training as the validation set, "
              "instead of --eval-windows N (it cannot change on resume)")
    flag("--eval-every", type=int, default=0, metavar="N",
         help="evaluate the validation set every N steps: one log line, a row of val.csv beside the loss CSV, val/loss "
              "and val/ppl in the trackers (0 = only at checkpoint saves, into the card)")
    flag("--eval-tokens", type=int, default=None, metavar="T",
         help="each evaluation reads the first T tokens' worth of windows of the validation set, the same ones every "
              "time (0 = all; default: all, at most 1048576 tokens)")
    flag("--validate-on-resume", action="store_true",
         help="after loading, recompute the probe loss and compare it with the card's (bitwise on the saving layout); "
              "a mismatch stops with exit 2")
    flag("--checkpoint-note", default="", metavar="TEXT", help="a note stored in every checkpoint's card")

    g = p.add_argument_group("logging")
    flag("--logging-frequency", type=int, default=10, help="progress-bar/log update every N steps")
    flag("--log-loss-to-csv", nargs="?", const="auto", default=None, metavar="PATH",
         help="one row per step; default path <checkpoint-dir>/<experiment_name>/loss.csv (a PATH's folder must "
              "exist, or be the checkpoint or run folder); appends on resume")
    flag("--profile", action="store_true", help="record a torch.profiler trace between the profile steps")
    flag("--profile-step-start", type=int, default=10, help="first profiled step")
    flag("--profile-step-end", type=int, default=12, help="last profiled step")
    flag("--tracker", action="append", default=None, metavar="NAME",
         help="also log metrics to tensorboard and/or wandb (repeat the flag or comma-separate); rank 0 only; every "
              "step exactly once across resumes, like the loss CSV (trackers.py)")
    flag("--tracker-dir", default=None, metavar="DIR",
         help="where tracker files go (<DIR>/tensorboard, <DIR>/wandb); default the run folder, or "
              "logs/<experiment_name> for an s3:// --checkpoint-dir")
    flag("--wandb-project", default=None, metavar="NAME", help="W&B project (default: WANDB_PROJECT, else W&B's)")
    flag("--wandb-name", default=None, metavar="NAME", help="W&B run name (default: WANDB_NAME, else the experiment name)")
    return p



# Every numeric flag: (dest, lowest allowed value, whether that value itself is allowed). Floats must also be finite.
NUMERIC_FLAGS: tuple[tuple[str, float, bool], ...] = (
    ("sequence_length", 1, True), ("batch_size", 1, True), ("seed", 0, True), ("learning_rate", 0, False),
    ("lr_warmup_steps", 0, True), ("training_steps", 1, True), ("grad_max_norm", 0, True),
    ("pg_timeout_seconds", 0, False), ("checkpoint_frequency", 0, True), ("max_async", 1, True),
    ("max_kept_checkpoints", 0, True), ("keep_every", 0, True), ("walltime_margin_seconds", 0, True),
    ("checkpoint_interval_minutes", 0, True), ("max_restarts", 0, True), ("logging_frequency", 1, True),
    ("profile_step_start", 1, True), ("profile_step_end", 1, True), ("eval_windows", 0, True), ("keep_best", 0, True),
    ("val_fraction", 0, False), ("eval_every", 0, True), ("eval_tokens", 0, True),
    ("mirror_every", 1, True), ("mirror_keep", 0, True), ("mirror_timeout", 0, False),
    ("min_lr_ratio", 0, True), ("weight_decay", 0, True), ("gradient_accumulation_steps", 1, True),
    ("activation_checkpointing_every", 1, True),
    ("local_checkpoint_frequency", 0, True), ("local_checkpoint_keep", 1, True), ("check_world_size", 1, True),
    ("lr_decay_steps", 1, True), ("lr_decay_fraction", 0, False),
)


#: The checkpoint package's messages name its settings (checkpoint.naming); on this command line they are these flags,
#: so a refusal names what the user typed. Keys: checkpoint.Settings fields (``when.*``: policy.When) and the few
#: names the package's messages use for train.py's own choices (``resume``, ``model``, ``max_async``).
SETTING_FLAGS = {
    "checkpoint_dir": "--checkpoint-dir", "experiment": "--experiment_name", "backend": "--checkpoint-backend",
    "sharded": "--parallel fsdp", "async_save": "--async-checkpoint", "jit": "--jit-checkpoint",
    "max_async": "--max-async", "mirror_dir": "--mirror-dir", "mirror_timeout_s": "--mirror-timeout",
    "force_takeover": "--force-takeover", "on_save_error": "--on-save-error", "local_dir": "--local-checkpoint-dir",
    "local_every": "--local-checkpoint-frequency", "local_keep": "--local-checkpoint-keep",
    "peer": "--peer-checkpoint", "when.every_steps": "--checkpoint-frequency", "when.walltime_s": "--walltime",
    "when.max_restarts": "--max-restarts", "when.requeue": "--requeue", "resume": "--resume-from-checkpoint",
    "model": "--model",
}
#: ... and the values this command line spells otherwise than flag and value (a switch that is on is its flag alone)
SETTING_VALUES = {
    ("when.requeue", "False"): "--no-requeue",
    ("backend", "dcp"): "--checkpoint-backend dcp (or --use-torch-distributed-ckpt)",
}


def spell_settings() -> None:
    """From here on, the checkpoint package's messages name this command line's flags (train.py calls it first)."""
    naming.spell_as(SETTING_FLAGS, SETTING_VALUES)


def check_flags(args: argparse.Namespace, *, writes_csv: bool = True) -> None:
    """Everything wrong with the flags that needs nothing loaded, one line each: numbers, combinations, paths.
    ``writes_csv``: this rank writes the loss CSV (rank 0), so its path is checked here."""
    check_numeric_flags(args)
    if args.parallel == "fsdp" and not args.distributed:
        raise BadInput("--parallel fsdp shards the model over the ranks of a --distributed run, and this is one "
                       "process; add --distributed (under torchrun or srun), or drop --parallel fsdp")
    if args.check_world_size is not None and not args.check:
        raise BadInput("--check-world-size sizes a --check (the ranks a run has come from its launcher); add --check, "
                       "or drop it")
    check_paths(args, writes_csv=writes_csv)
    if args.init_from is not None and not os.path.isdir(args.init_from):
        raise BadInput(f"--init-from {args.init_from} is not a folder; give a Hugging Face Llama model folder")
    default_model(args)
    if args.model not in PRESETS and not os.path.isfile(args.model):
        raise BadInput(f"--model: {_model_problem(args.model)}")
    check_schedule(args)


def check_backend(args: argparse.Namespace) -> None:
    """The checkpoint backend can do what the flags ask: the refusal checkpoint.Session gives for the same settings
    (train.checkpoint_settings), from the backends' table alone, so it comes before torch loads."""
    if why := combination_refusal(args.checkpoint_backend, sharded=args.distributed and args.parallel == "fsdp",
                                  checkpoint_dir=args.checkpoint_dir, async_save=args.async_checkpoint,
                                  jit=args.jit_checkpoint, local_tier=bool(args.local_checkpoint_dir)):
        raise BadInput(why)


def check_data_paths(args: argparse.Namespace) -> None:
    """--dataset and --val-dataset, where each names one file, are there (DataError: the loaders' line); what is in
    them is read later, by the loaders (the shards of a folder or glob too)."""
    if not is_sharded(args.dataset):
        check_exists(Path(args.dataset))
    if args.val_dataset is not None:
        check_val_exists(args.val_dataset)


def check_schedule(args: argparse.Namespace) -> None:
    """wsd's warm-up and decay must fit in the run (its stable phase would be negative: no schedule at all)."""
    if args.lr_schedule != "wsd":
        return
    decay = schedules.decay_steps(args.training_steps, args.lr_decay_steps, args.lr_decay_fraction)
    if args.lr_warmup_steps + decay > args.training_steps:
        given = (f"--lr-decay-steps {decay}" if args.lr_decay_steps is not None else
                 f"{decay} decay step(s) (--lr-decay-fraction {args.lr_decay_fraction:g})")
        raise BadInput(f"--lr-schedule wsd: --lr-warmup-steps {args.lr_warmup_steps} + {given} exceed "
                       f"--training-steps {args.training_steps}; shorten the warm-up or the decay, or train longer")


def schedule_warning(args: argparse.Namespace) -> str | None:
    """A warm-up longer than the run: legal (a first leg of a run that a resume lengthens with --training-steps; the
    test suite's short runs), but the learning rate never reaches --learning-rate. One warning line, or None."""
    if args.lr_warmup_steps > args.training_steps and args.lr_schedule != "wsd":  # wsd: refused by check_schedule
        return (f"warning: --lr-warmup-steps {args.lr_warmup_steps} exceeds --training-steps {args.training_steps}: "
                f"the learning rate never reaches --learning-rate {args.learning_rate:g} (it ends at "
                f"{args.training_steps / args.lr_warmup_steps:.0%} of it); if that is not meant, give fewer "
                "--lr-warmup-steps than --training-steps")
    return None


# Flags naming a path (or a name that becomes part of one): an empty value would silently mean the current folder,
# or nothing at all (no resume, no mirror, no CSV). (dest, what to give instead)
PATH_FLAGS = (("dataset", "a parquet file, a folder of them or a glob"), ("data_cache_dir", "a folder"),
              ("text_column", "the name of the column holding the documents"),
              ("tokenizer_name_or_path", "a tokenizer name or path"),
              ("checkpoint_dir", "a folder or s3://bucket/prefix"), ("experiment_name", "a run name"),
              ("resume_from_checkpoint", "`latest`, a step or a path"),
              ("mirror_dir", "a folder or s3://bucket/prefix"), ("model", "a preset or a config.json"),
              ("local_checkpoint_dir", "a folder on each node"),
              ("init_from", "a Hugging Face model folder"),
              ("val_dataset", "a parquet file, a folder of them or a glob"),
              ("log_loss_to_csv", "a file path, or the flag alone for <checkpoint-dir>/<experiment_name>/loss.csv"))


def check_paths(args: argparse.Namespace, *, writes_csv: bool = True) -> None:
    """Every path the run will write under is what it says, before anything is taken or written: not empty, the
    experiment name one plain folder name (so the run stays inside --checkpoint-dir and --mirror-dir), and the loss
    CSV a file in an existing folder, or in --checkpoint-dir or the run folder, which the run makes (a mistyped folder
    is refused, not created)."""
    for dest, what in PATH_FLAGS:
        value = getattr(args, dest, None)
        if value is not None and not value.strip():
            raise BadInput(f"--{dest.replace('_', '-')} is empty; give {what}")
    name = args.experiment_name
    if "/" in name or name in (".", ".."):
        raise BadInput(f"--experiment_name {name!r} is not a plain folder name: the run goes to "
                       f"<--checkpoint-dir>/<experiment_name>/, and a '/', '.' or '..' would put it elsewhere; give "
                       f"one name without '/', e.g. --experiment_name run1")
    if writes_csv and args.log_loss_to_csv not in (None, "auto"):
        csv = Path(args.log_loss_to_csv)
        if csv.is_dir():
            raise BadInput(f"--log-loss-to-csv {csv} is a folder; give a file path, e.g. --log-loss-to-csv "
                           f"{csv / 'loss.csv'}")
        made_by_the_run = {os.path.abspath(d) for d in (args.checkpoint_dir, Path(args.checkpoint_dir, name))}
        if not csv.parent.is_dir() and os.path.abspath(csv.parent) not in made_by_the_run:
            raise BadInput(f"--log-loss-to-csv {csv}: the folder {csv.parent} does not exist; create it or give a "
                           "path in an existing folder (or in the run's own folder)")


def check_numeric_flags(args: argparse.Namespace) -> None:
    """Refuse a non-finite or out-of-range number in one line, before anything is loaded."""
    for dest, lowest, inclusive in NUMERIC_FLAGS:
        value = getattr(args, dest, None)
        if value is None:  # optional flag not given (e.g. --pg-timeout-seconds)
            continue
        flag = "--" + dest.replace("_", "-")
        need = f"{'>=' if inclusive else '>'} {lowest:g}"
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{flag} {value} is not a finite number; give a number {need}")
        if value < lowest or (value == lowest and not inclusive):
            raise BadInput(f"{flag} {value:g} is out of range; give a number {need}")
    if args.lr_decay_fraction > 1:
        raise BadInput(f"--lr-decay-fraction {args.lr_decay_fraction:g} is out of range; give a fraction of "
                       "--training-steps between 0 and 1")
    if args.min_lr_ratio > 1:
        raise BadInput(f"--min-lr-ratio {args.min_lr_ratio:g} is out of range; give a fraction of the peak learning "
                       "rate between 0 and 1")
    if args.seed >= 2**63:
        raise BadInput(f"--seed {args.seed} is too large; give a number below 2**63")
    if args.val_fraction is not None and args.val_fraction >= 1:
        raise BadInput(f"--val-fraction {args.val_fraction:g} is out of range; give a fraction of the data between 0 "
                       "and 1 (e.g. 0.01)")
    if args.val_fraction is not None and args.val_dataset is not None:
        raise BadInput("--val-dataset and --val-fraction both give a validation set; give one of them")
    has_val = args.eval_windows > 0 or args.val_fraction is not None or args.val_dataset is not None
    if args.eval_every and not has_val:
        raise BadInput(f"--eval-every {args.eval_every} needs validation data, but there is none (--eval-windows 0, no "
                       "--val-dataset or --val-fraction); give --val-dataset PATH or --val-fraction F (e.g. 0.01)")
    if not has_val and (args.keep_best or args.validate_on_resume):
        need = "--keep-best" if args.keep_best else "--validate-on-resume"
        raise BadInput(f"{need} needs held-out data, but --eval-windows is 0; give --eval-windows N (e.g. 16), "
                       "--val-dataset or --val-fraction")
    if args.profile and args.profile_step_end < args.profile_step_start:
        raise BadInput(f"--profile-step-end {args.profile_step_end} is before --profile-step-start "
                       f"{args.profile_step_start}; give an end step >= the start step")


# Flags that may differ from the checkpoint's on resume (docs/checkpointing.md "Changing flags on resume"). Listed in
# neither: free to change, silently (paths, logging, --device -- the dtype `--model-dtype auto` resolves to on the new
# device is compared, as model_dtype, below -- and --check / --check-world-size, which never train). APPLIED:
# they take effect from the resumed step on, each named in one line. REFUSED (with why): the checkpoint's weights, data
# position and RNG were made with the saved value, so a new one could not apply -- exit 2 instead of a half-applied run.
RESUME_APPLIED = ("val_dataset", "eval_every", "eval_tokens",  # evaluation only: training reads none of them
                  "learning_rate", "lr_warmup_steps", "training_steps", "grad_max_norm", "fused_optimizer", "compile",
                  "deterministic",  # kernels: from the resumed step on, bitwise neither a run with nor one without
                  "activation_checkpointing", "activation_checkpointing_every",  # memory and time, not results
                  "batch_size", "lr_schedule", "lr_decay_steps", "lr_decay_fraction")
RESUME_REFUSED = (("model", "the weights are that model's"),
                  ("tokenizer_name_or_path", "the embeddings and the data position are that tokenizer's"),
                  ("text_column", "the data position counts windows of that column's documents"),
                  ("sequence_length", "the data position counts windows of that length"),
                  ("seed", "the data order and every RNG continue from the checkpoint"),
                  ("model_dtype", "the weights and optimizer state were trained in it"),
                  ("eval_windows", "the held-out windows are cut from the training data and its order"),
                  ("val_fraction", "the validation windows are cut from the training data and its order"),
                  ("weight_decay", "the optimizer state was made with it"),
                  ("adam_betas", "the optimizer's moment estimates were averaged with them"),
                  ("min_lr_ratio", "the schedule the run follows ends there"),
                  ("gradient_accumulation_steps", "the data position and the schedule count optimizer steps of "
                                                  "that many micro-batches"))


# A refused flag the checkpoint does not record: the value the version that wrote it behaved as.
ABSENT_MEANS = {"eval_windows": 0,  # before held-out data, training read every window
                "text_column": "text",  # before --text-column, the only column read
                "val_fraction": None,
                "weight_decay": 0.1, "adam_betas": [0.9, 0.95], "min_lr_ratio": 0.1, "gradient_accumulation_steps": 1,
                # applied flags too: a new schedule on an older checkpoint is named and re-applied like any other
                "lr_schedule": "cosine", "lr_decay_steps": None, "lr_decay_fraction": schedules.DEFAULT_DECAY_FRACTION}


def _saved_config(run_info: RunInfo) -> dict:
    saved = getattr(run_info, "saved", {}).get("config", {})
    # a checkpoint of a version that predates a flag was saved with what that version did
    return ABSENT_MEANS | saved if saved else saved


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _shown(value):
    if value is None:  # an optional flag not given (--lr-decay-steps)
        return "unset"
    if isinstance(value, (list, tuple)):  # --adam-betas, as typed
        return ",".join(f"{v:g}" for v in value)
    return ("on" if value else "off") if isinstance(value, bool) else value


def _same(saved, now) -> bool:
    return list(saved) == list(now) if isinstance(now, tuple) and isinstance(saved, list) else saved == now


def check_resume_flags(args: argparse.Namespace, run_info: RunInfo, step: int | None) -> None:
    """Raise BadInput if these flags cannot continue the checkpoint saved with ``run_info.saved`` at ``step``: a
    refused flag differs (RESUME_REFUSED), or --training-steps ends before the step. ``step`` None: only the refused
    flags. Needs nothing but the checkpoint's run_info, so train.py also calls it before taking a run over."""
    saved = _saved_config(run_info)
    for key, why in RESUME_REFUSED:
        if key in saved and not _same(saved[key], getattr(args, key)):
            raise BadInput(f"{_flag(key)} {_shown(getattr(args, key))} differs from the checkpoint's "
                           f"{_shown(saved[key])} and cannot change on resume ({why}); resume with {_flag(key)} "
                           f"{_shown(saved[key])}, or start a new --experiment_name")
    if step is not None and args.training_steps < step:
        raise BadInput(f"checkpoint is at step {step} but --training-steps {args.training_steps} ends before it; pass "
                       f"--training-steps {step} or more, or start a new --experiment_name")


def apply_resume_flags(args: argparse.Namespace, run_info: RunInfo, step: int | None,
                       optimizer: torch.optim.Optimizer, scheduler) -> list[str]:
    """Compare the flags with the ones the loaded checkpoint was saved with (``run_info.saved``, the same on every rank):
    raise BadInput for a refused difference (check_resume_flags), apply the others and return one 'resume: applying'
    line each. Nothing differs: nothing is touched (the resumed run stays bitwise an uninterrupted one). ``step`` None:
    a load that failed part-way, only the refusals are checked (run_info loads first, so another --model is named, not
    its tensor shapes)."""
    check_resume_flags(args, run_info, step)
    if step is None:
        return []
    saved = _saved_config(run_info)
    changed = [k for k in RESUME_APPLIED if k in saved and saved[k] != getattr(args, k)]
    if {"learning_rate", "lr_warmup_steps", "training_steps", "lr_schedule", "lr_decay_steps",
            "lr_decay_fraction"} & set(changed):
        # LambdaLR's state restored the old base lr and the optimizer the old step's lr; the lambda is the current
        # flags'. Set both so step s runs at learning_rate * lambda(s), as a fresh run with these flags would.
        scheduler.base_lrs = [args.learning_rate] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"] = args.learning_rate
            group["lr"] = args.learning_rate * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    if "fused_optimizer" in changed:  # the loaded param groups carry the saved run's choice
        for group in optimizer.param_groups:
            group["fused"] = True if args.fused_optimizer else None
    return [f"resume: applying {_flag(k)} {_shown(getattr(args, k))} (checkpoint had {_shown(saved[k])})"
            for k in changed]


CONFIG_SUFFIXES = (".toml", ".yaml", ".yml", ".json")
RESOLVED_CONFIG = "config.resolved.json"  # in the run folder: every flag's final value (a valid --config file)

# What a flag's value in a --config file may be: one scalar, or for a flag that takes several values a flat list of
# them. Anything else is refused by its type alone, before any of it is formatted into a message.
_SCALARS = (str, int, float, datetime.date, datetime.time)  # bool is an int; TOML and YAML give dates and times
_QUOTE = reprlib.Repr()  # an error line quotes at most this much of a bad key or value from a file
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = 60
_QUOTE.maxlist = _QUOTE.maxdict = _QUOTE.maxset = _QUOTE.maxtuple = 4
_QUOTE.maxlevel = 2


def _quote(value) -> str:
    return _QUOTE.repr(value)


class _Pairs(dict):
    """A mapping read from a file that also keeps its (key, value) pairs as written: json.loads and a YAML loader
    alone keep the last value of a repeated key, silently."""

    def __init__(self, pairs: list):
        super().__init__(pairs)
        self.pairs = pairs


def _yaml_top(text: str, path: str):
    """A YAML file's top-level mapping (_Pairs: a repeated key kept twice), or the document itself when it is not a
    mapping (None when empty). An alias (``*name``) is refused while the file is composed, before anything is built
    from it: a few nested aliases expand a file of a few hundred bytes into gigabytes."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise BadInput(f"--config {path}, line {event.start_mark.line + 1}: YAML aliases "
                               f"(*{event.anchor[:40]}) are not accepted (a few can expand a small file into "
                               "gigabytes); write the value out")
            return super().compose_node(parent, index)

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if not isinstance(node, yaml.MappingNode):
            return None if node is None else loader.construct_document(node)
        return _Pairs([(loader.construct_object(k, deep=True), loader.construct_object(v, deep=True))
                       for k, v in node.value])
    finally:
        loader.dispose()


def _read_config_file(path: str) -> list[tuple]:
    """The file's top-level (key, value) pairs in file order, a repeated key as often as it is written; anything
    unreadable is a BadInput line naming the file."""
    suffix = Path(path).suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise BadInput(f"--config {path}: unknown file type {suffix or '(none)'}; give a .toml, .yaml/.yml or .json "
                       "file")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise BadInput(f"--config {path}: cannot read it ({e.strerror or e}); check the path") from None
    try:
        if suffix == ".toml":  # TOML itself refuses a repeated key
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
        elif suffix == ".json":
            import json

            data = json.loads(raw.decode("utf-8"), object_pairs_hook=_Pairs)
        else:
            try:
                import yaml  # noqa: F401
            except ImportError:  # a dependency of the project; only a hand-made environment lacks it
                raise BadInput(f"--config {path}: reading YAML needs PyYAML; run: pip install pyyaml (or use a "
                               ".toml file)") from None
            data = _yaml_top(raw.decode("utf-8"), path)
    except BadInput:
        raise
    except Exception as e:  # the parsers' errors name the line; keep only their first line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BadInput(f"--config {path} is not valid {suffix[1:].upper()}: {first[:300]}") from None
    if data is None:  # an empty YAML file
        return []
    if isinstance(data, _Pairs):
        return data.pairs
    if not isinstance(data, dict):
        raise BadInput(f"--config {path}: expected keys with values (flag = value), got a {type(data).__name__}")
    return list(data.items())


def _kind(value) -> str:
    return ("table" if isinstance(value, dict) else "list" if isinstance(value, list) else
            "null" if value is None else type(value).__name__)


def _shape_problem(action: argparse.Action, value) -> str | None:
    """Why ``value`` cannot be ``action``'s value, judged by its type alone: one scalar, or a flat list of scalars
    for a flag that takes several values (nargs N, + or *; an append flag)."""
    if isinstance(value, _SCALARS):
        return None
    if isinstance(value, list):
        if action.nargs in (None, "?", 0) and not isinstance(action, argparse._AppendAction):
            return f"expected one value, got a list of {len(value)}"
        bad = next((v for v in value if not isinstance(v, _SCALARS)), _SCALARS)
        return None if bad is _SCALARS else f"expected a list of values, got a {_kind(bad)} in the list"
    return f"expected a value, got a {_kind(value)}"


def _config_tokens(action: argparse.Action, option: str, value) -> list[str]:
    """The command-line words that give ``value`` (a scalar or a list of scalars: _shape_problem) to ``action``
    (named ``option``), so argparse itself converts and checks it exactly as on the command line (types, choices,
    custom flag parsers). A switch takes true/false; [] means 'as if not given'."""
    if action.nargs == 0:  # store_true/false, BooleanOptionalAction, store_const
        if not isinstance(value, bool):
            raise _ConfigValueError(f"expected true or false, got {_quote(value)}")
        if isinstance(action, argparse.BooleanOptionalAction):  # false is explicit: --no-requeue (or --requeue)
            other = option.replace("--no-", "--", 1) if option.startswith("--no-") else "--no-" + option[2:]
            return [option if value else other]
        return [option] if value else []
    if isinstance(value, bool) and action.nargs != "?":
        raise _ConfigValueError(f"expected a value, not {str(value).lower()}")
    if action.nargs == "?" and isinstance(value, bool):  # --log-loss-to-csv = true: the flag alone
        return [option] if value else []
    if isinstance(value, list):
        if action.nargs in (None, "?"):  # an append flag
            return [f"{option}={v}" for v in value]
        return [option, *map(str, value)]
    # '--flag=value': a value may start with '-'
    return [f"{option}={value}"] if action.nargs in (None, "?") else [option, str(value)]


def load_config(parser: argparse.ArgumentParser, path: str) -> dict:
    """dest -> value of every flag ``path`` sets. Keys are flag names in either spelling, with or without the leading
    dashes (``learning_rate``, ``learning-rate``, ``--learning-rate``); each value goes through argparse as on the
    command line. Unknown keys, a flag set twice and bad values: BadInput naming the file and the key. Generic over
    the parser's actions, so a flag added to build_parser is settable from a file with no change here."""
    values: dict = {}
    given: dict[str, object] = {}  # dest -> the key that set it
    parser.raise_errors = True
    try:
        for key, value in _read_config_file(path):
            option = "--" + str(key).lstrip("-")
            action = parser._option_string_actions.get(option)  # exact names only: no prefix matching in a file
            if action is None or action.dest in (argparse.SUPPRESS, "config", "help", "version"):
                why = "cannot name another config file" if action is not None and action.dest == "config" else \
                    "is not a flag of train.py (see --help)"
                raise BadInput(f"--config {path}: key {_quote(key)} {why}")
            if action.dest in given:  # the last would silently win
                again = "is repeated" if given[action.dest] == key else \
                    f"sets --{action.dest.replace('_', '-')} a second time (after {_quote(given[action.dest])})"
                raise BadInput(f"--config {path}: key {_quote(key)} {again}; keep one")
            given[action.dest] = key
            if value is None:  # YAML null / JSON null: the flag's default, as if the key were absent
                continue
            try:
                if problem := _shape_problem(action, value):
                    raise _ConfigValueError(problem)
                words = _config_tokens(action, option, value)
                if words:
                    values[action.dest] = getattr(parser.parse_args(words, argparse.Namespace()), action.dest)
            except _ConfigValueError as e:
                message = re.sub(r"^argument [^:]*: ", "", str(e))
                for text in map(str, value if isinstance(value, list) else [value]):  # argparse quotes it whole
                    if len(text) > _QUOTE.maxstring:
                        message = message.replace(repr(text), _quote(text))
                raise BadInput(f"--config {path}: key {_quote(key)}: {message}") from None
    finally:
        parser.raise_errors = False
    # The file's numbers on their own (with the defaults for the rest) pass the same checks as the command line's, so
    # a bad one is named with its file; combinations with command-line flags are checked later, in check_flags.
    try:
        check_numeric_flags(parser.parse_args([], argparse.Namespace(**values)))
    except BadInput as e:
        raise BadInput(f"--config {path}: {e}") from None
    return values


# dest -> the text a flag with its own parser (--walltime "1:00:00" -> 3600.0 seconds) was given, by the last
# parse_args: the resolved config stores that text, which parses again to the same value (3600.0 would not).
_given_text: dict[str, tuple[str, object]] = {}


def _remember_text(parse, dest: str):
    @functools.wraps(parse)  # argparse names the type in its errors ("invalid _walltime_flag value")
    def remembered(text: str):
        value = parse(text)
        _given_text[dest] = (text, value)
        return value

    return remembered


def resolved_config(args: argparse.Namespace) -> bytes:
    """Every flag's final value as JSON (command line, config file and defaults resolved): the run folder's
    config.resolved.json, itself a valid --config file."""
    import json

    values = {}
    for key, value in sorted(vars(args).items()):
        text, parsed = _given_text.get(key, (None, None))
        values[key] = text if text is not None and parsed == value else value
    values.pop("config", None)
    return (json.dumps(values, indent=1, default=str) + "\n").encode()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    _given_text.clear()
    for action in parser._actions:
        if callable(action.type) and action.type not in (int, float, str):
            action.type = _remember_text(action.type, action.dest)
    argv = sys.argv[1:] if argv is None else list(argv)
    # A value already in the namespace is not replaced by the default: None stays when --checkpoint-backend is not
    # given, so its alias can tell an explicit backend from the default. A --config file's values go in the same way:
    # a flag on the command line overrides them, a flag given nowhere gets its default.
    preset = argparse.Namespace(checkpoint_backend=None, tokenizer_name_or_path=None)
    config = parser.parse_known_args(argv)[0].config
    if config is not None:
        try:
            vars(preset).update(load_config(parser, config))
        except BadInput as e:
            parser.exit(2, f"error: {e}\n")
    args = parser.parse_args(argv, preset)
    if args.use_torch_distributed_ckpt:  # the reference scripts' alias
        if args.checkpoint_backend not in (None, "dcp"):
            parser.error(f"--use-torch-distributed-ckpt means --checkpoint-backend dcp, but --checkpoint-backend "
                         f"{args.checkpoint_backend} was given too; pass only one of them")
        args.checkpoint_backend = "dcp"
    args.checkpoint_backend = args.checkpoint_backend or parser.get_default("checkpoint_backend")
    default_model(args)
    default_tokenizer(args)
    return args


def default_tokenizer(args: argparse.Namespace) -> None:
    """--tokenizer-name-or-path given nowhere (None): --init-from's own tokenizer when its folder has one -- its
    weights' embeddings are that tokenizer's ids -- else the default. train.py compares an explicit one with it."""
    if args.tokenizer_name_or_path is None:
        found = folder_tokenizer(args.init_from) if args.init_from and os.path.isdir(args.init_from) else None
        args.tokenizer_name_or_path = found or DEFAULT_TOKENIZER


def default_model(args: argparse.Namespace) -> None:
    """--model not given: the shape --init-from's weights have, else the default preset."""
    if args.model is None:
        args.model = str(Path(args.init_from) / "config.json") if args.init_from else "small"
