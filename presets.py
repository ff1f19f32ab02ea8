"""The model's shapes without the model: ModelConfig, the presets (--model) and the activation-checkpointing choices.

Stdlib only, so that train.py's flags (flags.py) can offer and check them before torch is imported; model.py
re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4  # < n_heads means grouped-query attention; == n_heads is plain multi-head attention
    ffn_dim: int = 768  # hidden width of the SwiGLU feed-forward
    vocab_size: int = 32000
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # output projection shares tok_embeddings' weight (HF tie_word_embeddings)

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Parameter counts (Transformer.num_params(), untied embeddings) at vocab 32000 / at Llama-3's vocab 128256.
PRESETS: dict[str, ModelConfig] = {
    # Unit tests: milliseconds on a CPU.                                          4.19M / 16.5M
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192),
    # CPU demo.                                                                   19.53M / 68.8M
    # Measured (torch 2.13 CPU build, 2 shared cores, AdamW): one forward + backward + optimizer step at
    # batch 8 x seq 128, vocab 32000 takes ~0.45 s under bf16 autocast and ~0.55-0.6 s in fp32.
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
    # GPT-2-small scale.                                                          124.67M / 272.5M
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    # Llama-3.2-1B shape (untied here, hence above its 1.24B).                    1.104B / 1.498B
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0),
    # Llama-3-8B reference shape.                                                 7.242B / 8.030B (= Llama-3-8B)
    "8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0
    ),
}


def get_config(preset: str, vocab_size: int, max_seq_len: int) -> ModelConfig:
    """The preset's shape with the tokenizer's vocabulary size and the training sequence length."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], vocab_size=vocab_size, max_seq_len=max_seq_len)


# Activation checkpointing (--activation-checkpointing): which blocks keep only their input in the forward pass and
# recompute their activations in backward. distributed.checkpoint_activations applies it; estimate_peak_memory models
# it. "selective": every K-th block (K = --activation-checkpointing-every), counting from the first: blocks K, 2K, ...
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
