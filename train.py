"""PyRecover: pre-train a Llama-style transformer that never loses work.

    python train.py --model small                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 train.py --distributed --model 1b   # DDP, one rank per GPU
    sbatch submit-training-simple.sh --distributed                  # SLURM, see docs/slurm.md

Reads top to bottom: preflight (bad input refused before any training time is spent) -> the run (model, optimizer,
data) -> checkpointing (the state; a checkpoint.Session resumes and decides when to save) -> the loop -> finish. The
flags are in flags.py, what is reported per step in metrics.py, the parallelism transform in distributed.py, and
checkpointing in checkpoint/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

_PARSED: argparse.Namespace | None = None  # the flags train.py's first lines parsed, run as a program (main takes them)
if __name__ == "__main__":
    # SLURM's warning signal can come while the imports below run (seconds; tens on a busy node), and its default
    # action kills the process: hold USR1/USR2 pending until the stop policy's handlers exist (SignalWatcher.install
    # releases them, and a held signal is delivered to the handler then).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})  # policy.HELD_SIGNALS, before any import
    # Ctrl-C or SIGTERM during the imports: nothing to save yet -- one line and 128 + the signal as SignalWatcher does
    # later (its handlers replace these), no traceback.
    def _nothing_to_save(signum: int, _frame) -> None:
        said = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}[signum]
        os.write(2, f"{said} before training started: nothing to save yet\n".encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, _nothing_to_save)
    signal.signal(signal.SIGTERM, _nothing_to_save)
    # One write() per line: ranks share the job's pipe, and under PYTHONUNBUFFERED (set by the SLURM script) print()
    # writes the text and its newline separately, so two ranks' lines could merge into one.
    for _stream in (sys.stdout, sys.stderr):
        _stream.reconfigure(line_buffering=True, write_through=False)

    if os.environ.get("PYRECOVER_WARM"):  # a warm standby on this node runs the rest, imports paid (warm.py)
        from standby_client import hand_over

        _code = hand_over(os.environ["PYRECOVER_WARM"])
        if _code is not None:  # None: no standby listening, a cold start
            os._exit(_code)

    # The flags before torch (flags.py imports none of it): --help, --version and every refusal that needs nothing
    # loaded -- a bad flag, value or combination, a missing file, a bad --config file -- answer in a fraction of the
    # imports' time below. main() takes these flags: parsed once. (A warm standby, asked first, parses them itself.)
    def _flags_first() -> argparse.Namespace:
        from flags import BadInput, check_backend, check_data_paths, check_flags, parse_args, spell_settings
        from tokenizer import DataError

        spell_settings()  # the checkpoint package's refusals name this command line's flags
        args = parse_args()  # --help, --version, a usage error: exits here
        rank = next((int(v) for v in (os.environ.get("RANK"), os.environ.get("SLURM_PROCID")) if v and v.isdigit()),
                    0) if args.distributed else 0
        try:
            check_flags(args, writes_csv=rank == 0)  # preflight checks them again (in-process callers of main)
            check_backend(args)  # what the checkpoint Session would refuse of these flags, from its table alone
            check_data_paths(args)
        except (BadInput, DataError) as e:  # one line, as preflight's refusals (rank > 0 names itself), exit 2
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        return args

    _PARSED = _flags_first()

_PARENT_AT_START = os.getppid()  # a torchrun rank's launcher (distributed.follow_launcher), before it could have died
_T_IMPORTS = time.monotonic()  # the heavy imports start here (the recovery line reports how long a restart took)
import numpy as np
import torch
import torch.nn.functional as F

import distributed
from checkpoint import (EVERY_RANK, FENCED, FINISHED, REQUEUE_FAILED, REQUEUED, STOPPED, CheckpointError,
                        CheckpointState, Fenced, ModelState, OptimizerState, RNGState, RunInfo, Session, Settings,
                        SignalWatcher, TrainState, When, capabilities, install_signal_handlers, knobs, setup_logging,
                        unwrap_model)
from dataset import DataError, TrainLoader, fingerprint, hold_out, load_token_windows, load_tokenizer
from dataset import about_val_dataset, is_sharded, load_sharded_windows, load_val_windows, token_parts
from tokenizer import folder_tokenizer, vocabulary_difference
from evaluation import (EVAL_BATCH, CardMaker, Evaluator, batch_loss, check_prediction, eval_window_count, evaluate,
                        run_layout)
from flags import (BadInput, apply_resume_flags, build_parser, check_flags, check_numeric_flags,  # noqa: F401 (tests)
                   check_resume_flags, parse_args, RESOLVED_CONFIG, resolved_config, schedule_warning,
                   spell_settings, VERSION)
from hf import model_config_from_hf, read_hf  # Hugging Face Llama <-> model.py names (one table)
from metrics import VAL_CSV, Metrics, device_peak_flops, started_at, val_csv_path
import schedules
import trackers
from model import (PRESETS, MemoryEstimate, ModelConfig, Transformer, estimate_peak_memory, flash_attention_problem,
                   get_config)

_T_IMPORTED = time.monotonic()
log = logging.getLogger("pyrecover")  # rank 0's lines; extra=EVERY_RANK for every rank's (checkpoint/logs.py)

__version__ = VERSION

# Exit codes (README "Exit codes"; submit-training-simple.sh acts on them). 3-5: stopped early with the state saved (a
# checkpoint committed): resuming from `latest` loses nothing.
EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_REQUEUE = 3  # to be continued: requeued by train.py (SLURM signal/walltime stop), or --jit-checkpoint after a
#                   rank failed (then the launcher reruns/requeues)
EXIT_STOPPED = 4  # not requeued: SIGTERM, Ctrl-C (SIGINT; a second one exits at once with 130), --no-requeue, job
#                   array task, --max-restarts reached, or not under SLURM
EXIT_REQUEUE_FAILED = 5  # a requeue was due but failed (e.g. scontrol missing): resubmit to continue
EXIT_FENCED = 6  # this incarnation lost the run directory's lease (checkpoint/lease.py): it changed nothing

#: how a run ends -> exit code: the stop policy's outcomes, then the errors that are the user's to fix (one line each).
#: Any other exception is a bug and shows its traceback.
EXIT_FOR = {
    FINISHED: EXIT_FINISHED, REQUEUED: EXIT_REQUEUE, STOPPED: EXIT_STOPPED, REQUEUE_FAILED: EXIT_REQUEUE_FAILED,
    BadInput: EXIT_BAD_INPUT, DataError: EXIT_BAD_INPUT, distributed.LaunchError: EXIT_BAD_INPUT,
    Fenced: EXIT_FENCED, CheckpointError: EXIT_FAILED,
}
USER_ERRORS = tuple(k for k in EXIT_FOR if isinstance(k, type))
#: what the last line says of a run stopped before --training-steps (the policy's line before it says why)
STOP_OUTCOMES = {REQUEUED: "requeued", STOPPED: "not requeued", REQUEUE_FAILED: "the requeue failed"}


def exit_code(error: BaseException) -> int:
    return next(EXIT_FOR[t] for t in type(error).__mro__ if t in EXIT_FOR)


def say(line: str) -> None:
    """An error or warning line from any rank, to stderr."""
    print(line, file=sys.stderr, flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------------
# Setup: preflight (bad input, before any collective) -> the run (model, optimizer, data) -> checkpointing (resume)
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prepared:
    """What preflight found usable."""

    tokenizer: object
    windows: object  # what training reads
    config: object
    held_out: object  # the --eval-windows (or --val-fraction) training never sees (evaluation.py), or None
    session: Session  # the run's checkpointing (its lease once every rank passed preflight)
    val: object = None  # what evaluations read: --val-dataset's windows, else the held-out ones (or None)
    init_weights: dict | None = None  # --init-from's tensors by model.py name, until build_run copies them in


def preflight(args: argparse.Namespace, env: distributed.DistEnv, signals: SignalWatcher,
              started: float) -> Prepared:
    """Everything that can be wrong with the user's input, checked on every rank before any collective or training
    time: the flags first (numbers, combinations, paths: instant), then the memory the configuration needs (as soon as
    the tokenizer gives the vocabulary), then the data (tokenizing may take minutes), then the checkpoint directory.
    Nothing is taken yet: the run directory's lease comes after every rank passed (Session.take)."""
    check_flags(args, writes_csv=env.is_main)
    if env.is_main:  # only rank 0 logs to a tracker: a missing package is found now, not after the data loaded
        trackers.check(args)
        if warning := schedule_warning(args):  # on stdout with the run's other lines: stderr is for what stops it
            log.info(warning)
    session = Session(checkpoint_settings(args, env), env, signals=signals, started=started,
                      agree=lambda v: distributed.all_reduce_max(v, env))
    session.read_ahead(args.resume_from_checkpoint)  # a restart's read overlaps the rest of the setup, until the load
    tokenizer, windows, config, held_out = check_inputs(args, env, session)
    val = validation_set(args, env, tokenizer, held_out)
    session.check_writable()
    prepared = Prepared(tokenizer, windows, config, held_out, session, val=val)
    prepared.init_weights = init_from_weights(args)
    return prepared


