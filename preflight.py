"""Preflight: everything that can be wrong with a run's input, refused in one line before any training time is spent
(train.py runs it on every rank, then the ranks agree), and ``--check``, the same checks alone on one process (e.g. on a
login node, before sbatch). The flags come first (flags.py: instant, before torch), then the tokenizer and the model's
shape and memory, then the data (tokenizing may take minutes), then the checkpoint folder and what a resume would load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import distributed
import trackers
from checkpoint import CheckpointError, Preview, Session, Settings, When
from dataset import DataError, about_val_dataset, hold_out, is_sharded, load_sharded_windows, load_token_windows
from dataset import load_tokenizer, load_val_windows
from evaluation import eval_window_count
from flags import BadInput, RESOLVED_CONFIG, check_flags, check_resume_flags, schedule_warning
from hf import model_config_from_hf, read_hf  # Hugging Face Llama <-> model.py names (one table)
from metrics import VAL_CSV
from model import PRESETS, MemoryEstimate, ModelConfig, Transformer, estimate_peak_memory, flash_attention_problem
from model import get_config
from tokenizer import folder_tokenizer, vocabulary_difference

if TYPE_CHECKING:
    from checkpoint import SignalWatcher

log = logging.getLogger("pyrecover")


def say(line: str) -> None:
    """An error or warning line from any rank, to stderr."""
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Prepared:
    """What preflight found usable."""

    tokenizer: object
    windows: object  # what training reads
    config: object
    held_out: object  # the --eval-windows (or --val-fraction) training never sees (evaluation.py), or None
    session: Session  # the run's checkpointing (its lease once every rank passed preflight)
    preview: Preview  # where the run lives and what its resume would find (checkpoint.Session.prepare)
    val: object = None  # what evaluations read: --val-dataset's windows, else the held-out ones (or None)
    init_weights: dict | None = None  # --init-from's tensors by model.py name, until build_run copies them in


def preflight(args: argparse.Namespace, env: distributed.DistEnv, signals: SignalWatcher,
              started: float, down=None) -> Prepared:
    """Everything that can be wrong with the user's input, checked on every rank before any collective or training
    time: the flags first (numbers, combinations, paths: instant), then the memory the configuration needs (as soon as
    the tokenizer gives the vocabulary), then the data (tokenizing may take minutes).
    Nothing is made or taken yet: the run folder and its lease come after every rank passed (Session.take)."""
    check_flags(args, writes_csv=env.is_main)
    if env.is_main:  # only rank 0 logs to a tracker: a missing package is found now, not after the data loaded
        trackers.check(args)
        if warning := schedule_warning(args):  # on stdout with the run's other lines: stderr is for what stops it
            log.info(warning)
    session, preview = open_session(args, env, signals, started, down)
    tokenizer, windows, config, held_out = check_inputs(args, env, preview)
    val = validation_set(args, env, tokenizer, held_out)
    prepared = Prepared(tokenizer, windows, config, held_out, session, preview, val=val)
    prepared.init_weights = init_from_weights(args)
    return prepared


def open_session(args: argparse.Namespace, env: distributed.DistEnv, signals: SignalWatcher | None,
                 started: float, down=None) -> tuple[Session, Preview]:
    """The run's checkpointing for these ranks, prepared: a restart's read overlaps the rest of the setup, until the
    load (a recovered generation opens its own, on its new group; ``down``: whether a peer of it failed)."""
    session = Session(checkpoint_settings(args, env), env, signals=signals, started=started,
                      agree=lambda v: distributed.all_reduce_max(v, env), down=down)
    return session, session.prepare()


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
        checkpoint_dir=args.checkpoint_dir, experiment=args.experiment_name, resume=args.resume_from_checkpoint,
        backend=args.checkpoint_backend,
        backend_options=backend_options(args), sharded=args.distributed and args.parallel == "fsdp",
        async_save=args.async_checkpoint, jit=args.jit_checkpoint, keep=args.max_kept_checkpoints,
        keep_every=args.keep_every, keep_best=args.keep_best,
        keep_files=("loss.csv", VAL_CSV, RESOLVED_CONFIG),  # an abandoned line's checkpoints go with its rows, flags
        mirror_dir=args.mirror_dir, mirror_every=args.mirror_every, mirror_keep=args.mirror_keep,
        mirror_timeout_s=mirror_wait, force_takeover=args.force_takeover, on_save_error=args.on_save_error, when=when,
        local_dir=args.local_checkpoint_dir, local_every=args.local_checkpoint_frequency,
        local_keep=args.local_checkpoint_keep, peer=args.peer_checkpoint,
        peer_timeout_s=args.pg_timeout_seconds or 600.0)


def check_resume(args: argparse.Namespace, preview: Preview) -> None:
    """The flags against the checkpoint --resume-from-checkpoint will load (flags.check_resume_flags), read-only: what
    the load refuses, refused before a live run is fenced (--force-takeover). The load checks again (a run still
    training may commit a newer checkpoint in between; its refused flags are the same)."""
    if (found := preview.found) is not None:
        check_resume_flags(args, found.saved, found.step)


def check_inputs(args: argparse.Namespace, env: distributed.DistEnv, preview: Preview | None = None):
    """flash-attn, the memory the configuration needs, and the data. Returns (tokenizer, training windows, model
    config, held-out windows or None)."""
    tokenizer, config, _ = check_model(args, env)
    windows, held_out = hold_out(load_data(args, env, tokenizer, preview), args.eval_windows, args.val_fraction)
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


def load_data(args: argparse.Namespace, env: distributed.DistEnv, tokenizer, preview: Preview | None):
    """--dataset's windows. A folder or glob: the ranks tokenize its shards together (dataset.load_sharded_windows), and
    a resumed run reads the shards its checkpoint records, whatever was added since."""
    if not is_sharded(args.dataset):
        return load_token_windows(args.dataset, tokenizer, args.sequence_length, cache_dir=args.data_cache_dir,
                                  column=args.text_column)
    return load_sharded_windows(args.dataset, tokenizer, args.sequence_length, cache_dir=args.data_cache_dir,
                                rank=env.rank, world_size=env.world_size,
                                exchange=lambda error: distributed.first_error(error, env),
                                recorded=recorded_shards(preview), column=args.text_column)


def recorded_shards(preview: Preview | None) -> list | None:
    """The shard list in the card of the checkpoint --resume-from-checkpoint names (read, not verified: the load
    verifies it, and compares the data's fingerprint), or None (no resume, none found, an older card)."""
    card = preview.card if preview is not None else None
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
    preview = session.prepare(dry_run=True)  # the folder judged writable, nothing made
    resume = "would start fresh (no --resume-from-checkpoint)"
    if args.resume_from_checkpoint:
        found = preview.found
        if found is None:
            resume = f"would start fresh: no checkpoint in {preview.root} yet"
        else:
            check_resume_flags(args, found.saved, found.step)
            resume = (f"would resume from step {found.step} of {preview.root} (--resume-from-checkpoint "
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
        f"checkpoint folder {preview.root}: writable",
        f"OK: {resume}; nothing was trained or written",
    ]
