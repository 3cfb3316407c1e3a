"""A Llama model's decode step on the CPU as one compiled call: the CPU's CUDA graph.

On a GPU, vLLM captures the decode step in a CUDA graph, because launching a small model's
hundreds of kernels one by one from Python costs more than running them. A CPU has the same
problem in another form: a decode step of SmolLM2-135M is about 40 PyTorch operations a layer,
each a trip through the interpreter and the dispatcher that costs more than its arithmetic, and
together as much time as reading the weights. :class:`FusedDecode` hands the whole step to
``mv_decode_step`` in ``attention/cpu_kernels.c``: for every layer the norm, the fused q/k/v
product, the rotation, the paged cache write, PagedAttention, the output product and the
residual, the norm, the fused gate/up product, SiLU and the down product, in the order
``mini_vllm/model_executor/models/llama.py`` computes them, through the same compiled products and
attention the per-operation path calls. The tokens are the same; the floating-point sums of the
norms and the SiLU are C's, not PyTorch's, so hidden states agree to rounding (about 1e-6
relative), not bit for bit.

Any step of few enough tokens takes this path, not only decodes: a short prompt (or prefill
chunk) is a handful of rows too, each attending over its own prefix through the decode kernel,
which reads the whole weight set once for the step instead of ~40 PyTorch operations a layer.

Like a captured CUDA graph, the plan is built once, from the weights the model holds when the
runner starts (it keeps them alive, and the engine never replaces them); a weight replaced later
is not seen.

upstream: vllm/v1/worker/gpu_model_runner.py:3405 @ v0.11.0 (capture_model: the decode step as
one replayable graph)
"""

from __future__ import annotations

import ctypes

import torch

from mini_vllm.attention import cpu_kernels
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, fused_weight

# Weight storage -> mv_decode_step's format code (MV_FMT_* in cpu_kernels.c).
FORMATS = {torch.float32: 0, torch.bfloat16: 1, "q4_1": 2, "q8_0": 3}
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [*((f"{n}_format", ctypes.c_int32) for n in ("qkv", "o", "gate_up", "down")),
                *((n, _ptr) for n in ("qkv", "o", "gate_up", "down")),
                *((f"{n}_bias", _ptr) for n in ("qkv", "o", "gate_up", "down")),
                ("input_norm", _ptr), ("post_norm", _ptr),
                ("key_cache", _ptr), ("value_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [*((n, _i64) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads",
                                       "head_size", "intermediate", "num_blocks",
                                       "max_position")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr)]