def checkpoint_settings(args: argparse.Namespace, env: distributed.DistEnv) -> Settings:
    """The flags as the checkpoint session takes them."""
    # The other ranks wait in a collective while rank 0 waits for the final mirror copy: stay inside its timeout.
    mirror_wait = args.mirror_timeout if env.world_size == 1 else min(args.mirror_timeout,
                                                                      0.8 * (args.pg_timeout_seconds or 600.0))
    when = When(every_steps=args.checkpoint_frequency, final_step=args.training_steps,
                every_minutes=args.checkpoint_interval_minutes, walltime_aware=args.timeaware_checkpointing,
                walltime_s=args.walltime, walltime_margin_s=args.walltime_margin_seconds, requeue=args.requeue,
                max_restarts=args.max_restarts)
    return Settings(
        checkpoint_dir=args.checkpoint_dir, experiment=args.experiment_name, backend=args.checkpoint_backend,
        backend_options=backend_options(args), sharded=args.distributed and args.parallel == "fsdp",
        async_save=args.async_checkpoint, jit=args.jit_checkpoint, keep=args.max_kept_checkpoints,
        keep_every=args.keep_every, keep_best=args.keep_best,
        keep_files=("loss.csv", VAL_CSV, RESOLVED_CONFIG),  # an abandoned line's checkpoints go with its rows, flags
        mirror_dir=args.mirror_dir, mirror_every=args.mirror_every, mirror_keep=args.mirror_keep,
        mirror_timeout_s=mirror_wait, force_takeover=args.force_takeover, on_save_error=args.on_save_error, when=when,
        local_dir=args.local_checkpoint_dir, local_every=args.local_checkpoint_frequency,
        local_keep=args.local_checkpoint_keep, peer=args.peer_checkpoint,
        peer_timeout_s=args.pg_timeout_seconds or 600.0)


def check_resume(args: argparse.Namespace, session: Session) -> None:
    """The flags against the checkpoint --resume-from-checkpoint will load (flags.check_resume_flags), read-only: what
    the load refuses, refused before a live run is fenced (--force-takeover). The load checks again (a run still
    training may commit a newer checkpoint in between; its refused flags are the same)."""
    if args.resume_from_checkpoint and (found := session.peek(args.resume_from_checkpoint)) is not None:
        step, saved = found
        check_resume_flags(args, saved, step)


def check_inputs(args: argparse.Namespace, env: distributed.DistEnv, session: Session | None = None):
    """flash-attn, the memory the configuration needs, and the data. Returns (tokenizer, training windows, model
    config, held-out windows or None)."""
    tokenizer, config, _ = check_model(args, env)
    windows, held_out = hold_out(load_data(args, env, tokenizer, session), args.eval_windows, args.val_fraction)
    if len(windows) < args.batch_size * env.world_size:
        cut = "--val-fraction" if args.val_fraction is not None else "--eval-windows"
        raise BadInput(
            f"--sequence-length {args.sequence_length} leaves {len(windows)} training samples in {args.dataset} "
            f"({len(held_out) if held_out else 0} held out by {cut}), fewer than one global batch ({args.batch_size} x "
            f"{env.world_size} ranks); use a shorter sequence, fewer {cut} or a larger dataset"
        )
    return tokenizer, windows, config, held_out


def validation_set(args: argparse.Namespace, env: distributed.DistEnv, tokenizer, held_out):
    """What evaluations read (evaluation.py): --val-dataset's windows (the ranks tokenize its shards together), else
    the held-out windows, or None. Refused in one line: a set with fewer windows than --eval-tokens asks for, a
    --val-dataset file that is a training file (dataset.check_val_apart). Documents it shares with the training data
    are counted in a warning (rank 0): duplicates across splits are common in gathered text (boilerplate, licences),
    and a user may mean them; a whole training file never is."""
    from dataset import check_val_apart, overlap_warning

    val = held_out
    if args.val_dataset is not None:
        val = load_val_windows(args.val_dataset, tokenizer, args.sequence_length, cache_dir=args.data_cache_dir,
                               rank=env.rank, world_size=env.world_size,
                               exchange=lambda error: distributed.first_error(error, env),
                               column=args.text_column)
        check_val_apart(args.dataset, args.val_dataset)
        if env.is_main and (warning := overlap_warning(args.dataset, args.val_dataset, args.text_column)):
            say(warning)
    if val is not None and args.eval_tokens and eval_window_count(args.eval_tokens, args.sequence_length,
                                                                  len(val)) > len(val):
        what = f"--val-dataset {args.val_dataset}" if args.val_dataset else "the held-out data"
        raise BadInput(f"--eval-tokens {args.eval_tokens} needs {args.eval_tokens // args.sequence_length} windows of "
                       f"{args.sequence_length} tokens, but {what} has {len(val)}; give --eval-tokens "
                       f"{len(val) * args.sequence_length} or less (0 = all), or more validation data")
    return val


def check_model(args: argparse.Namespace, env: distributed.DistEnv, gpu_here: bool = True):
    """flash-attn, the tokenizer, the model's shape and the memory it needs: instant, nothing tokenized. Returns
    (tokenizer, model config, memory estimate). ``gpu_here`` False (--check for a GPU that is not on this machine): flash-attn and the
    GPU's memory cannot be asked, so they are not checked."""
    if gpu_here and args.use_flash_attention and (problem := flash_attention_problem(env.device)):
        raise BadInput(problem)
    tokenizer = load_tokenizer(args.tokenizer_name_or_path)
    check_init_tokenizer(args, tokenizer)
    config = model_config(args, tokenizer)
    return tokenizer, config, check_memory(args, env, config, compare=gpu_here)


