"""Llama-style decoder-only transformer: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Reads top to bottom: config and presets (presets.py), flash-attn detection, then one class per block.

    cfg = get_config("small", vocab_size=32000, max_seq_len=1024)
    model = Transformer(cfg)                      # attention="sdpa" (default) or "flash"
    logits = model(tokens)                        # tokens: LongTensor[B, T] -> logits [B, T, vocab]

Notes for train.py:
- `model.layers` is an nn.ModuleList of TransformerBlock: apply FSDP2 `fully_shard` per block, then to the root.
- Meta-device init works: build under `torch.device("meta")`, then `model.to_empty(device=...)` and
  `model.init_weights()` (re-creates the weights AND the RoPE tables, which are non-persistent buffers and so
  are neither in the state_dict nor restored from a checkpoint). Init is deterministic given torch.manual_seed
  and the device it runs on.
- `model.to(dtype)` casts the RoPE tables too. Angles are always computed in fp32, so bf16 tables only round
  cos/sin (~2^-9), the same rounding the rotated q/k get anyway.
- Logits come out in the dtype of the output projection: bf16 under autocast. Cross-entropy upcasts internally;
  no full-vocabulary fp32 copy is made here.
- Attention "flash" never falls back silently: if it cannot run, construction raises RuntimeError with the
  one-line message from `flash_attention_problem()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# the config and presets: torch-free, so that the flags can offer them before torch is imported
from presets import ACTIVATION_CHECKPOINTING, PRESETS, ModelConfig, get_config  # noqa: F401 - re-exported

# ----------------------------------------------------------------------------------------------------------------
# flash-attn (optional). FA3 (`flash_attn_interface`, Hopper only) is preferred on sm_90, else FA2 (`flash_attn`).
# Both take q, k, v as (batch, seq, heads, head_dim) and support fewer KV heads than query heads natively.

_FLASH_IMPORT_ERRORS: list[str] = []
try:
    from flash_attn_interface import flash_attn_func as _fa3_func  # type: ignore[import-not-found]
except (ImportError, OSError, RuntimeError) as e:  # OSError/RuntimeError: installed but built for another CUDA/torch
    _fa3_func = None
    if not isinstance(e, ModuleNotFoundError):
        _FLASH_IMPORT_ERRORS.append(f"flash_attn_interface: {e}")
try:
    from flash_attn import flash_attn_func as _fa2_func  # type: ignore[import-not-found]
except (ImportError, OSError, RuntimeError) as e:
    _fa2_func = None
    if not isinstance(e, ModuleNotFoundError):
        _FLASH_IMPORT_ERRORS.append(f"flash_attn: {e}")

_FLASH_FIX = "run ./setup_flashattention.sh on a GPU node, or drop --use_flash_attention to use PyTorch SDPA"


def _flash_func(device: torch.device):
    """The flash-attn function usable on `device`, or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(device)
    if _fa3_func is not None and major == 9:
        return _fa3_func
    if _fa2_func is not None and major >= 8:
        return _fa2_func
    return None


