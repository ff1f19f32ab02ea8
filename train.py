"""PyRecover: pre-train a Llama-style transformer that never loses work.

    python train.py --model small                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 train.py --distributed --model 1b   # DDP, one rank per GPU
    sbatch submit-training-simple.sh --distributed                  # SLURM, see docs/slurm.md

Reads top to bottom: preflight (preflight.py: bad input refused before any training time is spent) -> the run (model,
optimizer, data) -> the resume (a checkpoint.Session loads, then decides at every step boundary whether to save) -> the
loop -> finish. The flags are in flags.py, what is reported per step in metrics.py, the parallelism transform in
distributed.py, and checkpointing in checkpoint/ (six calls: prepare, take, load, start, step_boundary, close).
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
import traceback
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
from checkpoint import (CheckpointError, CheckpointState, Fenced, Loaded, Outcome, TrainState, install_signal_handlers,
                        setup_logging)
from dataset import DataError, TrainLoader, fingerprint, token_parts
from distributed import unwrap_model
from evaluation import (EVAL_BATCH, CardMaker, Evaluator, batch_loss, check_prediction, eval_window_count, evaluate,
                        run_layout)
from flags import (BadInput, apply_resume_flags, build_parser, check_numeric_flags,  # noqa: F401 (tests)
                   parse_args, RESOLVED_CONFIG, resolved_config, spell_settings, VERSION)
from metrics import Metrics, device_peak_flops, started_at, val_csv_path
from model import MemoryEstimate, ModelConfig, Transformer
from preflight import (Prepared, check_everything, check_inputs, check_resume,  # noqa: F401 (check_inputs: tests)
                       memory_estimate, open_session, preflight, say, source_positions)
import recovery
import schedules
import trackers

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
    Outcome.FINISHED: EXIT_FINISHED, Outcome.REQUEUED: EXIT_REQUEUE, Outcome.STOPPED: EXIT_STOPPED,
    Outcome.REQUEUE_FAILED: EXIT_REQUEUE_FAILED, Outcome.FENCED: EXIT_FENCED, Outcome.FINAL_SAVE_FAILED: EXIT_FAILED,
    BadInput: EXIT_BAD_INPUT, DataError: EXIT_BAD_INPUT, distributed.LaunchError: EXIT_BAD_INPUT,
    Fenced: EXIT_FENCED, CheckpointError: EXIT_FAILED,
}
USER_ERRORS = tuple(k for k in EXIT_FOR if isinstance(k, type))
#: what the last line says of a run stopped before --training-steps (the policy's line before it says why)
STOP_OUTCOMES = {Outcome.REQUEUED: "requeued", Outcome.STOPPED: "not requeued",
                 Outcome.REQUEUE_FAILED: "the requeue failed"}


def exit_code(error: BaseException) -> int:
    return next(EXIT_FOR[t] for t in type(error).__mro__ if t in EXIT_FOR)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------------
# Setup: preflight (preflight.py: bad input, before any collective) -> the run (model, optimizer, data) -> the resume
# ----------------------------------------------------------------------------------------------------------------------












































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
    memory = distributed.PeakMemory(env, held=prepared.preview.held())
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
    return Run(args, env, model, optimizer, scheduler, scaler, loader, distributed.autocast(env, args.model_dtype),
               progress, args.batch_size * args.gradient_accumulation_steps * args.sequence_length * env.world_size,
               memory, estimate)


def open_checkpoints(args: argparse.Namespace, run: Run, prepared: Prepared) -> Loaded:
    """The state to save, then the resume (checkpoint.Session.load): crashed incarnations' leftovers go, `latest` (or
    the given step) is loaded and checked against these flags and data, and only then are newer checkpoints of a line
    the run no longer follows moved aside. A checkpoint that cannot be resumed with these flags raises BadInput, with
    nothing moved."""
    env = run.env
    state = CheckpointState.for_training(
        config=vars(args) | {"model_config": vars(prepared.config)}, world_size=env.world_size,
        versions={"torch": str(torch.__version__), "pyrecover": __version__}, model=run.model,
        optimizer=run.optimizer, lr_scheduler=run.scheduler, dataloader=run.loader, train_state=run.progress,
        grad_scaler=run.scaler, backend=args.checkpoint_backend)
    run_info = state["run_info"]  # this run's facts; after the load, the checkpoint's beside them (.saved)
    applied: list[str] = []  # flags that differ from the checkpoint's and take effect ('resume: applying ...')

    def reconcile(loaded: Loaded) -> None:  # right after the load (or its failure: run_info loads first), before
        applied.extend(apply_resume_flags(args, run_info, loaded.step, run.optimizer, run.scheduler))  # anything moves
        check_same_model(args, run_info, prepared.config)
        if loaded.step is not None:
            check_same_data(args, run, prepared, loaded.info)
        if loaded.step is not None and args.validate_on_resume:
            validate_loaded(args, run, loaded.info)

    try:  # every flag's final value, rewritten each start (command line, --config, defaults): a record, not state
        loaded = prepared.session.load(state, check=reconcile, records={RESOLVED_CONFIG: resolved_config(args)})
    except (CheckpointError, DataError) as e:  # DataError: e.g. resharded to a global batch it does not fit
        raise BadInput(str(e)) from None
    if args.resume_from_checkpoint and loaded.step is None:
        log.info(f"no checkpoint found in {prepared.preview.root}; starting fresh from step 0")
    elif loaded.step is not None:
        run.progress.restarts += 1
        if args.init_from:
            log.info(f"resume: the checkpoint's weights are used; --init-from {args.init_from} applies to a fresh "
                     "start only")
        for line in applied + [f"warning: resumed run differs from the checkpoint: {d}" for d in run_info.differences(())]:
            log.info(line)  # the differences: world size, torch version
    return loaded


def check_same_model(args: argparse.Namespace, run_info, config: ModelConfig) -> None:
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


def build_evaluator(args: argparse.Namespace, run: Run, prepared: Prepared, metrics: Metrics,
                    loop) -> Evaluator | None:
    """The evaluations of the eval set (evaluation.py), or None without one: the same first windows every time, each
    rank its share, the sums all-reduced; reported (log line, val CSV, trackers) by rank 0. A stop may end one between
    its batches (``loop.interrupt``, the ranks agreeing as at a step boundary)."""
    if prepared.val is None:
        return None
    env, model = run.env, unwrap_model(run.model)
    count = eval_count(args, prepared)
    lockstep = env.distributed and args.parallel == "fsdp"  # every forward gathers the shards: all ranks run as many

    def evaluate_now() -> dict | None:  # None: a stop came during it (the session's vote between its batches)
        return evaluate(model, prepared.val, env.device, run.autocast, count=count, rank=env.rank,
                        world_size=env.world_size, lockstep=lockstep,
                        reduce=lambda values: distributed.sum_over_ranks(values, env),
                        stop=loop.interrupt)

    when = (f"every {args.eval_every} steps and at each save" if args.eval_every else "at each save")
    log.info(f"eval: {count} windows ({count * args.sequence_length} tokens) of "
             f"{args.val_dataset or prepared.val.source} {when}")
    def probe_now() -> float:  # every rank (FSDP's forward is a collective); bitwise evaluate()'s first batch
        return batch_loss(model, prepared.val.batch(range(min(EVAL_BATCH, count))), env.device, run.autocast)

    return Evaluator(evaluate_now, args.eval_every, metrics.note_eval, count=count, probe_at=probe_now,
                     observe=loop.observe_eval)


def eval_count(args: argparse.Namespace, prepared: Prepared) -> int:
    """The windows each evaluation reads (--eval-tokens of the eval set; 0: all)."""
    return eval_window_count(args.eval_tokens, args.sequence_length, len(prepared.val)) if prepared.val else 0


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


def evaluate_owed(run: Run, loaded: Loaded, evaluator: Evaluator | None) -> bool:
    """A run resumed from a stop that gave the step's evaluation no time (evaluation.Evaluator.owed): that evaluation
    first, from the same weights, so the val rows are an uninterrupted run's. A just-in-time save is not a stop's:
    its card records no evaluation either way. True: a stop came during this one too."""
    if evaluator is None or loaded.step is None:
        return False
    meta = loaded.info.manifest.get("meta", {})
    owed = not meta.get("jit") and evaluator.owed(loaded.step, meta.get("card", {}), loaded.scheduled)
    if distributed.all_reduce_max(float(owed), run.env) == 0:  # the same card everywhere; agreed all the same
        return False
    log.info(f"eval: step {loaded.step}'s evaluation gave way to the stop its checkpoint was saved for: evaluating it "
             "now")
    return evaluator(loaded.step) is None


def card_maker(args: argparse.Namespace, run: Run, prepared: Prepared, started: float):
    """``card(step, metrics, evaluation=None)``: the manifest meta every checkpoint carries (evaluation.py's card): the
    run's facts, the interval's losses, and an evaluation when the save made one (save_card)."""
    env, model = run.env, unwrap_model(run.model)
    # the probe is the first batch the evaluation reads (its loss is that batch's), however few windows it reads
    probe = prepared.val.batch(range(min(EVAL_BATCH, eval_count(args, prepared)))) if prepared.val else None
    # Only rank 0 commits a card (any rank may, in a just-in-time save): the others skip hashing the data at start-up.
    writes = env.is_main or args.jit_checkpoint
    make = CardMaker(args, env, prepared.config, model.num_params(), prepared.tokenizer.name,
                     data_fingerprint(prepared, args.text_column) if writes else None, probe, started, __version__,
                     json.loads(resolved_config(args)), shards=getattr(prepared.windows, "shards", None),
                     max_positions=source_positions(args))

    def card(step: int, metrics: Metrics, evaluation: dict | None = None) -> dict:
        return {"card": make(step=step, tokens_seen=run.progress.tokens_seen, losses=metrics.take_interval(),
                             lr=metrics.last_lr, evaluation=evaluation)}

    return card


def save_card(card, evaluator: Evaluator | None, metrics: Metrics, step: int):
    """``make(rushed)``, a periodic save's card (Session.step_boundary): the step's evaluation first (reused if
    --eval-every just made it; logged, rowed and tracked at ``step``). A stop's save (rushed) gets only the probe, one
    forward: the grace time before SIGKILL is the save's, and a full evaluation there would add a val row an
    uninterrupted run does not have."""
    def make(rushed: bool) -> dict:
        evaluation = None
        if evaluator is not None:
            evaluation = evaluator.probe_only(step) if rushed else evaluator(step)
            if evaluation is None:  # a stop came during it: this save becomes the stop's (Session.step_boundary)
                evaluation = evaluator.probe_only(step)
        meta = card(step, metrics, evaluation)
        metrics.sync()
        return meta
    return make


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


def build_metrics(args: argparse.Namespace, run: Run, prepared: Prepared, loaded: Loaded,
                  in_process: bool = False) -> Metrics:
    # The loss CSV and profiler traces stay on local disk: next to the checkpoints, or ./logs/<experiment> for s3://.
    log_dir = prepared.preview.log_dir or Path("logs") / args.experiment_name
    resumed, tokenizer, has_val = loaded.step, prepared.tokenizer, prepared.val is not None
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
                   world_size=env.world_size, imports=None if in_process else (_T_IMPORTS, _T_IMPORTED), profiler=profiler,
                   trackers=opened, tracker_dir=tracker_dir, tracker_names=tuple(names),
                   save_records=lambda: loaded.history, memory=run.memory, val_csv_path=val_csv,
                   evaluations=evaluations_between(args, has_val))


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
# --check: the pre-flight checks alone (e.g. on a login node, before sbatch; preflight.check_everything)
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


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global _PARSED
    if _PARENT_AT_START is not None:  # a warm standby's child follows the standby already (standby_child.run_child)
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


def train(args: argparse.Namespace, signals, started: float) -> int:
    t_start = time.perf_counter()
    if args.deterministic:  # before any CUDA work: cuBLAS reads its workspace setting when its first handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # Under launcher.py each process is a member of the job: a rank of generation 0, or a spare that sets up and waits
    member = recovery.Member() if args.distributed and recovery.enabled() else None
    if member is not None and args.parallel == "fsdp":
        raise BadInput("--parallel fsdp under launcher.py: in-process recovery rebuilds DDP ranks only (an FSDP shard "
                       "is not rebuilt on a new group); use --parallel ddp, or torchrun / srun (a failure restarts)")
    env = distributed.init(args.distributed, device=args.device, member=member)
    # --model-dtype auto -> bf16 or fp32 now, before anything reads it: the memory estimate, the card, the resume
    # comparison (a refused flag) and the evaluation's tolerance all see the dtype the run trains in
    args.model_dtype = distributed.resolve_dtype(args.model_dtype, env.device.type)
    spare = member is not None and member.spare
    setup_logging(1 if spare else env.rank)  # a waiting spare says nothing; rank 0 speaks for the job
    # Bad input is found on every rank before any collective; then the ranks agree, so none waits for another. Only
    # then does rank 0 take the run directory (a refusal after a --force-takeover would leave no run training).
    try:
        prepared = agreed(env, lambda: preflight(args, env, signals, started, member.down if member else None))
        if not spare:
            agreed(env, lambda: prepared.session.take(before_force=lambda: check_resume(args, prepared.preview)))
    except Refused:
        return EXIT_BAD_INPUT
    run = build_run(args, env, prepared)

    # The generations: one process group each. A failure ends one (every survivor keeps its process, its imports,
    # model and data); the next plan gives the dead ranks to spares, and all load the newest step they can reach.
    failure = Failure("", time.time()) if spare else None  # a spare's first step: a plan that gives it a rank
    while True:
        if failure is not None:
            joined = rejoin(args, run, prepared, member, failure, signals, started)
            if isinstance(joined, int):  # the job ended, or no spare was left
                return joined
            if isinstance(joined, Failure):  # another failure during the recovery: the next generation
                failure = joined
                continue
            run, prepared = joined
        result = generation(args, run, prepared, started, t_start, failure if failure and failure.plan else None,
                            member)
        if not isinstance(result, Failure):
            return result
        failure = result


@dataclasses.dataclass
class Failure:
    """What ended a generation on this rank, and the parts of its recovery's time (the recovery line)."""

    error: str  # the line: a peer's failure as this rank saw it (a collective's error), or this rank's own exception
    #             ("": a spare, which saw nothing fail)
    seen: float  # time.time() when this rank saw it
    own: bool = False  # this rank raised it (else a collective failed: a peer's failure)
    teardown_s: float = 0.0
    agree_s: float = 0.0
    plan: object = None  # recovery.Plan of the generation that follows (what failed, as the launcher saw it)


def generation(args: argparse.Namespace, run: Run, prepared: Prepared, started: float, t_start: float,
               recovered: Failure | None, member) -> int | Failure:
    """One process group's life: the load (or, after a recovery, the reload of the newest step every rank reaches),
    the loop, the end. Returns the exit code, or, under launcher.py (``member``), the Failure that ended the group."""
    env, session = run.env, prepared.session
    metrics = loop = None
    try:
        try:
            loaded = open_checkpoints(args, run, prepared)
        except BadInput as e:  # the same flags and checkpoint everywhere: all refuse here, none waits in a collective
            if env.is_main:
                say(f"error: {e}")
            return EXIT_BAD_INPUT
        if recovered is not None and loaded.step is None:  # failed before the first save: the survivors' weights
            if env.is_main:  # moved on from the start, and no checkpoint holds it; a fresh start is a new process's
                say("error: the failure came before the run's first checkpoint: nothing to recover in process; the run "
                    "starts again at the next start")
            session.abandon()
            return EXIT_REQUEUE
        metrics = build_metrics(args, run, prepared, loaded, in_process=recovered is not None)
        card = card_maker(args, run, prepared, started)
        if env.distributed and args.pg_timeout_seconds:
            distributed.set_timeout(args.pg_timeout_seconds)
        # From here on SIGTERM / --signal mean "save at the next step boundary and stop". --jit-checkpoint: a surviving
        # rank saves the last completed step when a peer fails, with its card.
        loop = session.start(reseed=lambda r: seed_everything(args.seed + r), ensure_logged=metrics.ensure_logged,
                             describe=lambda step: card(step, metrics))
        evaluator = build_evaluator(args, run, prepared, metrics, loop)

        # --- the loop ------------------------------------------------------------------------------------------------
        run.model.train()
        metrics.start(loaded.seconds)
        t_loop = time.perf_counter()
        # resumed from a stop that interrupted an evaluation: that one first (a stop during it saves its step again)
        stopped = (evaluate_owed(run, loaded, evaluator)
                   and session.step_boundary(run.progress.step, save_card(card, evaluator, metrics, run.progress.step)))
        while not stopped and run.progress.step < args.training_steps:
            t0 = time.perf_counter()
            loop.begin_step()  # --jit-checkpoint: from here until the optimizer step the last step's state is intact
            loss, lr, grad_norm = train_step(run, loop.before_update)
            loop.end_step()
            metrics.step(run.progress.step, loss, lr, grad_norm, time.perf_counter() - t0, run.progress.tokens_seen,
                         run.progress.restarts)
            if recovered is not None:  # the first step after a recovery: its line, once; the launcher hears of it
                recovery_line(env, recovered, loaded, time.perf_counter() - t0)
                member.stepped()
                recovered = None
            if evaluator is not None and evaluator.due(run.progress.step):  # after the optimizer step, before a save
                evaluator(run.progress.step)  # --eval-every: no RNG, no weight changes (evaluation.evaluate)
            if session.step_boundary(run.progress.step, save_card(card, evaluator, metrics, run.progress.step)):
                break
        same = replicas_agree(args, run)
        metrics.close()
        ending = session.close(run.progress.step, succeeded=same, run_seconds=time.perf_counter() - t_start)
    except Exception as e:
        if isinstance(e, USER_ERRORS):
            raise
        if member is None:  # a peer failed: this healthy rank saved the last completed step (or another did): requeue
            if loop is None or not loop.rescue(e):
                raise
            return EXIT_REQUEUE
        failure = Failure(distributed.failure_line(e), time.time(), own=not distributed.from_peer(e))
        if failure.own:  # this rank's own exception (a bug shows its traceback), before the recovery goes on
            say(f"rank {env.rank}'s exception, recovered in process:\n{traceback.format_exc().rstrip()}")
    else:
        return finish(args, run, ending, metrics, time.perf_counter() - t_loop)
    # under launcher.py this rank lives on into the next generation; torn down here, out of the except clause: the
    # exception's frames hold the DDP wrapper, and through it the group, whose sockets must close now
    return tear_down(run, session, metrics, failure)


def tear_down(run: Run, session, metrics: Metrics | None, failure: Failure) -> Failure:
    """A peer died or this rank raised: end this generation here without another collective. The session drops its
    saves in flight and releases the run folder; the loss rows so far are flushed (the next load drops those past its
    step); the DDP wrapper lets go of the parameters and is freed before its process group is destroyed, so the
    group's connections close and a peer still blocked in a collective with this rank fails at once too."""
    say(f"recovery (rank {run.env.rank}, pid {os.getpid()}): {failure.error}; leaving this process group, keeping the "
        "process")
    session.abandon()
    if metrics is not None:
        metrics.close()
    wrapper = distributed.release_wrapper(run.model)
    run.model = unwrap_model(run.model)
    distributed.leave(run.env, wrapper)
    failure.teardown_s = time.time() - failure.seen
    return failure


def rejoin(args: argparse.Namespace, run: Run, prepared: Prepared, member, failure: Failure, signals,
           started: float) -> tuple[Run, Prepared] | Failure | int:
    """Into the next generation: wait for its plan (a survivor says it is alive; a spare waits for a rank), build its
    process group, wrap the kept model again, open a session that resumes from `latest`. A Failure: the recovery
    itself failed (a member of the new generation died meanwhile), this generation is torn down too. An int: the exit
    code (the job ended while a spare waited, or no spare was left for a dead rank)."""
    t0 = time.time()
    plan = member.next_plan(failure.error if failure.own else None) if failure.error else member.wait_for_rank()
    if not failure.error:  # a spare saw nothing fail: its recovery starts with the plan that gives it a rank
        failure.seen = t0 = time.time()
    if plan.done is not None:
        return int(plan.done)
    if plan.abort is not None:  # the last committed step stands: a restart (requeue) resumes from it
        if run.env.is_main:
            say(f"error: {plan.abort}: no in-process recovery; the run resumes from its last checkpoint at the next "
                "start")
        return EXIT_REQUEUE
    env = model = session = None
    try:
        env = distributed.join(member, args.pg_timeout_seconds or 600.0, cuda=run.env.device.type == "cuda")
        setup_logging(env.rank)
        model = distributed.parallelize(unwrap_model(run.model), env, args.parallel, sync=False)  # the load follows
        run.optimizer.zero_grad(set_to_none=True)  # a step cut short left gradients behind
        loader = TrainLoader(prepared.windows, args.batch_size, env.rank, env.world_size, args.seed)
        args.resume_from_checkpoint = "latest"  # the newest step every rank can reach, verified as at a restart
        session, preview = open_session(args, env, signals, started, down=member.down)
        agreed(env, lambda: session.take())
    except Refused:
        return EXIT_FAILED
    except Exception as e:
        if isinstance(e, USER_ERRORS):
            raise
        again = Failure(distributed.failure_line(e), time.time(), own=not distributed.from_peer(e))
        say(f"recovery (rank {env.rank if env else '?'}, pid {os.getpid()}): {again.error}, while recovering into "
            f"generation {plan.generation}; leaving it, keeping the process")
        if session is not None:
            session.abandon()
        wrapper = distributed.release_wrapper(model) if model is not None else None
        model = None
        distributed.leave(env or run.env, wrapper)
        again.teardown_s = time.time() - again.seen
        return again
    run = dataclasses.replace(run, env=env, model=torch.compile(model) if args.compile else model, loader=loader,
                              tokens_per_step=args.batch_size * args.gradient_accumulation_steps * args.sequence_length
                              * env.world_size)  # a spare was built as one process
    failure.agree_s, failure.plan = time.time() - t0, plan
    return run, dataclasses.replace(prepared, session=session, preview=preview)


def recovery_line(env: distributed.DistEnv, failure: Failure, loaded: Loaded, first_step_s: float) -> None:
    """Rank 0: what failed, the step resumed, where from, and the time of each part of the recovery."""
    if not env.is_main:
        return
    plan = failure.plan
    died = [f.get("at") for f in plan.failed if isinstance(f.get("at"), (int, float))]
    detect = f"detect {max(0.0, failure.seen - min(died)):.2f}s, " if died else ""
    total = time.time() - (min(died) if died else failure.seen)
    log.info(f"recovery: {recovery.describe_failure(plan)} failed; generation {plan.generation} resumed step "
             f"{loaded.step} from {loaded.source or 'the run folder'} in-process; {detect}tear down "
             f"{failure.teardown_s:.2f}s, agree {failure.agree_s:.2f}s, load {loaded.seconds:.2f}s, first step "
             f"{first_step_s:.2f}s; {total:.2f}s in all")


def replicas_agree(args: argparse.Namespace, run: Run) -> bool:
    """DDP: every rank's parameters are the same after the last step (a collective); other layouts need no check."""
    if not (run.env.distributed and args.parallel == "ddp"):
        return True
    same = distributed.replicas_identical(run.model, run.env)
    log.info(f"replica check: parameters {'identical' if same else 'DIFFER'} across {run.env.world_size} ranks")
    return same


def finish(args: argparse.Namespace, run: Run, ending, metrics: Metrics, loop_s: float) -> int:
    """After the session closed (checkpoint.Ending: every save committed, requeued if the policy said so): report, and
    the exit code."""
    env = run.env
    if ending.outcome == Outcome.FENCED:  # this incarnation changed nothing since it was fenced: it only leaves
        if env.is_main:
            say(ending.line)
        distributed.shutdown(env)
        _KEEP_UNTIL_EXIT.append(run.model)
        return EXIT_FENCED
    if ending.outcome in (None, Outcome.FINAL_SAVE_FAILED):  # the replicas differ (said above), or the last save failed
        if ending.line:
            say(ending.line)
        return EXIT_FAILED
    measured = run.memory.peak_growth()
    log.info(f"memory measured: {measured / 2**20:,.1f} MiB peak on rank 0 ({run.memory.describe()}); estimate "
             f"{run.estimate.total / 2**20:,.1f} MiB ({100 * (run.estimate.total / max(measured, 1) - 1):+.1f}%)")
    log.info(ending.summary)
    # last, once the outcome is known: a stop (signal, walltime) is not "done"
    ended = (f"done: {run.progress.step} steps" if ending.outcome == Outcome.FINISHED else
             f"stopped at step {run.progress.step} of {args.training_steps} ({STOP_OUTCOMES[ending.outcome]})")
    log.info(f"{ended}, final loss {metrics.last_loss:.4f}, {loop_s:.1f}s in the loop")
    distributed.shutdown(env)
    _KEEP_UNTIL_EXIT.append(run.model)  # see __main__: freeing DDP's reducer here can hang the process
    return EXIT_FOR[ending.outcome]


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
    """This process is a warm standby's child running a rank (warm.py): its launcher is the standby (which it follows
    already), its imports took no time, and its start is the rank process's, ``rank_age_s`` ago."""
    global _PARENT_AT_START, _T_IMPORTS, _T_IMPORTED
    _PARENT_AT_START = None
    _T_IMPORTS = _T_IMPORTED = time.monotonic()
    started_at(time.monotonic() - rank_age_s)


if __name__ == "__main__":
    exit_process(cli())
