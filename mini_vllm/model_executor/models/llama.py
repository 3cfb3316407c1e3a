"""A small Llama-style decoder that runs two ways: through the paged KV cache, or with no cache.

The architecture is Llama's (and Qwen2's, which only adds biases to the q/k/v projections):
token embedding, ``num_layers`` pre-norm blocks of grouped-query attention with rotary position
embeddings and a SwiGLU MLP, a final RMSNorm and a linear head. Parameter names follow the
Hugging Face layout (``model.layers.0.self_attn.q_proj.weight``, ...) so a local HF checkpoint
loads with no renaming (see ``hf_loader.py``).

Two forward paths share every weight:

* :meth:`LlamaForCausalLM.forward` is the engine's path. It takes a *flat* batch: the new tokens of
  every scheduled request laid end to end (``input_ids[num_tokens]``, ``positions[num_tokens]``),
  writes each token's key and value into the paged cache at its slot, and attends each query to
  its request's cached context through the block table. Prefill chunks and decodes mix freely.
* :meth:`LlamaForCausalLM.forward_reference` recomputes everything from scratch for a padded
  ``[batch, seq]`` tensor with plain causal attention and no cache. It is the oracle of the
  engine's correctness tests, and the path the training script uses.

upstream: vllm/model_executor/models/llama.py:486 @ v0.11.0
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mini_vllm.attention import cpu_kernels


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA).

    Field names follow the Hugging Face ``config.json`` of Llama/Qwen2 where one exists.

    upstream: none (vLLM takes the model's Hugging Face config as it is)
    """

    vocab_size: int = 258
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Biases: ``attention_bias`` on q/k/v (Qwen2 always; Llama with ``attention_bias``),
    # ``o_proj_bias`` on the attention output (Llama with ``attention_bias``), ``mlp_bias`` on
    # gate/up/down (Llama with ``mlp_bias``).
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelConfig: hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads}) for GQA."
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim ({self.head_dim}) must be even for RoPE.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, ignoring keys this model does not use (an HF config has many)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 for stability, returned in the input dtype.

    upstream: vllm/model_executor/layers/layernorm.py:134 @ v0.11.0
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "NeoX" layout: rotate the two halves of each head.

    Position ``p`` rotates the pair ``(x[i], x[i + d/2])`` by ``p * theta ** (-2i / d)``. The
    rotation depends only on a token's own position, which is why a key cached at step ``t`` is
    still valid at every later step: the cache stores keys *after* rotation.

    upstream: vllm/model_executor/layers/rotary_embedding/base.py:16 @ v0.11.0
    """

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        # Kept in float64 and cast on use, so float64 tests get exact-as-possible tables.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.max_position = max_position
        self._cast: tuple[torch.dtype, torch.device, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables in ``dtype``, cast once and reused (casting every call costs more than
        the rotation itself on a small model)."""
        if self._cast is None or self._cast[:2] != (dtype, self.cos.device):
            self._cast = (dtype, self.cos.device, self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[2], self._cast[3]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[..., num_tokens, heads, head_dim]`` by ``positions[..., num_tokens]``."""
        if positions.numel() and int(positions.max()) >= self.max_position:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's "
                f"max_position_embeddings ({self.max_position}); shorten the prompt or "
                "max_tokens."
            )
        cos_table, sin_table = self._tables(x.dtype)
        cos = cos_table[positions].unsqueeze(-2)  # [..., T, 1, d/2]
        sin = sin_table[positions].unsqueeze(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fmt: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``x``'s dtype, for a weight stored in that dtype, in bf16
    (weight-only bf16: widened to ``x``'s dtype as it is read) or as GGUF blocks of format
    ``fmt`` (``"q4_1"``, ``"q8_0"``: a uint8 tensor, see
    :data:`mini_vllm.attention.cpu_kernels.QUANT_BYTES`). A decode step's few rows on the CPU go
    through the compiled kernel (:func:`mini_vllm.attention.cpu_kernels.linear`), the rest
    through PyTorch; quantized weights are dequantized for that call only (a prefill's GEMM
    outweighs it, and a cached fp32 copy would cost the memory the blocks save).

    upstream: vllm/model_executor/layers/linear.py:188 @ v0.11.0
    """
    if cpu_kernels.linear_supported(x, weight, fmt):
        return cpu_kernels.linear(x, weight, bias, fmt)
    if fmt is not None:
        weight = dequantize(weight, fmt, x.shape[-1])
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


def dequantize(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """GGUF blocks ``[rows, in_features // 32 * bytes]`` as fp32 ``[rows, in_features]``,
    exactly as gguf's ``dequantize`` (Q4_1: ``d * code + m``, Q8_0: ``d * code``, each product
    rounded to fp32 before the sum): in C when the kernels are built, else in PyTorch.

    upstream: none (vLLM dequantizes GGUF weights inside its CUDA kernels)
    """
    if cpu_kernels.load() is not None:
        return cpu_kernels.dequantize(blocks, fmt, in_features)
    cpu_kernels.check_blocks(blocks, fmt, in_features)
    rows = blocks.shape[0]
    b = blocks.view(rows, in_features // cpu_kernels.QUANT_BLOCK, cpu_kernels.QUANT_BYTES[fmt])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if fmt == "q8_0":
        return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    codes = torch.cat((b[..., 4:] & 15, b[..., 4:] >> 4), dim=-1).float()  # weights 0-15, 16-31
    return (d * codes + m).reshape(rows, -1)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) computed by :func:`linear`. ``weight_format``
    is ``None`` while ``weight`` holds numbers, or the GGUF block format (``"q4_1"``, ``"q8_0"``)
    of the uint8 blocks it holds after :meth:`LlamaForCausalLM.quantize_weights`.

    upstream: vllm/model_executor/layers/linear.py:297 @ v0.11.0
    """

    weight_format: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_format)


def fuse_linears(parts: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``parts``' rows end to end; each part's parameter becomes a
    view of its rows, so the fused tensor and the parts stay one and the same memory (loading a
    state dict into the parts writes the fused tensor). See :func:`fused_weight`.

    upstream: vllm/model_executor/layers/linear.py:576 @ v0.11.0
    """
    def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
        fused = torch.cat([t.detach() for t in tensors])
        for part, rows in zip(tensors, fused.split([t.shape[0] for t in tensors])):
            part.data = rows
        return fused

    biases = [p.bias for p in parts]
    bias = None if any(b is None for b in biases) else stack(biases)  # all or none in Llama
    return stack([p.weight for p in parts]), bias


def fused_weight(fused: tuple[torch.Tensor, torch.Tensor | None] | None,
                 parts: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``fused`` while every part's weight (and bias) is still its view in it, else ``None``
    (something replaced a parameter since, e.g. ``model.to(dtype)``: the parts are the truth).

    upstream: none (vLLM loads checkpoints straight into its fused parameters)
    """
    if fused is None:
        return None
    for tensors in ((fused[0], [p.weight for p in parts]), (fused[1], [p.bias for p in parts])):
        whole, views = tensors
        if whole is None:
            continue
        offset = whole.data_ptr()
        for view in views:
            if view is None or view.dtype != whole.dtype or view.data_ptr() != offset:
                return None
            offset += view.numel() * view.element_size()
    return fused


def same_format(parts: Sequence[nn.Linear]) -> bool:
    """Whether ``parts`` store their weights alike (dtype and block format): only then do their
    rows fuse into one weight.

    upstream: none (vLLM quantizes a fused layer as one)
    """
    return len({(p.weight.dtype, getattr(p, "weight_format", None)) for p in parts}) == 1


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``.

    upstream: vllm/model_executor/models/llama.py:60 @ v0.11.0
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        # gate and up as one [2 * intermediate, hidden] product (upstream's gate_up_proj), once
        # fuse() ran: one pass over the input, one call, one stream of weights.
        self._gate_up_fused: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """Make gate_proj and up_proj views of one fused weight (idempotent; not for weights in
        different formats)."""
        parts = (self.gate_proj, self.up_proj)
        if fused_weight(self._gate_up_fused, parts) is None and same_format(parts):
            self._gate_up_fused = fuse_linears(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_weight(self._gate_up_fused, (self.gate_proj, self.up_proj))
        if fused is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = linear(x, *fused, self.gate_proj.weight_format).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# An attention backend answers: "given the new tokens' q, k, v of one layer, this layer's paged
# cache and the batch metadata, store k/v and return the attention output [num_tokens, H, D]".
# The model runner supplies it, so the model never needs to know which kernels exist.
AttentionBackend = Callable[..., torch.Tensor]


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: ``num_heads`` query heads share ``num_kv_heads`` k/v heads.

    upstream: vllm/model_executor/models/llama.py:103 @ v0.11.0
    """

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=config.o_proj_bias)
        # q, k and v as one product (upstream's qkv_proj), once fuse() ran.
        self._qkv_fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # One table serves every layer (the model passes its shared instance).
        self.rotary_emb = rotary_emb or RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta
        )

    def fuse(self) -> None:
        """Make q_proj, k_proj and v_proj views of one fused weight (idempotent; not for weights
        in different formats)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if fused_weight(self._qkv_fused, parts) is None and same_format(parts):
            self._qkv_fused = fuse_linears(parts)

    def _qkv(self, positions: torch.Tensor, x: torch.Tensor):
        shape = x.shape[:-1]
        fused = fused_weight(self._qkv_fused, (self.q_proj, self.k_proj, self.v_proj))
        if fused is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = linear(x, *fused, self.q_proj.weight_format).split(
                [self.num_heads * self.head_dim, kv, kv], dim=-1)
        q = q.reshape(*shape, self.num_heads, self.head_dim)
        k = k.reshape(*shape, self.num_kv_heads, self.head_dim)
        v = v.reshape(*shape, self.num_kv_heads, self.head_dim)
        return self.rotary_emb(positions, q), self.rotary_emb(positions, k), v

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Paged path: ``hidden_states[num_tokens, hidden]`` of a flat mixed batch."""
        q, k, v = self._qkv(positions, hidden_states)
        key_cache, value_cache = kv_cache
        out = backend(q, k, v, key_cache, value_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def forward_reference(self, positions: torch.Tensor, x: torch.Tensor,
                          kv_scale: tuple[float, float] | None = None) -> torch.Tensor:
        """No-cache path: ``x[batch, seq, hidden]``, plain causal attention over the sequence.

        ``kv_scale = (k_scale, v_scale)``: keys and values are first rounded through e4m3 with
        those scales, as an fp8 KV cache stores them (the engine writes a step's keys and values
        before it attends, so every position reads the rounded values).
        """
        q, k, v = self._qkv(positions, x)  # [B, T, H, D]
        if kv_scale is not None:
            from mini_vllm.attention.fp8 import scaled_fp8_dequant, scaled_fp8_quant

            k_scale, v_scale = kv_scale
            k = scaled_fp8_dequant(scaled_fp8_quant(k, k_scale), k_scale, k.dtype)
            v = scaled_fp8_dequant(scaled_fp8_quant(v, v_scale), v_scale, v.dtype)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    upstream: vllm/model_executor/models/llama.py:241 @ v0.11.0
    """

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, kv_cache, attn_metadata, backend) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, attn_metadata,
                               backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_reference(self, positions: torch.Tensor, x: torch.Tensor,
                          kv_scale: tuple[float, float] | None = None) -> torch.Tensor:
        x = x + self.self_attn.forward_reference(positions, self.input_layernorm(x), kv_scale)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, the decoder layers and the final norm.

    upstream: vllm/model_executor/models/llama.py:333 @ v0.11.0
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its language-model head.

    upstream: vllm/model_executor/models/llama.py:486 @ v0.11.0
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """A model made of this one's first ``num_layers`` decoder layers, its embedding, final
        norm and head, *sharing* their weights (nothing is copied): the draft of
        self-speculative decoding, which reads the last layers' job off an earlier layer.

        upstream: none (LayerSkip-style early exit; vLLM's drafts are separate models)
        """
        if not isinstance(num_layers, int) or not 1 <= num_layers <= len(self.model.layers):
            raise ValueError(f"first_layers: num_layers must be in [1, "
                             f"{len(self.model.layers)}], got {num_layers!r}")
        draft = LlamaForCausalLM.__new__(LlamaForCausalLM)
        nn.Module.__init__(draft)
        draft.config = replace(self.config, num_hidden_layers=num_layers)
        inner = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(inner)
        inner.embed_tokens = self.model.embed_tokens
        inner.layers = nn.ModuleList(self.model.layers[:num_layers])
        inner.norm = self.model.norm
        draft.model = inner
        draft.lm_head = self.lm_head
        return draft

    def kv_cache_spec(self) -> tuple[int, int]:
        """``(KV heads, head size)`` of the cache this model's attention writes: the config's,
        or, once split over a tensor-parallel group, this rank's share of the KV heads.

        upstream: vllm/v1/worker/gpu_model_runner.py:7081 @ v0.33.0
        """
        attn = self.model.layers[0].self_attn
        return attn.num_kv_heads, attn.head_dim

    def fuse_projections(self) -> None:
        """Fuse every layer's q/k/v and gate/up projections into one product each (the
        parameters keep their names and values; each becomes a view of the fused weight).
        Idempotent; a parameter replaced later (``model.to(...)``) turns its fusion off.

        upstream: vllm/model_executor/models/llama.py:421 @ v0.11.0
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def move_weights_to_huge_pages(self) -> int:
        """Move every weight, fused ones included, onto 2 MB pages where the OS offers them
        (:mod:`mini_vllm.utils.huge_pages`): a decode step streams them 10-25% faster on a CPU.
        Values, names, fusions and ties stay as they are. Returns the bytes moved.

        upstream: none (vLLM leaves weight placement on the CPU to PyTorch's allocator)
        """
        from mini_vllm.utils.huge_pages import move_weights_to_huge_pages

        holders = []  # (module, attribute, fused tensors) of every fusion still in force
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module, name, parts in (
                    (attn, "_qkv_fused", (attn.q_proj, attn.k_proj, attn.v_proj)),
                    (mlp, "_gate_up_fused", (mlp.gate_proj, mlp.up_proj))):
                fused = fused_weight(getattr(module, name), parts)
                setattr(module, name, fused)
                if fused is not None:
                    holders.append((module, name, fused))
        extra = [t for _, _, fused in holders for t in fused if t is not None]
        moved = move_weights_to_huge_pages(self, extra)
        it = iter(extra)
        for module, name, (_, bias) in holders:
            setattr(module, name, (next(it), None if bias is None else next(it)))
        return moved

    def set_weight_dtype(self, dtype: torch.dtype) -> None:
        """Store the linear layers' weights (projections, MLP, LM head) in ``dtype`` and compute
        with them widened to the activations' dtype (weight-only: embeddings, norms, biases,
        activations and the KV cache keep theirs). A tied LM head gets its own copy, so the
        embedding keeps its dtype. Call before :meth:`fuse_projections`.

        upstream: none (vLLM's ``dtype`` casts the whole model, activations included)
        """
        linears = [self.lm_head, *(m for layer in self.model.layers for m in layer.modules()
                                   if isinstance(m, nn.Linear))]
        for module in linears:
            if module.weight.dtype != dtype:
                module.weight = nn.Parameter(module.weight.detach().to(dtype),
                                             requires_grad=False)

    def quantize_weights(self, blocks: dict[str, tuple[str, torch.Tensor]]) -> None:
        """Store linear layers' weights as GGUF blocks: ``blocks[name]`` is ``(format, uint8
        blocks)`` for a linear weight's parameter name (``"lm_head.weight"``, ...; see
        :func:`mini_vllm.model_executor.model_loader.gguf_loader.linear_blocks`); a layer not named
        keeps its weight. A tied LM head gets its own blocks, so the embedding keeps its fp32 rows
        (a lookup reads one row a token: nothing to save there). Checks every entry before it
        changes anything. Call before :meth:`fuse_projections`.

        upstream: none (vLLM's GGUF layers are built holding the file's blocks from the start)
        """
        linears = {f"{name}.weight": m for name, m in self.named_modules()
                   if isinstance(m, Linear) and f"{name}.weight" in blocks}
        unknown = sorted(set(blocks) - set(linears))
        if unknown:
            raise ValueError(f"quantize_weights: {unknown[:3]} name no linear layer's weight")
        for name, module in linears.items():
            fmt, data = blocks[name]
            cpu_kernels.check_blocks(data, fmt, module.in_features)
            if data.shape[0] != module.out_features:
                raise ValueError(f"quantize_weights: {name} has {module.out_features} rows, its "
                                 f"blocks {data.shape[0]}")
        for name, module in linears.items():
            fmt, data = blocks[name]
            module.weight = nn.Parameter(data, requires_grad=False)
            module.weight_format = fmt

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of a flat batch, writing k/v into the caches.

        ``kv_caches[i]`` is layer ``i``'s ``(key_cache, value_cache)``. Call
        :meth:`compute_logits` on the rows whose next token you want; computing logits only for
        those rows (one per request) is what keeps prefill cheap.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for a model with {len(self.model.layers)} layers."
            )
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(positions, x, kv_cache, attn_metadata, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary, in float32 whatever the model dtype (for the sampler).

        upstream: vllm/model_executor/models/llama.py:601 @ v0.11.0
        """
        logits = self.lm_head(hidden_states)
        return logits if logits.dtype == torch.float64 else logits.float()

    def forward_reference(
        self, input_ids: torch.Tensor,
        kv_scales: Sequence[tuple[float, float]] | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (or ``[seq, vocab]`` for 1-D input), no cache at all.

        Every position attends to all earlier positions of its own row; nothing is reused between
        calls. Slow for generation (quadratic recomputation) and therefore obviously correct.
        ``kv_scales`` (one ``(k_scale, v_scale)`` per layer): what an engine with an fp8 KV cache
        and those scales computes, keys and values rounded through e4m3.
        """
        if kv_scales is not None and len(kv_scales) != len(self.model.layers):
            raise ValueError(f"kv_scales needs one (k_scale, v_scale) pair per layer "
                             f"({len(self.model.layers)}), got {len(kv_scales)}")
        squeeze = input_ids.dim() == 1
        ids = input_ids.unsqueeze(0) if squeeze else input_ids
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_reference(positions, x, kv_scales[i] if kv_scales else None)
        logits = self.compute_logits(self.model.norm(x))
        return logits[0] if squeeze else logits


def init_weights(model: LlamaForCausalLM, *, seed: int, std: float = 0.02) -> None:
    """Deterministic random initialisation (GPT-2 style: residual outputs scaled by depth).

    upstream: none (vLLM only serves trained weights)
    """
    gen = torch.Generator().manual_seed(seed)
    residual_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * s)


@torch.no_grad()
def greedy_reference(
    model: LlamaForCausalLM, prompt_ids: Sequence[int], max_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """Greedy continuation of one prompt by full recomputation: the engine's correctness oracle.

    Each step runs :meth:`LlamaForCausalLM.forward_reference` on the whole sequence so far and
    appends the argmax of the last row. Stops after ``max_tokens`` or on a stop token (included).

    upstream: none (vLLM's tests compare with Hugging Face generate, which plays this role)
    """
    ids = list(prompt_ids)
    out: list[int] = []
    device = next(model.parameters()).device
    for _ in range(max_tokens):
        logits = model.forward_reference(torch.tensor(ids, device=device))
        tok = int(torch.argmax(logits[-1]))
        out.append(tok)
        ids.append(tok)
        if tok in stop_token_ids:
            break
    return out