def check_init_tokenizer(args: argparse.Namespace, tokenizer) -> None:
    """--init-from DIR with a tokenizer of its own: its weights' embeddings are that tokenizer's ids. Not given,
    --tokenizer-name-or-path is it (flags.default_tokenizer); given, it must be the same vocabulary (--force-tokenizer
    trains with it anyway)."""
    own = folder_tokenizer(args.init_from) if args.init_from else None
    if own is None:
        return
    if own == args.tokenizer_name_or_path:
        log.info(f"init-from {args.init_from}: its tokenizer {tokenizer.name} ({tokenizer.vocab_size} tokens)")
        return
    theirs = load_tokenizer(own)
    differ = vocabulary_difference(tokenizer, theirs)
    if differ is None:
        return
    if not args.force_tokenizer:
        raise BadInput(f"--tokenizer-name-or-path {args.tokenizer_name_or_path} ({tokenizer.name}) is not the "
                       f"tokenizer of --init-from {args.init_from} ({theirs.name}): {differ}, so its embeddings would "
                       "be read as other tokens; drop --tokenizer-name-or-path to train with the folder's, or pass "
                       "--force-tokenizer to train with this one anyway")
    log.info(f"warning: --force-tokenizer: training --init-from {args.init_from} with tokenizer {tokenizer.name}, not "
             f"its own {theirs.name} ({differ})")