_ERRORS = {
    1: "seq_lens[{bad}] is not in 1 .. the tokens its block table row holds",
    2: "block_tables row {bad} names a block outside the cache",
    3: "slot_mapping[{bad}] is outside the cache",
    4: "out of memory for the decode's logits",
    5: "positions[{bad}] is beyond the model's max_position_embeddings",
}


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a contiguous ``dtype`` tensor (itself when it already is one)."""
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    return tensor.to(dtype).contiguous()


class FusedDecode:
    """The plan for ``mv_decode_step``: every layer's weight, bias, norm and cache pointers.

    Invariant: every pointer in the plan belongs to a tensor the plan holds (``self._keep``), so
    the memory stays valid for the plan's life whatever the model does with its parameters.

    upstream: vllm/v1/worker/gpu_model_runner.py:3405 @ v0.11.0 (what a captured graph holds:
    the step's operations and the addresses they read)
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 lib: ctypes.CDLL) -> None:
        cfg = model.config
        self._lib, self._model_ref = lib, model
        # Every module's hook dictionaries (registering a hook adds to its module's dictionary).
        self._hooks = [d for m in model.modules() for d in (m._forward_hooks,
                                                            m._forward_pre_hooks)]
        self._keep: list[torch.Tensor] = []
        layers = model.model.layers
        self._layers = (_Layer * len(layers))()
        kinds = set()
        for plan, layer, (key_cache, value_cache) in zip(self._layers, layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = fused_weight(attn._qkv_fused, (attn.q_proj, attn.k_proj, attn.v_proj))
            gate_up = fused_weight(mlp._gate_up_fused, (mlp.gate_proj, mlp.up_proj))
            products = {"qkv": (qkv, attn.q_proj),
                        "o": ((attn.o_proj.weight, attn.o_proj.bias), attn.o_proj),
                        "gate_up": (gate_up, mlp.gate_proj),
                        "down": ((mlp.down_proj.weight, mlp.down_proj.bias), mlp.down_proj)}
            for name, (weights, module) in products.items():
                kind = module.weight_format or weights[0].dtype
                kinds.add(kind)
                setattr(plan, f"{name}_format", FORMATS[kind])
                setattr(plan, name, self._pointer(weights[0]))
                setattr(plan, f"{name}_bias", self._pointer(weights[1]))
            plan.input_norm = self._pointer(layer.input_layernorm.weight)
            plan.post_norm = self._pointer(layer.post_attention_layernorm.weight)
            plan.key_cache, plan.value_cache = self._pointer(key_cache), self._pointer(value_cache)
        cos, sin = layers[0].self_attn.rotary_emb._tables(torch.float32)
        first = layers[0].self_attn
        self._model = _Model(
            num_layers=len(layers), hidden=cfg.hidden_size, num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads, head_size=first.head_dim,
            intermediate=cfg.intermediate_size, num_blocks=kv_caches[0][0].shape[0],
            max_position=cos.shape[0], eps=layers[0].input_layernorm.eps, scale=first.scale,
            cos=self._pointer(cos), sin=self._pointer(sin),
            final_norm=self._pointer(model.model.norm.weight))
        # A step of more rows than the slowest format's compiled product takes is PyTorch's.
        self.max_rows = min(cpu_kernels.LINEAR_MAX_ROWS[k] for k in kinds)
        q = first.num_heads * first.head_dim
        kv = first.num_kv_heads * first.head_dim
        self._work_per_row = 2 * cfg.hidden_size + 3 * q + 2 * kv + 3 * cfg.intermediate_size
        # Scratch for the largest step, allocated once (a step would otherwise ask for it anew).
        self._work = torch.empty(self.max_rows * self._work_per_row, dtype=torch.float32)
        self._embed = model.model.embed_tokens.weight

    def _pointer(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach()
        self._keep.append(tensor)  # the storage outlives any change to the parameter
        return tensor.data_ptr()

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              backend_uses_cpu_kernels: bool) -> FusedDecode | None:
        """The plan, or ``None`` where the fused step does not apply: the compiled kernels not
        in use (off, no compiler, an fp8 cache or another block size), not a
        :class:`LlamaForCausalLM` on the CPU with fp32 activations, or q/k/v or gate/up not
        fused (their weights in different formats), or a tensor-parallel shard (its layers
        communicate)."""
        lib = cpu_kernels.load()
        if lib is None or not backend_uses_cpu_kernels or type(model) is not LlamaForCausalLM:
            return None
        if type(model.model.embed_tokens) is not torch.nn.Embedding:  # split over ranks
            return None
        embed = model.model.embed_tokens.weight
        if embed.dtype != torch.float32 or embed.device.type != "cpu":
            return None
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (fused_weight(attn._qkv_fused, (attn.q_proj, attn.k_proj, attn.v_proj)) is None
                    or fused_weight(mlp._gate_up_fused, (mlp.gate_proj, mlp.up_proj)) is None
                    or any(n.dtype != torch.float32 for n in norms)
                    or any((m.weight_format or m.weight.dtype) not in FORMATS
                           or (m.bias is not None and m.bias.dtype != torch.float32)
                           for m in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj))):
                return None
        if model.model.norm.weight.dtype != torch.float32:
            return None
        return cls(model, kv_caches, lib)

    def applies(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens is the fused kind: at least one, no more than
        the compiled products take (:attr:`max_rows`), and no forward hook on the model or any
        of its modules (a hook expects its module to be called). Decodes or prefill chunks
        alike: see :meth:`step`.

        upstream: vllm/v1/cudagraph_dispatcher.py:96 @ v0.11.0 (dispatch: a step of a captured
        size replays a graph, and one that mixes prefill tokens into its decodes a graph built
        for any mix)
        """
        return 0 < num_tokens <= self.max_rows and not self._hooked()

    def step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step ``meta`` describes, every token one row of the fused call: a decode's row
        is its sequence; a prefill token's row reads its sequence's block table over its own
        prefix (``position + 1`` tokens). Every layer writes the step's keys and values before
        any row attends, so each prompt token sees exactly the tokens up to itself: causal
        attention within the chunk, done by the decode kernel.

        upstream: vllm/v1/attention/backends/utils.py:721 @ v0.11.0 (split_decodes_and_prefills:
        a short query taken by the decode path)
        """
        if meta.num_actual_tokens == meta.num_reqs:  # one token per sequence: rows are sequences
            tables, lens = meta.block_tables, meta.seq_lens
        else:
            owner = torch.repeat_interleave(torch.arange(meta.num_reqs), meta.query_lens.long())
            tables, lens = meta.block_tables[owner], meta.positions + 1
        return self(input_ids, meta.positions, meta.slot_mapping, tables, lens)

    def _hooked(self) -> bool:
        hooks = torch.nn.modules.module
        return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                    or any(self._hooks))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
        """The final norm's output ``[num_tokens, hidden]``, as ``model(...)`` returns it,
        having written the step's keys and values into every layer's cache. Checks every
        position, slot, length and used block before it writes anything."""
        rows = input_ids.shape[0]
        x = torch.nn.functional.embedding(input_ids, self._embed)
        out = torch.empty_like(x)
        work = self._work[:rows * self._work_per_row]
        positions, slots = _as(positions, torch.int64), _as(slot_mapping, torch.int64)
        tables, lens = _as(block_tables, torch.int32), _as(seq_lens, torch.int32)
        if tables.dim() != 2 or tables.shape[0] < rows or lens.shape != (rows,) or (
                positions.shape != (rows,) or slots.shape != (rows,)):
            raise ValueError(f"a fused decode step of {rows} tokens needs positions, "
                             f"slot_mapping and seq_lens of [{rows}] and block_tables of "
                             f"[>= {rows}, cols]; got {tuple(positions.shape)}, "
                             f"{tuple(slots.shape)}, {tuple(lens.shape)}, {tuple(tables.shape)}")
        bad = _i64(-1)
        code = self._lib.mv_decode_step(
            ctypes.byref(self._model), self._layers, x.data_ptr(), out.data_ptr(),
            work.data_ptr(), rows, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), ctypes.byref(bad))
        if code:
            raise ValueError(_ERRORS.get(code, "error {bad}").format(bad=bad.value))
        return out
