"""Hugging Face Llama <-> model.py, outside the checkpoint library because it knows model.py's parameter names and
tokenizer.py (the library knows no model): one name table (``hf_names``) used both ways; export of a committed
checkpoint's model to a transformers folder (``python hf.py export SRC OUT --to hf``); reading such a folder
(``read_hf``, ``model_config_from_hf``) for train.py --init-from and --model CONFIG.json.

The mapping is one-to-one, no tensor is transformed: our blocks are the Llama blocks (pre-norm RMSNorm, SwiGLU with
w1 = gate, w3 = up, w2 = down, grouped-query attention where query head h reads KV head h // (n_heads / n_kv_heads)),
and model.apply_rope already rotates the pairs (i, i + head_dim/2), transformers' ``rotate_half`` convention, so the
q/k rows need no permutation.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointError, first_line

FORMATS = ("hf",)
DEFAULT_MAX_SHARD_SIZE = "2GB"  # transformers' own default for save_pretrained
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype; DTYPES (below, torch) maps them
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"2GB"`` (10^9), ``"500MiB"`` (2^20), ``"1000"`` (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; write e.g. 2GB, 500MB, 512MiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])


# --- command line: before torch -------------------------------------------------------------------------------------
# Run as a program, this module parses its command line before it imports torch (below): --help, a bad flag, a bad
# --max-shard-size or a missing SRC answer at once.

_USAGE = """\
    export SRC OUT --to hf [--max-shard-size 2GB] [--dtype D] [--tokenizer T] [--force]
                   write SRC's model as a Hugging Face Llama folder OUT, what
                   transformers.LlamaForCausalLM.from_pretrained(OUT) reads: config.json, generation_config.json,
                   model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json beyond
                   --max-shard-size), tokenizer.json / tokenizer_config.json (+ tokenizer.model) where the training
                   tokenizer has a Hugging Face form. OUT is written beside and renamed into place: whole or absent.
SRC is a step folder or an experiment folder (its latest), of any backend and world size, and may be
s3://bucket/prefix (AWS_* variables; the s3 extra); OUT is a local folder.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python hf.py", description=__doc__.split("\n\n")[0] + "\n\n" + _USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    exp = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face Llama folder")
    exp.add_argument("src", help="step folder, or experiment folder (its latest)")
    exp.add_argument("out", help="folder to create (empty or absent; --force replaces an earlier export)")
    exp.add_argument("--to", required=True, choices=list(FORMATS))
    exp.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                     help="largest safetensors file, e.g. 2GB, 500MB (default 2GB)")
    exp.add_argument("--dtype", choices=list(DTYPE_NAMES), help="cast the weights (default: as saved)")
    exp.add_argument("--tokenizer", help="tokenizer name or path (default: the one the run trained with)")
    exp.add_argument("--force", action="store_true", help="replace a non-empty OUT (never a checkpoint folder)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line and what can be checked of it with nothing loaded (CheckpointError, one line)."""
    args = build_parser().parse_args(argv)
    from checkpoint import storage  # stdlib, numpy

    parse_size(args.max_shard_size)
    if not (src := storage.as_path(args.src)).exists():  # reader.locate's refusal, before torch
        raise CheckpointError(f"{src} does not exist")
    return args


_PARSED: argparse.Namespace | None = None  # the command line as parsed below, run as a program (main takes it)
if __name__ == "__main__":
    from badinput import parse_first

    _PARSED = parse_first(parse_args, (CheckpointError, OSError))

import torch  # noqa: E402 - after the command line (above)

from checkpoint import fsio, layout, logs, storage  # noqa: E402
from checkpoint.reader import flatten, locate, section_reader  # noqa: E402

_log = logging.getLogger("pyrecover.hf")  # a root logs.setup configures

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
_CONFIG_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "rope_theta",
                "norm_eps")