def flash_attention_problem(device: torch.device) -> str | None:
    """None if flash-attn can run on `device`; otherwise one line naming the problem and the fix."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        need = f"needs a CUDA GPU (device is {device.type}) and the flash-attn package"
        return f"--use_flash_attention {need}; {_FLASH_FIX}"
    if _fa2_func is None and _fa3_func is None:
        broken = f" (import failed: {'; '.join(_FLASH_IMPORT_ERRORS)})" if _FLASH_IMPORT_ERRORS else ""
        return f"--use_flash_attention needs the flash-attn package, which is not importable{broken}; {_FLASH_FIX}"
    if _flash_func(device) is None:
        major, minor = torch.cuda.get_device_capability(device)
        have = "FA3 (Hopper sm_90 only)" if _fa2_func is None else "FA2 (Ampere sm_80 or newer)"
        return (
            f"--use_flash_attention: installed flash-attn {have} cannot run on this sm_{major}{minor} GPU; "
            f"{_FLASH_FIX}"
        )
    return None


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least fp32 (bf16 mean-of-squares loses too much), return in the input dtype.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None):
    """cos and sin of position * frequency, each (max_seq_len, head_dim // 2), fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, seq, heads, head_dim) by position. Pairs are (i, i + head_dim/2) ("rotate half" layout)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    cos = cos[None, :, None, :].to(dtype)  # (1, seq, 1, head_dim/2), broadcast over batch and heads
    sin = sin[None, :, None, :].to(dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attention: str) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        # Resolved once here, not per forward; "flash" that cannot run is an error, never a silent SDPA fallback.
        self.flash_fn = _flash_func(_default_device()) if attention == "flash" else None
        if attention == "flash" and self.flash_fn is None:
            raise RuntimeError(flash_attention_problem(_default_device()))
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if self.flash_fn is not None:
            out = self.flash_fn(q, k, v, causal=True)  # (B, T, heads, head_dim) in and out
            if isinstance(out, tuple):  # some FA3 releases return (out, softmax_lse)
                out = out[0]
        else:
            # SDPA wants (B, heads, T, head_dim) and equal head counts: query head h uses KV head h // n_rep,
            # the same grouping flash-attn uses.
            n_rep = self.n_heads // self.n_kv_heads
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if n_rep > 1:
                k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.wo(out.reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)  # down (residual projection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(x))."""

    def __init__(self, config: ModelConfig, attention: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, attention)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


ATTENTION_CHOICES = ("sdpa", "flash")


def recomputed_layers(n_layers: int, mode: str, every: int = 2) -> list[int]:
    """Indices of the blocks whose activations are recomputed in backward under activation checkpointing ``mode``."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"unknown activation checkpointing {mode!r}; "
                         f"choose one of: {', '.join(ACTIVATION_CHECKPOINTING)}")
    if mode == "none":
        return []
    step = 1 if mode == "full" else every
    return [i for i in range(n_layers) if (i + 1) % step == 0]


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, attention: str = "sdpa") -> None:
        super().__init__()
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"unknown attention {attention!r}; choose one of: {', '.join(ATTENTION_CHOICES)}")
        if attention == "flash" and (problem := flash_attention_problem(_default_device())) is not None:
            raise RuntimeError(problem)
        self.config = config
        self.attention_backend = attention
        # Built on the default device with PyTorch's per-layer init, whose random draws fork_rng then undoes, so
        # init_weights alone decides the weights: they depend only on the seed. Not on "meta": the first meta op
        # imports PyTorch's meta kernels, 1.4 s of every start measured here, against 0.15 s for this build.
        device = torch.get_default_device()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(TransformerBlock(config, attention) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)  # untied unless tie_embeddings
            # RoPE tables: shared by all layers, derived from the config, so not saved (persistent=False).
            self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables; deterministic given torch.manual_seed.

        Normal(0, 0.02) for embeddings and linear layers; the projections that write into the residual stream
        (attention.wo, feed_forward.w2) use 0.02 / sqrt(2 * n_layers) so the residual variance does not grow
        with depth; RMSNorm weights are 1.
        """
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(("attention.wo", "feed_forward.w2"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
        cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta,
                               device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens LongTensor[B, T] -> logits [B, T, vocab_size] (bf16 under bf16 autocast)."""
        _, T = tokens.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (global, also for FSDP-sharded or meta models); optionally without the input embedding."""
        n = sum(p.numel() for p in self.parameters())  # a tied weight once
        # tied: the shared matrix also does the output matmul, so it stays counted
        untied_lookup = exclude_embeddings and not self.config.tie_embeddings
        return n - self.tok_embeddings.weight.numel() if untied_lookup else n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), for MFU.

        6 * N (N = parameters doing matmuls, i.e. all but the input-embedding lookup) plus the attention
        score/value matmuls 12 * n_layers * n_heads * head_dim * seq_len (PaLM appendix B convention; does not
        halve for the causal mask).
        """
        c = self.config
        return 6 * self.num_params(exclude_embeddings=True) + 12 * c.n_layers * c.n_heads * c.head_dim * seq_len


# ----------------------------------------------------------------------------------------------------------------
# Pre-flight memory estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak memory of one rank's training step, in bytes, by component (see estimate_peak_memory)."""

    parameters: int  # the weights (this rank's shard under FSDP, plus the unsharded units it gathers)
    gradients: int  # .grad of every weight (+ DDP's gradient buckets)
    optimizer: int  # AdamW's exp_avg and exp_avg_sq
    optimizer_step: int  # temporaries of optimizer.step()
    activations: int  # tensors saved for backward by the transformer blocks (+ autocast's low-precision weights)
    logits: int  # the output layer's logits, log-softmax and their gradients at the start of backward
    overhead: int = 0  # CPU: first-use allocations and memory malloc keeps after free (calibrated, see below)
    checkpoint_buffers: int = 0  # host copies of the state held by asynchronous checkpointing, when in this memory
    recompute: int = 0  # activation checkpointing: one block's activations, re-made in backward (logits freed by then)
    checkpointing: str = ""  # activation checkpointing, as the memory estimate line shows it ("" = off)

    @property
    def backward(self) -> int:
        """Transient memory in backward: every saved activation with, at its start, the logits alive, or later one
        recomputed block's activations (activation checkpointing), whichever is larger."""
        return self.activations + max(self.logits, self.recompute)

    @property
    def step(self) -> int:
        """Transient memory at the optimizer step: all gradients and the step's temporaries."""
        return self.gradients + self.optimizer_step

    @property
    def total(self) -> int:
        """The peak: weights and optimizer state always, plus the larger of the two transient phases (gradients are
        set to None after every step and re-created by backward as the activations are freed)."""
        return (self.parameters + self.optimizer + max(self.backward, self.step) + self.overhead
                + self.checkpoint_buffers)

    def describe(self) -> str:
        """One line: the total and its breakdown, in MiB."""
        def mib(n: int) -> str:
            return f"{n / 2**20:,.1f}"

        return (f"{mib(self.total)} MiB = parameters {mib(self.parameters)} + optimizer state {mib(self.optimizer)} "
                f"+ max(activations {mib(self.activations)}"
                + (f" [activation checkpointing {self.checkpointing}]" if self.checkpointing else "")
                + (f" + max(logits {mib(self.logits)}, one block's recompute {mib(self.recompute)}) [backward], "
                   if self.recompute else f" + logits {mib(self.logits)} [backward], ")
                + f"gradients {mib(self.gradients)} + optimizer temporaries {mib(self.optimizer_step)} [step])"
                + (f" + allocator overhead {mib(self.overhead)}" if self.overhead else "")
                + (f" + checkpoint buffers {mib(self.checkpoint_buffers)}" if self.checkpoint_buffers else ""))


def estimate_peak_memory(config: ModelConfig, batch_size: int, seq_len: int, dtype: str = "fp32",
                         world_size: int = 1, parallel: str = "single", device_type: str = "cpu",
                         optimizer: str = "default", checkpoint_copies: int = 0, activation_checkpointing: str = "none",
                         checkpoint_every: int = 2) -> MemoryEstimate:
    """Estimated peak memory of one rank training `config` with AdamW on `batch_size` x `seq_len` tokens.

    dtype: "fp32"/"fp64" (everything in that dtype) or "bf16"/"fp16" (autocast, fp32 weights). parallel: "single",
    "ddp" or "fsdp" (weights, gradients and optimizer state divided by world_size). device_type: "cpu" or "cuda"
    (which AdamW implementation runs: single-tensor on CPU, foreach on CUDA). optimizer: "default" or "fused".
    checkpoint_copies: copies of the weights and optimizer state that asynchronous checkpointing holds in the same
    memory (CPU training: the concurrent backend's --max-async buffer sets, dcp --async-checkpoint's staging copy).
    activation_checkpointing, checkpoint_every: the blocks recomputed in backward (recomputed_layers).

    Counted from the model's actual tensors (N = batch_size * seq_len tokens, d = dim, f = ffn_dim, h = n_heads,
    L = layers, V = vocab, P = parameters; s = 4 bytes, 8 for fp64, 2 for autocast's bf16/fp16 copies):
    - parameters P*s, gradients P*s, AdamW state 2*P*s;
    - activations saved for backward, per token and layer (SDPA's fused kernels: no seq_len^2 score matrix):
      fp32/fp64 (11d + 4f + h + 2)*s: RMSNorm input, rms and normalised input twice, q/k/v (k and v repeated to h
      heads) and the attention output, the output projection's input, three SwiGLU intermediates and w2's input;
      autocast 34d + 8f + 4h + 8 bytes (fp32 norms, a bf16 copy of each matmul input) plus bf16 copies of every
      matmul weight (2*P bytes);
    - activation checkpointing: a recomputed block keeps only its input, d*s per token (4d bytes under autocast: the
      residual stream is fp32); in backward, once the logits are freed, one block at a time re-creates its full
      activations (under autocast with bf16 copies of its weights): backward = activations + max(logits, recompute);
    - logits: at the start of backward the logits, their log-softmax and both gradients, 4*N*V*4 bytes in fp32
      (autocast 14*N*V: bf16 logits, fp32 copy; fp64 20*N*V);
    - optimizer step temporaries: single-tensor AdamW (CPU) two copies of the largest weight (the V x d embedding),
      foreach AdamW (CUDA) one copy of all weights, fused none.
    The peak is parameters + optimizer state + max(activations + logits, gradients + step temporaries) + overhead.
    Overhead, CPU only, calibrated on `tiny` and `small`: 80 MiB + half the gradients' size -- PyTorch's first-use
    allocations (~30-50 MiB) and the freed memory glibc malloc keeps resident (tensors under its mmap threshold,
    which rises up to 32 MiB, come from the heap; the peak resident set grows over the first ~10-30 steps, then levels
    off). On CUDA the estimate is of tensor memory (torch.cuda.max_memory_allocated; the CUDA context and the caching
    allocator's reserve are not counted). docs/training.md "Pre-flight checks" states how far it is from measured peaks.
    """
    c = config
    N, d, f, h, L, V = batch_size * seq_len, c.dim, c.ffn_dim, c.n_heads, c.n_layers, c.vocab_size
    kv = c.n_kv_heads * c.head_dim
    per_layer = d * (h * c.head_dim) * 2 + d * kv * 2 + 3 * d * f + 2 * d  # wq, wo; wk, wv; SwiGLU; two norms
    matmul_params = L * (per_layer - 2 * d) + V * d  # weights autocast casts (the output layer's too)
    embeddings = (1 if c.tie_embeddings else 2) * V * d  # input embedding and output layer, one matrix when tied
    P = embeddings + L * per_layer + d
    wide = 8 if dtype == "fp64" else 4  # weights, gradients and optimizer state (fp32 master weights under autocast)
    autocast = dtype in ("bf16", "fp16")
    if autocast:
        block, kept = N * (34 * d + 8 * f + 4 * h + 8), 4 * N * d  # one block's saved tensors; a recomputed one's input
        activations = N * (10 * d + 8) + 2 * matmul_params
        recompute = block + 2 * (per_layer - 2 * d)
        logits = 14 * N * V
    else:
        block, kept = N * (11 * d + 4 * f + h + 2) * wide, N * d * wide
        activations = N * (3 * d + 1) * wide
        recompute = block
        logits = 4 * N * V * 4 if dtype != "fp64" else 20 * N * V
    recomputed = len(recomputed_layers(L, activation_checkpointing, checkpoint_every))
    activations += (L - recomputed) * block + recomputed * kept
    activations += 2 * N * 8  # int64 inputs and targets
    shard = world_size if parallel == "fsdp" else 1
    params = P * wide // shard
    grads = P * wide // shard
    if parallel == "fsdp" and world_size > 1:  # the root (embeddings, output) stays gathered; one block at a time
        params += (embeddings + d + per_layer) * wide
        grads += (embeddings + d + per_layer) * wide
    if parallel == "ddp" and world_size > 1:
        grads *= 2  # DDP reduces through gradient buckets, a second copy of every gradient
    if optimizer == "fused":
        step = 0
    elif device_type == "cuda":
        step = P * wide // shard
    else:
        step = 2 * max(V * d, d * f, d * h * c.head_dim) * wide // shard
    overhead = 80 * 2**20 + grads // 2 if device_type == "cpu" else 0
    return MemoryEstimate(parameters=params, gradients=grads, optimizer=2 * P * wide // shard, optimizer_step=step,
                          activations=activations, logits=logits, overhead=overhead,
                          checkpoint_buffers=checkpoint_copies * 3 * P * wide // shard,
                          recompute=recompute if recomputed else 0,
                          checkpointing=_checkpointing_label(activation_checkpointing, checkpoint_every, recomputed, L))


def _checkpointing_label(mode: str, every: int, recomputed: int, n_layers: int) -> str:
    """How the memory estimate line names the activation checkpointing in effect ("" = none)."""
    if mode == "none":
        return ""
    how = "every block" if mode == "full" else f"one in {every}"
    return f"{mode}: {recomputed} of {n_layers} blocks recomputed ({how})"
