"""What a manifest's ``meta`` may hold (META_SCHEMA), and the checks of single values layout.check_manifest uses: the
manifest's structure is checked once, when it is read, so no reader has to defend itself."""

from __future__ import annotations

import json


def show(value, limit: int = 60) -> str:
    """A JSON value in an error message: short, and saying what kind of thing it is."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
    text = json.dumps(value) if not isinstance(value, (dict, list)) else ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{kind} {text}" if text and value is not None else kind


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Bounds on sealed numbers: anything beyond is not a value a run can have written, and would overflow what reads it.
MAX_STEP = 10**15
MAX_WORLD_SIZE = 1 << 24
MAX_FILE_SIZE = 1 << 50
MAX_INT = 1 << 63


def is_number(value) -> bool:
    """A float (NaN and infinity too: a diverged run records its loss as it was), or an int in range."""
    return isinstance(value, float) or (is_int(value) and abs(value) < MAX_INT)


def _is_count(value) -> bool:
    return is_int(value) and 0 <= value < MAX_INT


def _is_token_rows(value) -> bool:
    """The card's probe: a rectangle of token ids (a batch of windows), what torch.tensor(..., long) takes."""
    return (isinstance(value, list) and all(isinstance(r, list) for r in value)
            and len({len(r) for r in value}) <= 1 and all(_is_count(t) and t < 1 << 31 for r in value for t in r))


def _is_shard_list(value) -> bool:
    """The card's shards of a folder/glob dataset: [[name, size in bytes], ...]."""
    return isinstance(value, list) and all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                                           and _is_count(r[1]) for r in value)


_OPT_NUM = (is_number, type(None))  # a loss or learning rate the card records as null when there was none
_OPT_STR = (str, type(None))

# Every field of a manifest's ``meta`` that some reader uses (list, inspect, retention --keep-best, validate, export,
# the resume checks), with what it must be: a type, a tuple of alternatives, a predicate, or a nested schema. Fields
# may be absent (older checkpoints; a just-in-time save has no eval); present, they must fit, or the manifest is
# malformed -- checked once, when it is read, so no reader has to defend itself.
META_SCHEMA = {
    "jit": bool,
    "tier": {"origin": str, "lineage": str, "job": str, "rank": _is_count, "leader": _is_count,
             "world_size": _is_count, "generation": _is_count},
    "card": {
        "model": {"preset": str, "params": _is_count, "config": dict},
        "data": {"dataset": str, "fingerprint": _OPT_STR, "tokenizer": _OPT_STR, "sequence_length": _is_count,
                 "eval_windows": _is_count, "shards": _is_shard_list},
        "hyperparameters": dict,
        "retention": {"keep": _is_count, "keep_every": _is_count, "keep_best": _is_count},
        "layout": {"device": _OPT_STR, "dtype": str, "attention": _OPT_STR, "world_size": _is_count},
        "versions": dict,
        "note": str,
        "flags": dict,
        "progress": {"step": _is_count, "tokens_seen": _is_count, "loss_last": _OPT_NUM, "loss_mean": _OPT_NUM,
                     "loss_steps": _is_count, "learning_rate": _OPT_NUM},
        "time": {"saved_utc": str, "run_wall_s": is_number},
        "eval": {"probe_loss": is_number, "eval_loss": is_number, "probe_tokens": (_is_token_rows, type(None)),
                 "val_loss": is_number, "val_ppl": is_number, "val_tokens": _is_count},
    },
}


def meta_problem_at(value, schema, where: str) -> str | None:
    """What in ``value`` does not fit ``schema`` (see META_SCHEMA), as one phrase; None if it fits."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where} is {show(value)}, expected an object"
        for key, sub in schema.items():
            if key in value and (problem := meta_problem_at(value[key], sub, f"{where}.{key}")):
                return problem
        return None
    alternatives = schema if isinstance(schema, tuple) else (schema,)
    for alt in alternatives:
        if isinstance(alt, type):
            if isinstance(value, alt) and not (alt is not bool and isinstance(value, bool)):
                return None
        elif alt(value):
            return None
    return f"{where} is {show(value)}, which no PyRecover writes"


def meta_problem(meta) -> str | None:
    """What in a manifest's ``meta`` does not fit META_SCHEMA, as one phrase; None if it fits."""
    return meta_problem_at(meta, META_SCHEMA, "meta")