def hf_model_config(path, what: str) -> dict:
    """ModelConfig fields of a Hugging Face Llama config.json (hf.py maps both directions)."""
    try:
        hf = json.loads(Path(path).read_text())
    except OSError as e:
        raise BadInput(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise BadInput(f"{what} {path} is not valid JSON ({e})") from None
    try:
        return model_config_from_hf(hf, path)
    except CheckpointError as e:
        raise BadInput(f"{what} {e}") from None


def model_config(args: argparse.Namespace, tokenizer) -> ModelConfig:
    """The model's shape: a preset with the tokenizer's vocabulary, or a config.json's (whose vocabulary may be larger
    than the tokenizer's, never smaller); RoPE tables for --sequence-length. --init-from's config.json must agree, and
    its embeddings must be the tokenizer's (check_tokenizer_fits)."""
    theirs = hf_model_config(Path(args.init_from) / "config.json", "--init-from") if args.init_from else None
    if theirs is not None:
        check_tokenizer_fits(args, tokenizer, theirs["vocab_size"])
    if args.model in PRESETS:
        config = get_config(args.model, vocab_size=tokenizer.vocab_size, max_seq_len=args.sequence_length)
    else:
        fields = hf_model_config(args.model, "--model")
        if fields["vocab_size"] < tokenizer.vocab_size:
            raise BadInput(f"--model {args.model}: vocab_size {fields['vocab_size']} is smaller than tokenizer "
                           f"{tokenizer.name}'s {tokenizer.vocab_size} tokens; give a config with vocab_size >= "
                           f"{tokenizer.vocab_size} or another --tokenizer-name-or-path")
        if args.sequence_length > fields["max_seq_len"]:  # RoPE has no table to outgrow: a longer context trains
            log.info(f"note: --sequence-length {args.sequence_length} exceeds --model {args.model}'s "
                     f"max_position_embeddings {fields['max_seq_len']}: RoPE is computed for "
                     f"{args.sequence_length} positions (context extension; the export records the longer one)")
        config = ModelConfig(**(fields | {"max_seq_len": args.sequence_length}))
    if theirs is not None:
        ours = vars(config)
        differ = [f"{k} {theirs[k]} (--model: {ours[k]})" for k in theirs
                  if k != "max_seq_len" and theirs[k] != ours[k]]
        if differ:
            raise BadInput(f"--init-from {args.init_from}: its config.json differs from --model {args.model}: "
                           f"{', '.join(differ)}; drop --model to take the shape from --init-from")
    return config


#: how many embedding rows past a tokenizer's last id still count as its vocabulary: padding to a round size (a few
#: hundred rows at most in published Llama-layout models); more means the weights were trained with another tokenizer
PADDED_ROWS = 1024


def check_tokenizer_fits(args: argparse.Namespace, tokenizer, rows: int) -> None:
    """--init-from's embeddings (``rows``: its config.json's vocab_size) are some tokenizer's ids: the run's tokenizer
    must have no id past them, and not so few that most rows are another vocabulary's (--force-tokenizer trains with
    it anyway, as with a tokenizer of another vocabulary)."""
    tokens = tokenizer.vocab_size
    if tokens <= rows <= tokens + PADDED_ROWS:
        return
    why = (f"its ids up to {tokens - 1} run past the {rows} embedding rows" if tokens > rows else
           f"{rows - tokens} of the {rows} embedding rows would be no token of it")
    line = (f"--init-from {args.init_from}: tokenizer {tokenizer.name} ({args.tokenizer_name_or_path}) has {tokens} "
            f"tokens, but the weights' embeddings have {rows} rows (config.json vocab_size): {why}, so it is not the "
            "vocabulary the weights were trained with")
    if not args.force_tokenizer or tokens > rows:
        raise BadInput(f"{line}; give the model's own tokenizer with --tokenizer-name-or-path"
                       + ("" if tokens > rows else ", or pass --force-tokenizer to train with this one anyway"))
    log.info(f"warning: --force-tokenizer: {line}")


def source_positions(args: argparse.Namespace) -> int | None:
    """The max_position_embeddings of --model's config.json, at least --sequence-length (None: a preset). The card
    records it, and an export keeps it: a model from a 4k-context config.json trained on 512-token windows still has
    RoPE for 4k, and a later --init-from at a longer --sequence-length is not told otherwise."""
    if args.model in PRESETS:
        return None
    return max(hf_model_config(args.model, "--model")["max_seq_len"], args.sequence_length)


def init_from_weights(args: argparse.Namespace) -> dict | None:
    """--init-from: the folder's tensors under model.py's names (shapes checked against its config.json, which
    model_config compared with the model's), or None."""
    if not args.init_from:
        return None
    try:
        _, tensors = read_hf(args.init_from)
    except CheckpointError as e:
        raise BadInput(f"--init-from {e}") from None
    return tensors


def load_data(args: argparse.Namespace, env: distributed.DistEnv, tokenizer, session: Session | None):
    """--dataset's windows. A folder or glob: the ranks tokenize its shards together (dataset.load_sharded_windows), and
    a resumed run reads the shards its checkpoint records, whatever was added since."""
    if not is_sharded(args.dataset):
        return load_token_windows(args.dataset, tokenizer, args.sequence_length, cache_dir=args.data_cache_dir,
                                  column=args.text_column)
    return load_sharded_windows(args.dataset, tokenizer, args.sequence_length, cache_dir=args.data_cache_dir,
                                rank=env.rank, world_size=env.world_size,
                                exchange=lambda error: distributed.first_error(error, env),
                                recorded=recorded_shards(args, session), column=args.text_column)


def recorded_shards(args: argparse.Namespace, session: Session | None) -> list | None:
    """The shard list in the card of the checkpoint --resume-from-checkpoint names (read, not verified: the load
    verifies it, and compares the data's fingerprint), or None (no resume, none found, an older card)."""
    card = session.peek_card(args.resume_from_checkpoint) if session and args.resume_from_checkpoint else None
    data = card.get("data") if card else None
    return data.get("shards") if isinstance(data, dict) else None


def backend_options(args: argparse.Namespace) -> dict:
    if args.checkpoint_backend == "concurrent":
        return {"max_async": args.max_async}
    if args.checkpoint_backend == "dcp":
        return {"async_save": args.async_checkpoint}
    return {}


def memory_estimate(args: argparse.Namespace, env: distributed.DistEnv, config, batch_size: int | None = None,
                    seq_len: int | None = None, max_async: int | None = None) -> MemoryEstimate:
    """model.estimate_peak_memory for this run's flags (or another batch size / sequence length / --max-async)."""
    batch_size, seq_len = batch_size or args.batch_size, seq_len or args.sequence_length
    copies = 0  # training on CPU: asynchronous checkpointing's host copies of the state share the same RAM
    if host_copies_per_max_async(args, env):
        copies = max_async or args.max_async
    elif env.device.type == "cpu" and args.checkpoint_backend == "dcp" and args.async_checkpoint:
        copies = 1
    return estimate_peak_memory(dataclasses.replace(config, max_seq_len=seq_len), batch_size, seq_len,
                                args.model_dtype, env.world_size, args.parallel if env.distributed else "single",
                                env.device.type, "fused" if args.fused_optimizer else "default", copies,
                                args.activation_checkpointing, args.activation_checkpointing_every)


def host_copies_per_max_async(args: argparse.Namespace, env: distributed.DistEnv) -> bool:
    """Whether each --max-async is one more copy of the state in this rank's memory (the concurrent backend's host
    buffers, training on CPU)."""
    return env.device.type == "cpu" and args.checkpoint_backend == "concurrent"


def largest(low: int, high: int, ok) -> int | None:
    """The largest n in [low, high] with ok(n), for ok true up to some n and false above it (None: not even low)."""
    best = None
    while low <= high:
        mid = (low + high) // 2
        if ok(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def check_memory(args: argparse.Namespace, env: distributed.DistEnv, config, compare: bool = True) -> MemoryEstimate:
    """Refuse, in one line, a configuration whose estimated peak memory exceeds what the device has (``compare``
    False: the device is not on this machine, only the estimate)."""
    estimate = memory_estimate(args, env, config)
    available, where = distributed.device_memory(env) if compare else (None, "")
    if available is not None and estimate.total > available:
        def fits(batch: int, seq: int, max_async: int | None = None) -> bool:
            return memory_estimate(args, env, config, batch, seq, max_async).total <= available

        levers = ["--batch-size", "--sequence-length", "--model"]
        # fewer checkpoints in flight (each one a copy of the state in RAM) may be all it takes
        max_async = None
        if host_copies_per_max_async(args, env):
            levers.insert(0, "--max-async")
            max_async = largest(1, args.max_async - 1, lambda n: fits(args.batch_size, args.sequence_length, n))
        batch = largest(1, args.batch_size - 1, lambda b: fits(b, args.sequence_length))  # memory grows with both
        seq = args.sequence_length
        while batch is None and seq > 1 and not fits(1, seq):
            seq //= 2
        hint = (f" (--max-async {max_async} fits)" if max_async else
                f" (--batch-size {batch} fits)" if batch else
                f" (--batch-size 1 with --sequence-length {seq} fits)" if seq > 1 and fits(1, seq) else
                " (even --batch-size 1 --sequence-length 1 does not fit: use a smaller --model)")
        raise BadInput(
            f"--model {args.model} with --batch-size {args.batch_size} x --sequence-length {args.sequence_length} "
            f"({args.model_dtype}) needs an estimated {estimate.describe()} per rank, but {where} "
            f"{available / 2**20:,.1f} MiB; use a smaller {', '.join(levers[:-1])} or {levers[-1]}{hint}"
            + (" or more ranks with --parallel fsdp" if env.device.type == "cuda" else "")
        )
    return estimate


@dataclasses.dataclass
class Run:
    """The training side: what one optimizer step needs."""

    args: argparse.Namespace
    env: distributed.DistEnv
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler  # enabled for fp16 only; otherwise every call passes straight through
    loader: TrainLoader
    autocast: object  # bf16/fp16 autocast, or a null context: made once, entered every step
    progress: TrainState  # step, tokens seen, restarts: what the loop counts
    tokens_per_step: int
    memory: distributed.PeakMemory
    estimate: MemoryEstimate


def build_run(args: argparse.Namespace, env: distributed.DistEnv, prepared: Prepared) -> Run:
    estimate = memory_estimate(args, env, prepared.config)  # prepared against the device's memory in preflight
    log.info(f"memory estimate: {estimate.describe()} per rank on {env.device.type}")
    # Modules imported later bring memory that is not training memory: import them before the memory baseline. The
    # first optimizer imports torch._dynamo; an FSDP model's saves use DCP's state_dict helpers (a plain model's not).
    importlib.import_module("torch._dynamo")
    if env.distributed and args.parallel == "fsdp":
        importlib.import_module("torch.distributed.checkpoint.state_dict")

    # baseline: after imports and data loading, less the state a restart already parsed ahead (it is training's)
    memory = distributed.PeakMemory(env, held=prepared.session.held_ahead())
    seed_everything(args.seed)  # identical init on every rank
    model = Transformer(prepared.config, attention="flash" if args.use_flash_attention else "sdpa")
    if prepared.init_weights is not None:  # after the seeded init, so the RNG streams are a fresh run's
        with torch.no_grad():
            for name, param in model.named_parameters():  # a tied weight once, by its first name
                param.copy_(prepared.init_weights[name])
        log.info(f"init-from {args.init_from}: {len(prepared.init_weights)} tensors loaded")
        prepared.init_weights = None
    model = distributed.checkpoint_activations(model, args.activation_checkpointing,
                                               args.activation_checkpointing_every)
    model = distributed.parallelize(model.to(device=env.device, dtype=distributed.param_dtype(args.model_dtype)), env,
                                    args.parallel)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=tuple(args.adam_betas),
                                  weight_decay=args.weight_decay, fused=True if args.fused_optimizer else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.from_flags(args))
    scaler = torch.amp.GradScaler(env.device.type, enabled=args.model_dtype == "fp16")
    loader = TrainLoader(prepared.windows, args.batch_size, env.rank, env.world_size, args.seed)
    seed_everything(args.seed + env.rank)  # per-rank streams from here on (restored from the checkpoint on resume)
    progress = TrainState()
    knobs.install_crash_hook(unwrap_model(model), env.rank, lambda: progress.step)  # test-only (knobs.py)
    return Run(args, env, model, optimizer, scheduler, scaler, loader, distributed.autocast(env, args.model_dtype),
               progress, args.batch_size * args.gradient_accumulation_steps * args.sequence_length * env.world_size,
               memory, estimate)


def open_checkpoints(args: argparse.Namespace, run: Run, prepared: Prepared) -> int | None:
    """The state to save, then the resume: crashed incarnations' leftovers go, `latest` (or the given step) is loaded
    and checked against these flags and data, and only then are newer checkpoints of a line the run no longer follows
    moved aside. Returns the resumed step (None: a fresh start). A checkpoint that cannot be resumed with these flags
    raises BadInput, with nothing moved."""
    env, session = run.env, prepared.session
    run_info = RunInfo(config=vars(args) | {"model_config": vars(prepared.config)},
                       versions={"torch": str(torch.__version__), "pyrecover": __version__}, world_size=env.world_size)
    # Sharded backends (dcp): every rank saves its own shard (DTensors under FSDP); the others: full state dicts,
    # written once by rank 0. run_info first: a load that fails on another --model/tokenizer/sequence length is
    # explained by the saved flags.
    sharded = capabilities(args.checkpoint_backend).sharded
    state = CheckpointState(run_info=run_info, model=ModelState(run.model, sharded=sharded),
                            optimizer=OptimizerState(run.model, run.optimizer, sharded=sharded),
                            lr_scheduler=run.scheduler, dataloader=run.loader, train_state=run.progress, rng=RNGState())
    if run.scaler.is_enabled():
        state["grad_scaler"] = run.scaler

    applied: list[str] = []  # flags that differ from the checkpoint's and take effect ('resume: applying ...')

    def reconcile(step: int | None) -> None:  # right after the load, before anything moves
        applied.extend(apply_resume_flags(args, run_info, step, run.optimizer, run.scheduler))
        check_same_model(args, run_info, prepared.config)
        if step is not None:
            check_same_data(args, run, prepared, session.loaded)
        if step is not None and args.validate_on_resume:
            validate_loaded(args, run, session.loaded)

    try:
        step = session.open(args.resume_from_checkpoint, state)
    except (CheckpointError, DataError) as e:  # DataError: e.g. resharded to a global batch it does not fit
        reconcile(None)  # run_info loads first: a refused flag (another --model, ...) explains the failure best
        raise BadInput(str(e)) from None
    reconcile(step)
    session.follow(step)
    if args.resume_from_checkpoint and step is None:
        log.info(f"no checkpoint found in {session.root}; starting fresh from step 0")
    elif step is not None:
        run.progress.restarts += 1
        if args.init_from:
            log.info(f"resume: the checkpoint's weights are used; --init-from {args.init_from} applies to a fresh "
                     "start only")
        for line in applied + [f"warning: resumed run differs from the checkpoint: {d}" for d in run_info.differences(())]:
            log.info(line)  # the differences: world size, torch version
    return step


def check_same_model(args: argparse.Namespace, run_info: RunInfo, config: ModelConfig) -> None:
    """The model's shape against the checkpoint's (a config.json may have changed under the same --model path)."""
    saved = getattr(run_info, "saved", {}).get("config", {}).get("model_config")
    if not isinstance(saved, dict):
        return
    saved = {f.name: saved.get(f.name, f.default) for f in dataclasses.fields(ModelConfig)}  # older: fewer fields
    differ = [f"{k} {v} (checkpoint: {saved[k]})" for k, v in vars(config).items() if saved[k] != v]
    if differ:
        raise BadInput(f"--model {args.model} gives another model than the checkpoint's: {', '.join(differ)}; it "
                       "cannot change on resume (the weights are that model's); resume with the checkpoint's model, or "
                       "start a new --experiment_name")


def build_evaluator(args: argparse.Namespace, run: Run, prepared: Prepared, metrics: Metrics) -> Evaluator | None:
    """The evaluations of the eval set (evaluation.py), or None without one: the same first windows every time, each
    rank its share, the sums all-reduced; reported (log line, val CSV, trackers) by rank 0."""
    if prepared.val is None:
        return None
    env, model = run.env, unwrap_model(run.model)
    count = eval_window_count(args.eval_tokens, args.sequence_length, len(prepared.val))
    lockstep = env.distributed and args.parallel == "fsdp"  # every forward gathers the shards: all ranks run as many

    def evaluate_now() -> dict | None:  # None: a stop came during it (the session's vote between its batches)
        return evaluate(model, prepared.val, env.device, run.autocast, count=count, rank=env.rank,
                        world_size=env.world_size, lockstep=lockstep,
                        reduce=lambda values: distributed.sum_over_ranks(values, env),
                        stop=prepared.session.interrupt)

    when = (f"every {args.eval_every} steps and at each save" if args.eval_every else "at each save")
    log.info(f"eval: {count} windows ({count * args.sequence_length} tokens) of "
             f"{args.val_dataset or prepared.val.source} {when}")
    def probe_now() -> float:  # every rank (FSDP's forward is a collective); bitwise evaluate()'s first batch
        return batch_loss(model, prepared.val.batch(range(min(EVAL_BATCH, count))), env.device, run.autocast)

    return Evaluator(evaluate_now, args.eval_every, metrics.note_eval, count=count, probe_at=probe_now,
                     observe=prepared.session.observe_eval)


def evaluations_between(args: argparse.Namespace, has_val: bool):
    """``(a, b) -> how many evaluations the steps in (a, b] make`` (--eval-every's and the periodic saves', as the
    stop policy's IntervalPolicy schedules them), for the ETA; None without validation data."""
    from math import lcm

    if not has_val:
        return None
    every = args.eval_every or 0
    save = (args.local_checkpoint_frequency if args.local_checkpoint_dir else 0) or args.checkpoint_frequency or 0
    both = lcm(every, save) if every and save else 0
    final = args.training_steps

    def multiples(n: int, a: int, b: int) -> int:
        return b // n - a // n if n > 0 else 0

    def count(a: int, b: int) -> int:
        n = multiples(every, a, b) + multiples(save, a, b) - multiples(both, a, b)
        return n + (a < final <= b and not any(k and final % k == 0 for k in (every, save)))

    return count


def evaluate_owed(run: Run, session: Session, evaluator: Evaluator | None, resumed: int | None) -> bool:
    """A run resumed from a stop that gave the step's evaluation no time (evaluation.Evaluator.owed): that evaluation
    first, from the same weights, so the val rows are an uninterrupted run's. A just-in-time save is not a stop's:
    its card records no evaluation either way. True: a stop came during this one too."""
    info = session.loaded
    if evaluator is None or resumed is None or info is None:
        return False
    meta = info.manifest.get("meta", {})
    owed = not meta.get("jit") and evaluator.owed(resumed, meta.get("card", {}), session.save_scheduled(resumed))
    if distributed.all_reduce_max(float(owed), run.env) == 0:  # the same card everywhere; agreed all the same
        return False
    log.info(f"eval: step {resumed}'s evaluation gave way to the stop its checkpoint was saved for: evaluating it now")
    return evaluator(resumed) is None


def card_describer(args: argparse.Namespace, run: Run, prepared: Prepared, started: float,
                   evaluator: Evaluator | None):
    """The card every checkpoint carries (evaluation.py): the run's facts, the interval's losses, and -- at a periodic
    save -- the evaluation of that step (every rank takes part: evaluation.evaluate)."""
    env, model = run.env, unwrap_model(run.model)
    # the probe is the first batch the evaluation reads (its loss is that batch's), however few windows it reads
    probe = prepared.val.batch(range(min(EVAL_BATCH, evaluator.count))) if evaluator is not None else None
    # Only rank 0 commits a card (any rank may, in a just-in-time save): the others skip hashing the data at start-up.
    writes = env.is_main or args.jit_checkpoint
    make = CardMaker(args, env, prepared.config, model.num_params(), prepared.tokenizer.name,
                     data_fingerprint(prepared, args.text_column) if writes else None, probe, started, __version__,
                     json.loads(resolved_config(args)), shards=getattr(prepared.windows, "shards", None),
                     max_positions=source_positions(args))

    def describe(step: int, metrics: Metrics, evaluate_now: bool = False, rushed: bool = False) -> dict:
        # the step's evaluation (reused if --eval-every just made it); logged, rowed and tracked at `step`. A stop's
        # save (rushed) gets only the probe, one forward: the grace time before SIGKILL is the save's, and a full
        # evaluation there would add a val row an uninterrupted run does not have.
        evaluation = None
        if evaluate_now and evaluator is not None:
            evaluation = evaluator.probe_only(step) if rushed else evaluator(step)
            if evaluation is None:  # a stop came during it: this save becomes the stop's (Session.step_boundary)
                evaluation = evaluator.probe_only(step)
        return {"card": make(step=step, tokens_seen=run.progress.tokens_seen, losses=metrics.take_interval(),
                             lr=metrics.last_lr, evaluation=evaluation)}

    return describe


def data_fingerprint(prepared: Prepared, column: str = "text") -> str:
    """The fingerprint of the tokens this run reads (training, then held out), as the card records it."""
    return fingerprint(*token_parts(prepared.windows), *token_parts(prepared.held_out), column=column)


def check_same_data(args: argparse.Namespace, run: Run, prepared: Prepared, info) -> None:
    """Resume only on the data the checkpoint was trained on: its card's fingerprint against this run's tokens. Every
    rank hashes the data it reads and the ranks agree, so all refuse together (a node with another copy included)."""
    card_data = info.manifest.get("meta", {}).get("card", {}).get("data", {})
    saved = card_data.get("fingerprint")
    if saved is None:
        log.info(f"resume: {info.path} records no data fingerprint (an older checkpoint): its data is not compared")
        return
    now = data_fingerprint(prepared, args.text_column)
    if distributed.all_reduce_max(float(now != saved), run.env) == 0:
        return
    ours = (f"this run's --dataset {args.dataset} (tokenizer {prepared.tokenizer.name}) gives {now}" if now != saved
            else f"another rank's copy of --dataset {args.dataset} differs")
    raise BadInput(f"checkpoint {info.path} was trained on other data: its card records {saved} "
                   f"({card_data.get('dataset')}, tokenizer {card_data.get('tokenizer')}), {ours}; resume with the "
                   "data it was trained on, or start a new --experiment_name to train on this data")


def validate_loaded(args: argparse.Namespace, run: Run, info) -> None:
    """--validate-on-resume: the loaded weights must predict the probe batch as they did at save time (every rank
    computes it: the same answer everywhere, so all refuse together)."""
    knobs.swap_after_load(unwrap_model(run.model))  # test-only: a wrong load that passes every checksum
    card = info.manifest.get("meta", {}).get("card", {})
    if "eval" not in card and info.manifest.get("meta", {}).get("jit"):  # a requeue after a peer failure goes on
        log.info(f"validate-on-resume: {info.path} is a just-in-time save (no forward pass, no probe): not validated")
        return
    if "eval" not in card:
        raise BadInput(f"--validate-on-resume: {info.path} records no probe loss (a just-in-time save, or saved "
                       "without held-out data); resume without --validate-on-resume, or from another step")
    probe = torch.tensor(card["eval"]["probe_tokens"], dtype=torch.long)
    loss = batch_loss(unwrap_model(run.model), probe, run.env.device, run.autocast)
    ok, line = check_prediction(card, loss, run_layout(args, run.env))
    if not ok:
        raise BadInput(f"--validate-on-resume: {info.path} failed validation: {line}; the weights do not predict "
                       "as saved (a wrong load), so nothing was trained; resume from another step or check the "
                       "checkpoint with `python evaluation.py validate`")
    log.info(f"validate-on-resume: step {info.step} OK, {line}")


def build_metrics(args: argparse.Namespace, run: Run, session: Session, resumed: int | None,
                  tokenizer, has_val: bool = False) -> Metrics:
    # The loss CSV and profiler traces stay on local disk: next to the checkpoints, or ./logs/<experiment> for s3://.
    log_dir = session.local_log_dir(Path("logs") / args.experiment_name)
    csv_path = None
    if args.log_loss_to_csv:
        csv_path = log_dir / "loss.csv" if args.log_loss_to_csv == "auto" else Path(args.log_loss_to_csv)
    # The val CSV: when the run validates (--eval-every, --val-dataset, --val-fraction), or a start before did (a resume
    # without those flags still drops the rows of lost work, so none is there twice).
    val_csv = val_csv_path(csv_path) if csv_path else None
    validates = has_val and (args.eval_every or args.val_dataset is not None or args.val_fraction is not None)
    if val_csv is not None and not (validates or val_csv.exists()):
        val_csv = None
    profiler = None
    if args.profile:
        profiler = torch.profiler.profile(schedule=torch.profiler.schedule(
            wait=max(0, args.profile_step_start - run.progress.step - 1), warmup=1,
            active=max(1, args.profile_step_end - args.profile_step_start + 1), repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(log_dir / "profile")))
    env, model = run.env, unwrap_model(run.model)
    log.info(f"model {args.model}: {model.num_params() / 1e6:.1f}M params | {env.world_size} rank(s) on "
              f"{env.device.type} ({env.backend or 'single process'}) | {len(run.loader.windows)} samples of "
              f"{args.sequence_length} tokens | tokenizer {tokenizer.name} | global batch {run.tokens_per_step} tokens "
             f"({args.batch_size} x {args.gradient_accumulation_steps} accumulation x {env.world_size} rank(s) x "
             f"{args.sequence_length})")
    # --tracker: opened by rank 0 only, in the run folder unless --tracker-dir (trackers.py).
    names = trackers.parse(args.tracker)
    tracker_dir = Path(args.tracker_dir) if args.tracker_dir else log_dir
    opened = trackers.open_trackers(names, tracker_dir, resumed, wandb_project=args.wandb_project,
                                    wandb_name=args.wandb_name or os.environ.get("WANDB_NAME") or args.experiment_name
                                    ) if env.is_main else []
    return Metrics(writer=env.is_main, csv_path=csv_path, resumed_step=resumed, start_step=run.progress.step,
                   total_steps=args.training_steps, every=args.logging_frequency, tokens_per_step=run.tokens_per_step,
                   flops_per_token=model.flops_per_token(args.sequence_length),
                   peak_flops=device_peak_flops(env.device, args.model_dtype),
                   world_size=env.world_size, imports=(_T_IMPORTS, _T_IMPORTED), profiler=profiler,
                   trackers=opened, tracker_dir=tracker_dir, tracker_names=tuple(names),
                   save_records=lambda: session.history, memory=run.memory, val_csv_path=val_csv,
                   evaluations=evaluations_between(args, has_val))


def build_jit(args: argparse.Namespace, run: Run, session: Session, metrics: Metrics, describe) -> object:
    """--jit-checkpoint: a surviving rank saves the last completed step when a peer fails (checkpoint/jit.py)."""
    if args.jit_checkpoint:
        log.info(f"jit: just-in-time checkpointing on (rank {run.env.rank})", extra=EVERY_RANK)
    return session.just_in_time(reseed=lambda r: seed_everything(args.seed + r), ensure_logged=metrics.ensure_logged,
                                describe=lambda step: describe(step, metrics))


# ----------------------------------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------------------------------


def train_step(run: Run, before_update) -> tuple[float, float, torch.Tensor | None]:
    """One optimizer step on the next --gradient-accumulation-steps batches. Returns the global batch's mean loss (the
    same on every rank), the learning rate the step used, and the gradient norm before clipping (None: no clipping)."""
    micro = run.args.gradient_accumulation_steps
    for i in range(micro):
        inputs, targets = run.loader.next_batch()
        inputs, targets = inputs.to(run.env.device, non_blocking=True), targets.to(run.env.device, non_blocking=True)
        # DDP all-reduces the gradients once, in the last micro-batch's backward (FSDP2 reduces every micro-batch)
        last = i == micro - 1
        with contextlib.nullcontext() if last or not hasattr(run.model, "no_sync") else run.model.no_sync():
            with run.autocast:
                logits = run.model(inputs)
                micro_loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
            # the mean over the step's micro-batches; one micro-batch divides by nothing (bitwise as before)
            run.scaler.scale(micro_loss / micro if micro > 1 else micro_loss).backward()
        loss = micro_loss.detach() if i == 0 else loss + micro_loss.detach()
    if micro > 1:
        loss = loss / micro
    run.scaler.unscale_(run.optimizer)
    grad_norm = None
    if run.args.grad_max_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.args.grad_max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor; materialise it on every rank (a collective)
            grad_norm = grad_norm.full_tensor()
    # All-reduced before optimizer.step(): a peer failure seen here loses nothing (jit.py).
    loss_value = distributed.mean_over_ranks(loss.detach().float(), run.env)
    before_update()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.progress.step += 1
    run.progress.tokens_seen += run.tokens_per_step
    return float(loss_value), lr, grad_norm


# ----------------------------------------------------------------------------------------------------------------------
# --check: the pre-flight checks alone (e.g. on a login node, before sbatch)
# ----------------------------------------------------------------------------------------------------------------------


def check_only(args: argparse.Namespace) -> int:
    """--check: every check that needs no process group, on this machine, then exit: 0 after a summary, or 2 after one
    error line. Nothing is trained or written, and no lease is taken (a live run of the same folder is untouched)."""
    try:
        lines = check_everything(args)
    except (*USER_ERRORS, CheckpointError) as e:  # a checkpoint that cannot be read is bad input here: fix, resubmit
        say(f"error: {e}")
        return EXIT_BAD_INPUT
    for line in lines:
        print(f"check: {line}", flush=True)
    return EXIT_FINISHED


def check_world_size(args: argparse.Namespace) -> int:
    """The ranks the checked run will have: --check-world-size, else the launcher's WORLD_SIZE or SLURM_NTASKS (a check
    run inside an allocation), else 1. Without --distributed: one process."""
    if not args.distributed:
        if (args.check_world_size or 1) > 1:
            raise BadInput(f"--check-world-size {args.check_world_size}: a run without --distributed is one process; "
                           "add --distributed or drop --check-world-size")
        return 1
    if args.check_world_size:
        return args.check_world_size
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit() and int(os.environ[name]) > 0:
            return int(os.environ[name])
    return 1


def check_data_files(args: argparse.Namespace, tokenizer, spec: str, flag: str = "--dataset") -> str:
    """--check: the data as far as it can be seen without tokenizing (minutes for a large dataset, which a login node
    should not spend): every file readable (parquet or JSON Lines) with rows and the --text-column, and whether its
    token cache exists. The run itself checks the tokens (and that they fill a global batch) when it loads them."""
    from dataset import cache_places, check_records, check_shard, list_shards  # check_shard: as the loading starts

    paths = list_shards(spec)[1] if is_sharded(spec) else [Path(spec)]
    cached = 0
    for path in paths:
        check_shard(path, args.text_column)
        check_records(path, args.text_column)  # JSON Lines: records spread over the file, not only the first
        cached += any(place.exists() for place in cache_places(path, tokenizer, args.data_cache_dir, args.text_column))
    tokens = ("tokens cached" if cached == len(paths) else
              f"tokens cached for {cached} of {len(paths)}: not tokenized here, the run tokenizes the rest at its "
              "start")
    return f"{flag} {spec}: {len(paths)} file(s), readable, with rows and a '{args.text_column}' column; {tokens}"


def check_folder_writable(session: Session) -> None:
    """The run folder could be made and written, judged without making it (--check writes nothing): the nearest
    folder that exists must be one this user may write into. Object storage: its probe (a small object, deleted)."""
    if not session.filesystem:
        session.check_writable()
        return
    root = Path(session.root)
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not existing.is_dir() else "is not writable for this user"
        raise BadInput(f"checkpoint directory {root} cannot be written: {existing} {what}; fix its permissions or pass "
                       "--checkpoint-dir pointing to a writable folder")


def check_everything(args: argparse.Namespace) -> list[str]:
    """The checks of preflight, in its order, on one process: the flags, the device and dtype, the tokenizer, the
    model and its memory, the data's files, the checkpoint folder, and the checkpoint a resume would load (its flags
    compared as the load will). Returns the summary lines."""
    here = torch.cuda.is_available()
    # --device cuda on a login node: the job's GPUs are elsewhere. What can be checked here is that this torch (the
    # job's, when PYTHON is the job's) is a CUDA build: a CPU-only one is refused now, not after the queue.
    elsewhere = args.device == "cuda" and not here and torch.version.cuda is not None
    device = "cuda" if elsewhere else distributed.choose_device(args.device, cuda=here)
    args.model_dtype = distributed.resolve_dtype(args.model_dtype, device, bf16_ok=True if elsewhere else None)
    world = check_world_size(args)
    env = distributed.DistEnv(world_size=world, device=torch.device("cuda", 0) if device == "cuda" else
                              torch.device("cpu"), backend=("nccl" if device == "cuda" else "gloo") if args.distributed
                              else None, launcher="check")
    check_flags(args)
    trackers.check(args)
    session = Session(checkpoint_settings(args, env), env, agree=lambda v: v)
    tokenizer, config, estimate = check_model(args, env, gpu_here=not elsewhere)
    init = []
    if args.init_from:  # its headers, as the run reads them first; not its tensors (gigabytes, on a login node)
        from hf import check_hf

        try:
            check_hf(args.init_from)
        except CheckpointError as e:
            raise BadInput(f"--init-from {e}") from None
        init = [f"--init-from {args.init_from}: config.json and its safetensors headers readable, every tensor of its "
                "shape (their values are checked when the run reads them)"]
    available, where = (None, "") if elsewhere else distributed.device_memory(env)
    with torch.device("meta"):
        params = Transformer(config).num_params()
    data = [check_data_files(args, tokenizer, args.dataset)]
    if args.val_dataset:
        try:
            data.append(check_data_files(args, tokenizer, args.val_dataset, "--val-dataset"))
        except DataError as e:
            raise about_val_dataset(e, args.val_dataset) from None
        from dataset import check_val_apart, overlap_warning

        check_val_apart(args.dataset, args.val_dataset)
        if warning := overlap_warning(args.dataset, args.val_dataset, args.text_column):
            say(warning)
    check_folder_writable(session)
    resume = "would start fresh (no --resume-from-checkpoint)"
    if args.resume_from_checkpoint:
        found = session.peek(args.resume_from_checkpoint)
        if found is None:
            resume = f"would start fresh: no checkpoint in {session.root} yet"
        else:
            step, saved = found
            check_resume_flags(args, saved, step)
            resume = (f"would resume from step {step} of {session.root} (--resume-from-checkpoint "
                      f"{args.resume_from_checkpoint})")
    shown_device = f"{device} (the job's GPU; none on this machine)" if elsewhere else device
    ranks = f"{world} rank(s)" + (f" ({args.parallel})" if args.distributed else "")
    compared = ("GPU not on this machine: not compared" if elsewhere else
                f"{where} {available / 2**20:,.1f} MiB" if available is not None else "available memory unknown")
    return [
        f"device {shown_device}, --model-dtype {args.model_dtype}, {ranks}",
        f"model {args.model}: {params / 1e6:.1f}M params, tokenizer {tokenizer.name} ({tokenizer.vocab_size} tokens)",
        f"memory estimate {estimate.total / 2**20:,.1f} MiB per rank ({compared})",
        *init,
        *data,
        f"checkpoint folder {session.root}: writable",
        f"OK: {resume}; nothing was trained or written",
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global _PARSED
    distributed.follow_launcher(_PARENT_AT_START)  # before anything else: a rank must not outlive its torchrun
    spell_settings()  # the checkpoint package's refusals name this command line's flags
    args = _PARSED if argv is None and _PARSED is not None else parse_args(argv)
    _PARSED = None  # taken once
    if args.check:  # the pre-flight checks alone: no process group, no signal handlers, nothing written
        return check_only(args)
    started = time.time()  # --walltime counts from here
    # Then the handlers: SLURM's warning must not kill us during setup. A SIGTERM in setup ends the process at once
    # (os._exit: an exception raised from a handler can be turned into another one by the code it interrupts).
    signals = install_signal_handlers(args.signal, exit_process=os._exit)
    try:
        return train(args, signals, started)
    finally:
        signals.restore()


class Refused(Exception):
    """Some rank found bad input; each rank that did has said so."""


def agreed(env: distributed.DistEnv, check):
    """``check()`` on every rank, then one all-reduce: if it refused anywhere (bad input: one line from each rank that
    refused), raise Refused on every rank, so none waits for another in a collective. Else its result."""
    result, error = None, None
    try:
        result = check()
    except (BadInput, DataError, CheckpointError) as e:
        error = e
    if distributed.all_reduce_max(1.0 if error is not None else 0.0, env) > 0:
        if error is not None:
            say(f"error: {error}" if env.is_main else f"error (rank {env.rank}): {error}")
        raise Refused
    return result


def train(args: argparse.Namespace, signals: SignalWatcher, started: float) -> int:
    t_start = time.perf_counter()
    if args.deterministic:  # before any CUDA work: cuBLAS reads its workspace setting when its first handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    env = distributed.init(args.distributed, device=args.device)
    # --model-dtype auto -> bf16 or fp32 now, before anything reads it: the memory estimate, the card, the resume
    # comparison (a refused flag) and the evaluation's tolerance all see the dtype the run trains in
    args.model_dtype = distributed.resolve_dtype(args.model_dtype, env.device.type)
    setup_logging(env.rank)
    # Bad input is found on every rank before any collective; then the ranks agree, so none waits for another. Only
    # then does rank 0 take the run directory (a refusal after a --force-takeover would leave no run training).
    try:
        prepared = agreed(env, lambda: preflight(args, env, signals, started))
        session = prepared.session
        agreed(env, lambda: session.take(before_force=lambda: check_resume(args, session)))
    except Refused:
        return EXIT_BAD_INPUT

    run = build_run(args, env, prepared)
    try:
        resumed = open_checkpoints(args, run, prepared)
    except BadInput as e:  # every rank has the same flags and checkpoint: all refuse here, none waits in a collective
        if env.is_main:
            say(f"error: {e}")
            session.release()  # nothing was changed: the next start need not wait for anything
        return EXIT_BAD_INPUT
    if env.is_main:  # every flag's final value (command line, --config, defaults); rewritten, atomically, each start
        try:
            session.write_record(RESOLVED_CONFIG, resolved_config(args))
        except OSError as e:  # a record, not state: the card has the flags too, and a failing disk stops the next save
            say(f"warning: could not write {session.root / RESOLVED_CONFIG} ({e.strerror or e}); training continues")
    metrics = build_metrics(args, run, session, resumed, prepared.tokenizer, has_val=prepared.val is not None)
    evaluator = build_evaluator(args, run, prepared, metrics)
    describe = card_describer(args, run, prepared, started, evaluator)
    jit = build_jit(args, run, session, metrics, describe)
    if env.distributed and args.pg_timeout_seconds:
        distributed.set_timeout(args.pg_timeout_seconds)
    session.start()  # from here on SIGTERM / --signal mean "save at the next step boundary and stop"

    def before_update() -> None:
        session.wait_staged()  # an async save still copying the weights must finish before they change
        jit.begin_optimizer()

    def card(step: int):
        def make(rushed: bool) -> dict:  # a periodic save's card: evaluated first, so --tracker logs its eval at `step`
            meta = describe(step, metrics, evaluate_now=True, rushed=rushed)
            metrics.sync()
            return meta
        return make

    # --- the loop ----------------------------------------------------------------------------------------------------
    run.model.train()
    metrics.start(session.load_seconds)
    t_loop = time.perf_counter()
    try:
        # resumed from a stop that interrupted an evaluation: that one first (a stop during it saves its step again)
        stopped = (evaluate_owed(run, prepared.session, evaluator, resumed)
                   and session.step_boundary(run.progress.step, card(run.progress.step)))
        while not stopped and run.progress.step < args.training_steps:
            t0 = time.perf_counter()
            jit.begin_step()  # --jit-checkpoint: from here until the optimizer step the last step's state is intact
            loss, lr, grad_norm = train_step(run, before_update)
            jit.end_step()
            metrics.step(run.progress.step, loss, lr, grad_norm, time.perf_counter() - t0, run.progress.tokens_seen,
                         run.progress.restarts)
            if evaluator is not None and evaluator.due(run.progress.step):  # after the optimizer step, before a save
                evaluator(run.progress.step)  # --eval-every: no RNG, no weight changes (evaluation.evaluate)
            if session.step_boundary(run.progress.step, card(run.progress.step)):
                break
        problem = session.close(run.progress.step)
    except Exception as e:
        # a peer failed: this healthy rank saved the last completed step (or another rank did) -> requeue
        if isinstance(e, USER_ERRORS) or not jit.save_if_survivor(e):
            raise
        return EXIT_REQUEUE
    if problem is not None:
        kind, line = problem
        if kind == FENCED:  # this incarnation changed nothing since it was fenced: it only leaves
            if env.is_main:
                say(line)
            distributed.shutdown(env)
            _KEEP_UNTIL_EXIT.append(run.model)
            return EXIT_FENCED
        say(line)
        return EXIT_FAILED
    return finish(args, run, session, metrics, time.perf_counter() - t_start, time.perf_counter() - t_loop)


def finish(args: argparse.Namespace, run: Run, session: Session, metrics: Metrics, run_s: float,
           loop_s: float) -> int:
    """After the last checkpoint committed: check the replicas, report, requeue if the policy says so, exit code."""
    env = run.env
    if env.distributed and args.parallel == "ddp":
        same = distributed.replicas_identical(run.model, env)
        log.info(f"replica check: parameters {'identical' if same else 'DIFFER'} across {env.world_size} ranks")
        if not same:
            return EXIT_FAILED
    metrics.close()
    measured = run.memory.peak_growth()
    log.info(f"memory measured: {measured / 2**20:,.1f} MiB peak on rank 0 ({run.memory.describe()}); estimate "
              f"{run.estimate.total / 2**20:,.1f} MiB ({100 * (run.estimate.total / max(measured, 1) - 1):+.1f}%)")
    log.info(session.summary(run_s))
    outcome = session.finish(run.progress.step)  # a stop before the end: rank 0 requeues
    # last, once the outcome is known: a stop (signal, walltime) is not "done"
    ended = (f"done: {run.progress.step} steps" if outcome == FINISHED else
             f"stopped at step {run.progress.step} of {args.training_steps} ({STOP_OUTCOMES[outcome]})")
    log.info(f"{ended}, final loss {metrics.last_loss:.4f}, {loop_s:.1f}s in the loop")
    distributed.shutdown(env)
    _KEEP_UNTIL_EXIT.append(run.model)  # see __main__: freeing DDP's reducer here can hang the process
    session.release()
    return EXIT_FOR[outcome]


def cli() -> int:
    try:
        return main()
    except USER_ERRORS as e:
        say(f"error: {e}")
        return exit_code(e)


# Freed by nobody: the process ends with os._exit once everything is durable and flushed. Freeing a DDP model after
# destroy_process_group runs ~ProcessGroupGloo with the GIL held while a gloo worker thread may still need the GIL to
# free the tensors of the last all_gather: a deadlock at exit (pytorch/pytorch#56297), seen here under CPU load -- under
# SLURM it would hold the allocation until the time limit.
_KEEP_UNTIL_EXIT: list = []

def exit_process(code: int) -> None:
    # os._exit skips multiprocessing's exit handler, which terminates daemonic children: after an error exit DCP's save
    # process (--async-checkpoint process; a normal end has stopped it) would outlive us, then print a traceback when
    # it finds its pipe closed.
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def started_as_standby_child(rank_age_s: float) -> None:
    """This process is a warm standby's child running a rank (warm.py): its launcher is the standby, its imports took
    no time, and its start is the rank process's, ``rank_age_s`` ago."""
    global _PARENT_AT_START, _T_IMPORTS, _T_IMPORTED
    _PARENT_AT_START = os.getppid()
    _T_IMPORTS = _T_IMPORTED = time.monotonic()
    started_at(time.monotonic() - rank_age_s)


if __name__ == "__main__":
    exit_process(cli())