INDEX = "model.safetensors.index.json"
#: every name an export writes into OUT: --force replaces a folder holding only these (anything else is the user's)
EXPORT_FILE_RE = re.compile(r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
                            r"|config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json"
                            r"|tokenizer\.model)$")


# --- what the checkpoint holds ---------------------------------------------------------------------------------------


@dataclass
class Saved:
    """What the checkpoint says about the model it holds."""

    config: dict  # model.ModelConfig as a dict
    preset: str | None  # --model
    tokenizer: str | None  # --tokenizer-name-or-path (a name, or a path as given to train.py)
    max_positions: int | None = None  # the source config.json's max_position_embeddings (a preset: None)


def saved_model(where, manifest: dict) -> Saved:
    """The card's model (``meta.card``) when the manifest has one, else the run configuration in ``run_info``."""
    card = manifest.get("meta", {}).get("card")
    card = card if isinstance(card, dict) else {}
    card_model = card.get("model") if isinstance(card.get("model"), dict) else {}
    card_config = card_model.get("config")
    try:
        info = section_reader(manifest["backend"])(where, manifest, "run_info")
        run_config = json.loads(info["config_json"])
    except CheckpointError:  # no run_info: a checkpoint written by something else than train.py
        run_config = {}
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: run_info is unreadable (no valid config_json)") from None
    config = card_config if isinstance(card_config, dict) else run_config.get("model_config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} records no model configuration (neither a card in its manifest nor a "
                              "run_info with model_config); export needs a checkpoint saved by train.py")
    missing = [k for k in _CONFIG_KEYS if k not in config]
    if missing:
        raise CheckpointError(f"{where}: the saved model configuration lacks {', '.join(missing)}")
    card_data = card.get("data") if isinstance(card.get("data"), dict) else {}
    positions = card_model.get("max_position_embeddings")
    return Saved(config, card_model.get("preset") or run_config.get("model"),
                 run_config.get("tokenizer_name_or_path") or card_data.get("tokenizer"),
                 positions if isinstance(positions, int) and not isinstance(positions, bool) else None)


def _tied(config: dict) -> bool:
    return bool(config.get("tie_embeddings", False))  # configurations saved before the field existed: untied


def hf_names(config: dict) -> dict[str, str]:
    """Our parameter name -> the transformers Llama name, in the order transformers lists them; the one mapping both
    directions use (export here, ``read_hf`` for train.py --init-from). Tied embeddings: no lm_head.weight, as
    transformers saves them (its output layer is the embedding matrix)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(int(config["n_layers"])):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names.update({
            ours + "attention_norm.weight": theirs + "input_layernorm.weight",
            ours + "attention.wq.weight": theirs + "self_attn.q_proj.weight",
            ours + "attention.wk.weight": theirs + "self_attn.k_proj.weight",
            ours + "attention.wv.weight": theirs + "self_attn.v_proj.weight",
            ours + "attention.wo.weight": theirs + "self_attn.o_proj.weight",
            ours + "ffn_norm.weight": theirs + "post_attention_layernorm.weight",
            ours + "feed_forward.w1.weight": theirs + "mlp.gate_proj.weight",
            ours + "feed_forward.w3.weight": theirs + "mlp.up_proj.weight",
            ours + "feed_forward.w2.weight": theirs + "mlp.down_proj.weight",
        })
    names["norm.weight"] = "model.norm.weight"
    if not _tied(config):
        names["output.weight"] = "lm_head.weight"
    return names


def _shapes(config: dict) -> dict[str, tuple[int, ...]]:
    d, f, v = int(config["dim"]), int(config["ffn_dim"]), int(config["vocab_size"])
    kv = int(config["n_kv_heads"]) * (d // int(config["n_heads"]))
    per_block = {"attention_norm.weight": (d,), "attention.wq.weight": (d, d), "attention.wk.weight": (kv, d),
                 "attention.wv.weight": (kv, d), "attention.wo.weight": (d, d), "ffn_norm.weight": (d,),
                 "feed_forward.w1.weight": (f, d), "feed_forward.w3.weight": (f, d), "feed_forward.w2.weight": (d, f)}
    shapes = {"tok_embeddings.weight": (v, d), "norm.weight": (d,)}
    for i in range(int(config["n_layers"])):
        shapes.update({f"layers.{i}.{k}": s for k, s in per_block.items()})
    if not _tied(config):
        shapes["output.weight"] = (v, d)
    return {ours: shapes[ours] for ours in hf_names(config)}


def hf_state_dict(config: dict, tensors: dict[str, Any], where) -> dict[str, torch.Tensor]:
    """The model section renamed for transformers, after checking every tensor's presence and shape."""
    expected = _shapes(config)
    for name, shape in expected.items():
        t = tensors.get(name)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{where}: the model section has no tensor {name!r}; not a checkpoint of model.py's "
                                  "Transformer with the saved configuration")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(t.shape)}, the saved configuration says "
                                  f"{list(shape)}")
    extra = sorted(set(tensors) - set(expected))
    if _tied(config) and "output.weight" in extra:  # the state dict names the shared matrix twice
        if not torch.equal(tensors["output.weight"], tensors["tok_embeddings.weight"]):
            raise CheckpointError(f"{where}: the configuration ties the embeddings but output.weight differs from "
                                  "tok_embeddings.weight")
        extra.remove("output.weight")
    if extra:
        raise CheckpointError(f"{where}: the model section holds {len(extra)} tensor(s) this export does not know, "
                              f"e.g. {extra[0]!r}")
    return {theirs: tensors[ours] for ours, theirs in hf_names(config).items()}


