"""Text from any checkpoint, without exporting it first (the idea of nanoGPT's sample.py):

    python evaluation.py sample CKPT [CKPT ...] --prompt "ROMEO." --max-new-tokens 50 [--temperature 0.8]
                                     [--top-k 200] [--seed 1] [--device cpu] [--tokenizer NAME_OR_PATH]

CKPT is a step folder, or a run folder (its newest committed checkpoint that verifies, as a resume takes it), of any
backend and world size: the weights are read as `python evaluation.py validate` and `hf.py export` read them
(checkpoint.reader), after the same verification as a resume (sizes and checksums: a corrupt checkpoint is one error
line). The model's shape comes from the checkpoint's card, the tokenizer from the flags it was trained with.

One process, the weights' own dtype, no autocast: for a seed the text is the same every time on one machine
(--temperature 0: the most likely token each step, no randomness at all). The context is the last max_seq_len tokens
(RoPE tables are the trained length's); no KV cache -- this is for looking at a checkpoint, not for serving it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def find_checkpoint(path) -> tuple[Path, dict]:
    """(step folder, verified manifest) of a step folder or of a run folder's newest valid checkpoint."""
    from checkpoint import layout, storage
    from checkpoint.errors import CheckpointError

    p = storage.as_path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; give a step folder or a run folder")
    if (p / layout.COMMITTED).exists() or (p / layout.MANIFEST).exists():
        if not (p / layout.COMMITTED).exists():
            raise CheckpointError(f"{p} is not committed (an interrupted save); give a committed step folder")
        return p, layout.verify(p)
    info = layout.resolve(p, "latest")  # skips (and names) any that fails verification, as a resume does
    if info is None:
        raise CheckpointError(f"{p} holds no committed checkpoint (expected a step-N folder or a run folder)")
    return info.path, info.manifest


def load_model(step_dir: Path, manifest: dict, device: torch.device) -> torch.nn.Module:
    """model.Transformer of the card's shape with the checkpoint's weights, in their dtype, on ``device``."""
    from checkpoint.errors import CheckpointError, first_line
    from checkpoint.reader import flatten, section_reader
    from hf import saved_model
    from model import ModelConfig, Transformer

    saved = saved_model(step_dir, manifest)
    weights = {k: v for k, v in flatten(section_reader(manifest["backend"])(step_dir, manifest, "model"))
               if isinstance(v, torch.Tensor)}
    torch.manual_seed(0)  # the weights are overwritten below; seeding keeps construction repeatable
    try:
        model = Transformer(ModelConfig(**saved.config))
        model.load_state_dict(weights, strict=True)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{step_dir}: the weights do not fit the model of its card: {first_line(e)}") from None
    dtype = weights["tok_embeddings.weight"].dtype  # fp32 for fp32/bf16/fp16 runs (autocast), fp64 for fp64
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def generate(model: torch.nn.Module, ids: list[int], max_new_tokens: int, *, temperature: float, top_k: int | None,
             vocab: int, generator: torch.Generator) -> list[int]:
    """``max_new_tokens`` ids after ``ids``: each from the last position's logits over the tokenizer's ``vocab``
    (a padded model vocabulary has ids no tokenizer decodes), greedy at temperature 0, else sampled from
    softmax(logits / temperature) restricted to the ``top_k`` most likely."""
    device = next(model.parameters()).device
    context = model.config.max_seq_len
    out = list(ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([out[-context:]], dtype=torch.long, device=device)
        logits = model(window)[0, -1, :vocab].float()
        if temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        out.append(nxt)
    return out[len(ids):]


def sample(path, prompt: str, max_new_tokens: int, *, temperature: float = 0.8, top_k: int | None = 200,
           seed: int = 1337, device: str = "cpu", tokenizer: str | None = None) -> tuple[Path, str]:
    """(the step folder read, prompt + its continuation)."""
    from checkpoint.errors import CheckpointError, first_line
    from hf import saved_model
    from tokenizer import DataError, load_tokenizer

    step_dir, manifest = find_checkpoint(path)
    name = tokenizer or saved_model(step_dir, manifest).tokenizer
    if not name:
        raise CheckpointError(f"{step_dir} does not name its tokenizer; pass --tokenizer NAME_OR_PATH")
    try:
        tok = load_tokenizer(name)
    except DataError as e:
        raise CheckpointError(f"{e} (the tokenizer {step_dir} was trained with; --tokenizer gives another)") from None
    try:
        where = torch.device(device)
        model = load_model(step_dir, manifest, where)
    except (RuntimeError, AssertionError) as e:  # e.g. --device cuda on a machine without one
        raise CheckpointError(f"cannot sample on device {device}: {first_line(e)}; use --device cpu") from None
    if tok.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"tokenizer {name} has {tok.vocab_size} tokens but the model's vocabulary is "
                              f"{model.config.vocab_size}; pass the --tokenizer the run trained with")
    ids = tok.encode_batch([prompt])[0] if prompt else []
    ids = ids or [tok.eos_id]  # nothing to continue: start as a new document does, after an end-of-text
    generator = torch.Generator().manual_seed(seed)  # on the CPU, where the draw happens: the same on any device
    new = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, vocab=tok.vocab_size,
                   generator=generator)
    return step_dir, prompt + tok.decode(new)


def run(args: argparse.Namespace) -> int:
    """`python evaluation.py sample ...` (its flags: evaluation.build_parser, checked by evaluation.parse_args): the
    text on stdout; which checkpoint on stderr."""
    for path in args.path:  # each from the same seed: checkpoints of one training give one text
        step_dir, text = sample(path, args.prompt, args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, seed=args.seed, device=args.device, tokenizer=args.tokenizer)
        print(f"--- {step_dir}" if len(args.path) > 1 else f"sample: {step_dir}",
              file=sys.stdout if len(args.path) > 1 else sys.stderr)
        print(text, flush=True)
    return 0