# --- reading a Hugging Face Llama folder IN (train.py --init-from, --model CONFIG.json) ----------------------------

# HF config.json key -> our ModelConfig field, and the value LlamaConfig assumes when the key is absent (None: required)
_FROM_HF = (("hidden_size", "dim", None), ("num_hidden_layers", "n_layers", None),
            ("num_attention_heads", "n_heads", None), ("num_key_value_heads", "n_kv_heads", None),
            ("intermediate_size", "ffn_dim", None), ("vocab_size", "vocab_size", 32000),
            ("max_position_embeddings", "max_seq_len", 2048), ("rope_theta", "rope_theta", 10000.0),
            ("rms_norm_eps", "norm_eps", 1e-6), ("tie_word_embeddings", "tie_embeddings", False))


def model_config_from_hf(hf: Any, where) -> dict:
    """ModelConfig fields (a dict) of a transformers Llama config.json; CheckpointError (one line) for anything
    model.py would compute differently: another model type, RoPE scaling, biases, another activation or head size."""
    def refuse(why: str):
        raise CheckpointError(f"{where}: {why}; model.py trains plain Llama models (model_type llama, default RoPE, "
                              "no biases, silu, head_dim = hidden_size / num_attention_heads)")

    if not isinstance(hf, dict):
        refuse(f"expected a JSON object, got a {type(hf).__name__}")
    if hf.get("model_type") != "llama":
        refuse(f"model_type {hf.get('model_type')!r} is not supported")
    if hf.get("rope_scaling") not in (None, {}):
        refuse(f"rope_scaling {json.dumps(hf['rope_scaling'])} is not supported")
    rope = hf.get("rope_parameters")  # transformers 5 spelling of rope_theta (+ scaling)
    if rope is not None:
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
            refuse(f"rope_parameters {json.dumps(rope)} is not supported (only rope_type default)")
        hf = {**hf, "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0))}
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(f"{key} true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {hf['hidden_act']!r} is not supported")
    if hf.get("num_key_value_heads") is None:  # LlamaConfig: plain multi-head attention
        hf = {**hf, "num_key_value_heads": hf.get("num_attention_heads")}
    ours: dict[str, Any] = {}
    for theirs, field_name, default in _FROM_HF:
        value = hf.get(theirs, default)
        if value is None:
            refuse(f"{theirs} is missing")
        kind = bool if field_name == "tie_embeddings" else float if field_name in ("rope_theta", "norm_eps") else int
        if kind is bool and not isinstance(value, bool) or kind is int and (isinstance(value, bool) or
                                                                             not isinstance(value, int)) \
                or kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            refuse(f"{theirs} {json.dumps(value)} is not a{'n integer' if kind is int else ' ' + kind.__name__}")
        if kind is float and not math.isfinite(value):  # JSON's NaN / Infinity: no comparison says what is wrong
            raise CheckpointError(f"{where}: {theirs} {json.dumps(value)} is not a finite number; give a positive "
                                  "number")
        if kind is not bool and value <= 0:
            refuse(f"{theirs} {value} must be positive")
        ours[field_name] = kind(value)
    if ours["dim"] % ours["n_heads"] or ours["n_heads"] % ours["n_kv_heads"]:
        refuse(f"hidden_size {ours['dim']}, num_attention_heads {ours['n_heads']} and num_key_value_heads "
               f"{ours['n_kv_heads']} do not divide evenly")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != ours["dim"] // ours["n_heads"]:
        refuse(f"head_dim {head_dim} is not hidden_size / num_attention_heads = {ours['dim'] // ours['n_heads']}")
    return ours


def read_hf(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """(ModelConfig fields, tensors by our parameter names) of a transformers Llama folder: config.json and
    model.safetensors, or model-*.safetensors listed by model.safetensors.index.json. Shapes are checked against the
    config; anything missing, extra or misshapen is a one-line CheckpointError."""
    import safetensors.torch

    folder = Path(folder)
    config = check_hf(folder)  # config.json and what the headers say, before any tensor is read
    theirs: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            theirs.update(safetensors.torch.load_file(path))
        except Exception as e:  # safetensors' own error types; a truncated or foreign file
            raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None
    if config["tie_embeddings"] and "lm_head.weight" in theirs:  # some savers keep the tied copy
        if not torch.equal(theirs["lm_head.weight"], theirs.get("model.embed_tokens.weight", torch.empty(0))):
            raise CheckpointError(f"{folder}: config.json ties the embeddings but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
        del theirs["lm_head.weight"]
    names = hf_names(config)
    expected = _shapes(config)
    tensors = {}
    for ours, hf_name in names.items():
        t = theirs.pop(hf_name, None)
        if t is None:
            raise CheckpointError(f"{folder}: no tensor {hf_name!r}; not a Llama model with its config.json's shape")
        if tuple(t.shape) != expected[ours]:
            raise CheckpointError(f"{folder}: tensor {hf_name!r} has shape {list(t.shape)}, config.json says "
                                  f"{list(expected[ours])}")
        # Weights to train from are finite floating-point numbers: an integer (or bool) tensor would be cast to float
        # silently, and a NaN or Inf spreads through the first step into every later checkpoint.
        if not t.is_floating_point():
            raise CheckpointError(f"{folder}: tensor {hf_name!r} is {str(t.dtype).removeprefix('torch.')}, not "
                                  "floating point; give weights saved as float32, bfloat16 or float16")
        if not bool(torch.isfinite(t).all()):
            what = "NaN" if bool(torch.isnan(t).any()) else "infinite"
            raise CheckpointError(f"{folder}: tensor {hf_name!r} holds {what} values (a diverged or corrupted "
                                  "model); give finite weights")
        tensors[ours] = t
    extra = sorted(n for n in theirs if not n.endswith("rotary_emb.inv_freq"))  # old transformers saved RoPE buffers
    if extra:
        raise CheckpointError(f"{folder}: {len(extra)} tensor(s) a Llama model does not have, e.g. {extra[0]!r}")
    return config, tensors


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: model.safetensors, or those its index lists."""
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{folder / INDEX} is unreadable (no weight_map)") from None
    elif (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or {INDEX} (only safetensors weights are read)")
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise CheckpointError(f"{folder / INDEX} lists {name!r}, which is not a file in {folder}")
    return [folder / name for name in names]


#: safetensors' floating-point dtypes, as its headers spell them
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FN", "F8_E5M2FNUZ", "F8_E4M3FNUZ"}
_INT_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
               "U32": "uint32", "I64": "int64", "U64": "uint64"}  # as torch names them


def check_headers(folder: Path, config: dict, files: list[Path]) -> None:
    """Every file's header readable, and the tensors it lists those of ``config``'s Llama model, of its shapes, in
    floating point: what can be known without reading the weights (--check, and read_hf before it reads them).
    CheckpointError, one line."""
    from safetensors import safe_open

    listed: dict[str, tuple[list[int], str]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    listed[name] = (list(part.get_shape()), str(part.get_dtype()))
        except Exception as e:  # safetensors' own error types; a truncated or foreign file
            raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None
    expected = _shapes(config)
    for ours, hf_name in hf_names(config).items():
        if hf_name not in listed:
            raise CheckpointError(f"{folder}: no tensor {hf_name!r}; not a Llama model with its config.json's shape")
        shape, dtype = listed[hf_name]
        if tuple(shape) != expected[ours]:
            raise CheckpointError(f"{folder}: tensor {hf_name!r} has shape {shape}, config.json says "
                                  f"{list(expected[ours])}")
        if dtype.upper() not in _FLOAT_DTYPES:
            shown = _INT_DTYPES.get(dtype.upper(), dtype)
            raise CheckpointError(f"{folder}: tensor {hf_name!r} is {shown}, not floating point; give weights saved "
                                  "as float32, bfloat16 or float16")


def check_hf(folder) -> dict:
    """read_hf's checks that need no tensor read (config.json, the weight files, their headers): the ModelConfig
    fields. For --check, which must not read gigabytes on a login node."""
    folder = Path(folder)
    try:
        hf = json.loads((folder / "config.json").read_text())
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot read config.json ({e.strerror or e}); give a folder saved by "
                              "transformers (save_pretrained) or by `python hf.py export`") from None
    except ValueError as e:
        raise CheckpointError(f"{folder / 'config.json'} is not valid JSON ({e})") from None
    config = model_config_from_hf(hf, folder / "config.json")
    check_headers(folder, config, _weight_files(folder))
    return config


# --- tokenizer ------------------------------------------------------------------------------------------------------


@dataclass
class TokenizerExport:
    files: dict[str, bytes] = field(default_factory=dict)
    bos_id: int | None = None
    eos_id: int | None = None
    note: str | None = None  # one line: what was not exported and why


# Texts the converted SentencePiece tokenizer must encode exactly as SentencePiece does before it is exported: word
# starts, runs of spaces and newlines (whitespace-only pieces), tabs, digits, punctuation, code, accents, CJK, emoji,
# characters outside the vocabulary (byte fallback), compatibility forms NFKC would change.
_PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,   three inside,\ttab\tand trailing   ",
    " one leading space\n\nTHE TRAGEDY OF HAMLET, PRINCE OF DENMARK\n\n    SCENE I. Elsinore.\n",
    "1 Corinthians 13:4-7 -- 1234567890 3.14159 $9.99 100% #1 @user",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "ünïcödé café naïve Ærøskøbing Straße 日本語のテキスト 中文 한국어 🙂👍🏽",
    "ﬁ ｆｕｌｌｗｉｄｔｈ ① ½ Å \x00\x7f \u200b",
    "\n", " ", "a", "",
)


def _sentencepiece_to_hf(model_file: Path):
    """(a ``tokenizers`` BPE equal to a SentencePiece BPE model (byte fallback, ``▁`` dummy prefix) or None when the
    model cannot be expressed that way (a unigram model, another normalisation): the probes decide; the model).

    SentencePiece BPE merges, among the adjacent pairs whose concatenation is a piece, the one giving the piece of
    highest score, so a merge list ordered by the merged piece's score reproduces it."""
    import sentencepiece
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    n = sp.vocab_size()
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    plain = {sp.id_to_piece(i): i for i in range(n) if i not in special and not sp.is_byte(i)}
    merges = sorted((-sp.get_score(pid), pid, plain[piece[:k]], plain[piece[k:]], piece[:k], piece[k:])
                    for piece, pid in plain.items() for k in range(1, len(piece))
                    if piece[:k] in plain and piece[k:] in plain)
    tok = Tokenizer(BPE(vocab={sp.id_to_piece(i): i for i in range(n)}, merges=[m[-2:] for m in merges],
                        unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
    probes = list(_PROBES)
    if sp.encode(probes) != [e.ids for e in tok.encode_batch(probes, add_special_tokens=False)]:
        return None, sp
    return tok, sp


def tokenizer_files(name_or_path: str, vocab_size: int, max_seq_len: int, explicit: bool = False) -> TokenizerExport:
    """The Hugging Face files of the tokenizer a run trained with (tokenizer.py's names and paths). A tokenizer the
    checkpoint names but this machine cannot load is left out with a note; one asked for (``explicit``) is an error."""
    try:
        import tokenizer as tokenizers_module  # the project's tokenizer.py, beside this module
    except ImportError:
        return TokenizerExport(note=f"tokenizer {name_or_path} not exported: the project's tokenizer module is not "
                                    "importable here")
    try:
        tok = tokenizers_module.load_tokenizer(name_or_path)
    except tokenizers_module.DataError as e:
        if explicit:
            raise CheckpointError(f"--tokenizer: {e}") from None
        return TokenizerExport(note=f"tokenizer not exported: {e}; pass --tokenizer NAME_OR_PATH")
    if tok.vocab_size > vocab_size:  # a larger model vocabulary (padded, as many HF models are) is fine
        raise CheckpointError(f"tokenizer {name_or_path} has {tok.vocab_size} tokens but the model's vocabulary is "
                              f"{vocab_size}; pass the --tokenizer the run trained with")
    # encode_batch adds no BOS/EOS in training, so neither does the exported tokenizer (no post-processor).
    config = {"model_max_length": max_seq_len, "clean_up_tokenization_spaces": False}
    if isinstance(tok, tokenizers_module.HFTokenizer):
        files = {"tokenizer.json": tok.path.read_bytes()}
        own_config = tok.path.parent / "tokenizer_config.json"
        if own_config.is_file():
            files["tokenizer_config.json"] = own_config.read_bytes()
        else:
            spec = json.loads(files["tokenizer.json"])
            eos_piece = next((t["content"] for t in spec.get("added_tokens", []) if t.get("id") == tok.eos_id), None)
            files["tokenizer_config.json"] = _json({"tokenizer_class": "PreTrainedTokenizerFast",
                                                    "eos_token": eos_piece, **config})
        return TokenizerExport(files=files, eos_id=tok.eos_id)
    if isinstance(tok, tokenizers_module.SentencePieceTokenizer):
        converted, sp = _sentencepiece_to_hf(tok.path)
        bos = sp.bos_id() if sp.bos_id() >= 0 else None
        files = {"tokenizer.model": tok.path.read_bytes()}
        special = {"bos_token": sp.id_to_piece(bos) if bos is not None else None,
                   "eos_token": sp.id_to_piece(sp.eos_id()), "unk_token": sp.id_to_piece(sp.unk_id())}
        if converted is None:
            files["tokenizer_config.json"] = _json({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
                                                    "add_eos_token": False, **special, **config})
            return TokenizerExport(files=files, bos_id=bos, eos_id=tok.eos_id,
                                   note=f"tokenizer {tok.name}: tokenizer.json not exported (this SentencePiece model "
                                        "does not convert exactly to a Hugging Face BPE); tokenizer.model is, for "
                                        "transformers' own (sentencepiece + protobuf) conversion")
        files["tokenizer.json"] = converted.to_str().encode()
        files["tokenizer_config.json"] = _json({"tokenizer_class": "PreTrainedTokenizerFast", **special, **config})
        return TokenizerExport(files=files, bos_id=bos, eos_id=tok.eos_id)
    return TokenizerExport(eos_id=tok.eos_id,
                           note=f"tokenizer {tok.name} not exported: this export writes SentencePiece and "
                                "tokenizer.json tokenizers only; encode with tokenizer.load_tokenizer"
                                f"({tok.name!r}) (tiktoken / mistral-common)")


# --- writing OUT ---------------------------------------------------------------------------------------------------


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def hf_config(config: dict, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              max_positions: int | None = None) -> dict:
    """config.json for transformers' LlamaConfig (field names of transformers 4.x and 5.x: ``rope_theta`` for the
    former, ``rope_parameters`` for the latter). max_position_embeddings: ``max_positions`` (the run's source
    config.json had it; RoPE has no table that limits it) else the training sequence length, which
    ``pyrecover_training_sequence_length`` records either way (transformers keeps unknown keys)."""
    head_dim = int(config["dim"]) // int(config["n_heads"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": int(config["dim"]),
        "intermediate_size": int(config["ffn_dim"]),
        "num_hidden_layers": int(config["n_layers"]),
        "num_attention_heads": int(config["n_heads"]),
        "num_key_value_heads": int(config["n_kv_heads"]),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max(int(max_positions or 0), int(config["max_seq_len"])),
        "pyrecover_training_sequence_length": int(config["max_seq_len"]),
        "rms_norm_eps": float(config["norm_eps"]),
        "rope_theta": float(config["rope_theta"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config["rope_theta"])},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": _tied(config),
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def plan_shards(tensors: dict[str, torch.Tensor], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most ``max_bytes`` each, in order (a tensor larger than that is a shard of its
    own, as in transformers)."""
    shards: list[list[str]] = [[]]
    size = 0
    item = torch.empty((), dtype=dtype).element_size()
    for name, t in tensors.items():
        nbytes = t.numel() * item
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _prepare_out(out: Path, force: bool, source: Path) -> None:
    """Refuse an OUT that must not be replaced."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; choose a folder for OUT")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise CheckpointError(f"{out} is not empty; choose another OUT, or pass --force to replace it")
    resolved = out.resolve()
    src = Path(str(source)).resolve() if storage.medium(source).filesystem else None
    if (resolved / layout.MANIFEST).exists() or layout.list_checkpoints(resolved) or \
            (src is not None and (src == resolved or resolved in src.parents)):
        raise CheckpointError(f"{out} holds checkpoints; --force replaces only an earlier export, never a checkpoint "
                              "folder")
    if not (resolved / "config.json").is_file() or not any(resolved.glob("*.safetensors")):
        raise CheckpointError(f"{out} is not an earlier export (no config.json and *.safetensors); --force replaces "
                              "only that: choose another OUT")
    storage.check_owned(out, EXPORT_FILE_RE.match, "--force replaces only what an export wrote: move them out, or "
                                                    "choose another OUT")


def _publish(staging: Path, out: Path) -> None:
    """Put the complete export in place; a replaced OUT is deleted only after the new one is there. Where the
    filesystem can, the two folders swap names in one step, so OUT is never missing, not even across a power cut
    (tests/powerloss found the gap between the two renames below); elsewhere two renames, the old one kept until the
    new one is in place."""
    old, swapped = None, False
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        swapped = fsio.exchange(staging, out)
        os.rename(staging if swapped else out, old)  # the earlier export, under a name the caller never removes
    if not swapped:
        try:
            os.replace(staging, out)  # over an empty OUT folder, or to a new name
        except OSError:
            if old is not None:
                os.rename(old, out)  # the earlier export stays where it was
            raise
    fsio.fsync_dir(out.parent)
    if old is not None:  # checked by _prepare_out; checked again, since it is deleted
        storage.check_owned(old, EXPORT_FILE_RE.match, f"the earlier export stays in {old}")
        shutil.rmtree(old)


def export_hf(src, out, *, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, dtype: str | None = None,
              tokenizer: str | None = None, force: bool = False) -> Path:
    """Export SRC's model as a Hugging Face Llama folder OUT; return OUT."""
    max_bytes = parse_size(max_shard_size)
    if not storage.medium(out).filesystem:
        raise CheckpointError(f"{out}: OUT must be a local folder (transformers loads from the filesystem)")
    out = Path(out)
    where, manifest = locate(src)
    if manifest is None:
        raise CheckpointError(f"{where} is a single file; export needs a committed checkpoint folder (step-N or an "
                              "experiment folder)")
    _prepare_out(out, force, where)
    saved = saved_model(where, manifest)
    config = saved.config
    tensors = dict(flatten(section_reader(manifest["backend"])(where, manifest, "model")))
    weights = hf_state_dict(config, tensors, where)
    target = DTYPES[dtype] if dtype else weights["model.embed_tokens.weight"].dtype
    tok_name = tokenizer or saved.tokenizer
    if tok_name:
        tok = tokenizer_files(tok_name, int(config["vocab_size"]), max(saved.max_positions or 0,
                                                                       int(config["max_seq_len"])),
                              explicit=bool(tokenizer))
    else:
        tok = TokenizerExport(note="tokenizer not exported: the checkpoint does not name it; pass --tokenizer")

    import safetensors.torch  # the format transformers loads, written by its own library

    out = Path(os.path.abspath(out))  # `.` or `..` has no name to put a hidden staging folder beside
    fsio.make_dirs(out.parent)
    staging = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        shards = plan_shards(weights, target, max_bytes)
        files = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        weight_map, total = {}, 0
        for fname, names in zip(files, shards):
            # one shard's tensors in this dtype at a time: memory beyond the section read is one shard
            part = {n: weights[n].to(target).contiguous() for n in names}
            total += sum(t.numel() * t.element_size() for t in part.values())
            fsio.atomic_write_bytes(staging / fname, safetensors.torch.save(part, metadata={"format": "pt"}),
                                    fsync_parent=False)
            weight_map.update(dict.fromkeys(names, fname))
        written = {}
        if len(files) > 1:
            written[INDEX] = _json({"metadata": {"total_size": total}, "weight_map": weight_map})
        written["config.json"] = _json(hf_config(config, target, tok.bos_id, tok.eos_id, saved.max_positions))
        written["generation_config.json"] = _json({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
        written.update(tok.files)
        for fname, data in written.items():
            fsio.atomic_write_bytes(staging / fname, data, fsync_parent=False)
        fsio.fsync_dir(staging)
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    params = sum(t.numel() for t in weights.values())
    shown = files[0] if len(files) == 1 else f"{len(files)} shards + {INDEX}"
    tok_shown = ", ".join(n for n in tok.files if n.startswith("tokenizer")) or "no tokenizer"
    what = f"{saved.preset or 'model'}, {params / 1e6:.2f}M parameters, {str(target).removeprefix('torch.')}"
    _log.info(f"exported {where} (step {manifest['step']}, {manifest['backend']}, {manifest['world_size']} rank(s)) -> "
              f"{out}: {shown} ({what}), config.json, generation_config.json, {tok_shown}")
    if tok.note:
        _log.info(f"note: {tok.note}")
    return out


# --- command line (parsed at the top) ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global _PARSED
    logs.setup()  # export's lines
    try:
        args = _PARSED if argv is None and _PARSED is not None else parse_args(argv)
        _PARSED = None  # taken once
        export_hf(args.src, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                  tokenizer=args.tokenizer, force=args.force)
        return 0
    except (CheckpointError, OSError) as e:  # bad input is one line, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
