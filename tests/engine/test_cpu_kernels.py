"""The compiled CPU kernels (``mini_vllm.attention.cpu_kernels``) against lab 02-04's PyTorch ops,
and the engine's choice between them.

The kernels are the engine's CPU path while the reference pieces are in place, so they must
compute what the lab's ops compute (same tolerance as any two fp32 summation orders), refuse what
the ops refuse without writing, and step aside whenever another piece (a student's, a test's)
stands where the reference one was.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from course.labs.loader import load_script
from course.labs.numerics import assert_close
from mini_vllm.attention import backend as attention_backend
from mini_vllm.attention import cache_ops, cpu_kernels, paged_attn
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.models.llama import greedy_reference
from mini_vllm.sampling_params import SamplingParams

from .conftest import counting, make_prompts, make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason="no C compiler here: the engine uses the PyTorch ops")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def paged_batch(num_seqs, num_heads, num_kv_heads, head_size, block_size, seed=0, cols=6):
    """Random caches, a query, and block tables whose padding columns name blocks that do not
    exist; every slot no sequence owns holds NaN."""
    g = torch.Generator().manual_seed(seed)
    x = 4
    num_blocks = 1 + num_seqs * cols
    key_cache = torch.full((num_blocks, num_kv_heads, head_size // x, block_size, x), float("nan"))
    value_cache = torch.full((num_blocks, num_kv_heads, head_size, block_size), float("nan"))
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.full((num_seqs, cols), 10**6, dtype=torch.int32)
    lens = []
    for s in range(num_seqs):
        # Lengths that end inside a block, on a block boundary, and at one token.
        length = [1, block_size, cols * block_size, 2 * block_size + 3][s % 4] if s < 4 else \
            int(torch.randint(1, cols * block_size + 1, (1,), generator=g))
        used = -(-length // block_size)
        tables[s, :used] = perm[s * cols: s * cols + used].to(torch.int32)
        for j in range(used):
            n = min(block_size, length - j * block_size)
            b = int(tables[s, j])
            key_cache[b, :, :, :n] = torch.randn(num_kv_heads, head_size // x, n, x, generator=g)
            value_cache[b, :, :, :n] = torch.randn(num_kv_heads, head_size, n, generator=g)
        lens.append(length)
    query = torch.randn(num_seqs, num_heads, head_size, generator=g)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("num_seqs, num_heads, num_kv_heads, head_size", [
    (1, 4, 2, 32),     # the shipped model's shape
    (7, 8, 2, 64),     # groups of 4
    (5, 12, 12, 128),  # no GQA, a large head
    (4, 4, 1, 256),    # the largest head the kernel takes
    (6, 9, 3, 16),     # the smallest head, groups of 3
])
@pytest.mark.parametrize("scale", [0.125, 40.0])  # 40: most weights underflow to 0
def test_decode_equals_the_pytorch_op(num_seqs, num_heads, num_kv_heads, head_size, scale):
    query, kc, vc, tables, lens = paged_batch(num_seqs, num_heads, num_kv_heads, head_size, 16)
    want = paged_attn.forward_decode(query, kc, vc, tables, lens, int(lens.max()), num_kv_heads,
                                     scale)
    got = cpu_kernels.paged_decode(query, kc, vc, tables, lens, num_kv_heads, scale)
    assert torch.isfinite(got).all(), "a NaN in a slot past seq_len reached the output"
    if scale < 1:
        torch.testing.assert_close(got, want)
    else:
        # Logits in the hundreds: any two fp32 summation orders differ by more than the default
        # tolerance. Against fp64, the kernel must be as accurate as the lab's op.
        exact = dense_decode_fp64(query, kc, vc, tables, lens, num_kv_heads, scale)
        kernel_error = (got.double() - exact).abs().max().item()
        op_error = (want.double() - exact).abs().max().item()
        assert kernel_error <= 2 * op_error + 1e-6, (kernel_error, op_error)


def dense_decode_fp64(query, key_cache, value_cache, tables, lens, num_kv_heads, scale):
    """The decode in float64 from each sequence's context read token by token: the oracle."""
    num_seqs, num_heads, head_size = query.shape
    block_size, group = value_cache.shape[-1], num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    for s in range(num_seqs):
        pos = torch.arange(int(lens[s]))
        blocks = tables[s, pos // block_size].long()
        keys = key_cache[blocks, :, :, pos % block_size, :].flatten(2).double()  # [T, kvh, D]
        values = value_cache[blocks, :, :, pos % block_size].double()  # [T, kvh, D]
        for h in range(num_heads):
            logits = scale * keys[:, h // group] @ query[s, h].double()
            out[s, h] = torch.softmax(logits, 0) @ values[:, h // group]
    return out


def test_decode_of_an_empty_sequence_is_zero():
    query, kc, vc, tables, lens = paged_batch(3, 4, 2, 32, 16)
    lens[1] = 0
    got = cpu_kernels.paged_decode(query, kc, vc, tables, lens, 2, 0.2)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = paged_attn.forward_decode(query[::2].contiguous(), kc, vc, tables[::2].contiguous(),
                                     lens[::2].contiguous(), int(lens.max()), 2, 0.2)
    torch.testing.assert_close(got[::2], want)


@pytest.mark.parametrize("bad, message", [
    ("block", "names a block outside the cache"),
    ("length", "longer than its block table row holds"),
    ("negative length", "negative"),
])
def test_decode_refuses_a_bad_table_or_length(bad, message):
    query, kc, vc, tables, lens = paged_batch(4, 4, 2, 32, 16)
    if bad == "block":
        tables[2, 0] = kc.shape[0]
    elif bad == "length":
        lens[3] = tables.shape[1] * 16 + 1
    else:
        lens[0] = -1
    with pytest.raises(ValueError, match=message):
        cpu_kernels.paged_decode(query, kc, vc, tables, lens, 2, 0.2)


@pytest.mark.parametrize("layout", ["block size 8", "head size 512", "fp16"])
def test_kernels_refuse_other_layouts_and_say_what_to_use(layout):
    block_size = 8 if layout == "block size 8" else 16
    head_size = 512 if layout == "head size 512" else 32
    query, kc, vc, tables, lens = paged_batch(2, 4, 2, head_size, block_size)
    if layout == "fp16":
        query, kc, vc = query.half(), kc.half(), vc.half()
    assert not cpu_kernels.supports(query.dtype, kc, vc)
    with pytest.raises(ValueError, match="use the PyTorch ops"):
        cpu_kernels.paged_decode(query.float(), kc, vc, tables, lens, 2, 0.1)


def fused_kv(num_tokens, num_kv_heads, head_size, seed=1):
    """Keys and values as slices of one fused projection output (token stride > heads x dims)."""
    g = torch.Generator().manual_seed(seed)
    width = num_kv_heads * head_size
    fused = torch.randn(num_tokens, 3 * width, generator=g)
    key = fused[:, width:2 * width].view(num_tokens, num_kv_heads, head_size)
    value = fused[:, 2 * width:].view(num_tokens, num_kv_heads, head_size)
    return key, value


def test_cache_write_equals_the_pytorch_op():
    num_blocks, kvh, head, block_size = 9, 2, 32, 16
    key, value = fused_kv(12, kvh, head)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size)[:12]
    slots[3] = slots[7] = -1  # padding tokens: skipped
    slots = slots[:10]  # the last two tokens have no slot at all (a padded batch)
    caches = [(torch.randn(num_blocks, kvh, head // 4, block_size, 4),
               torch.randn(num_blocks, kvh, head, block_size)) for _ in range(2)]
    (want_k, want_v), (got_k, got_v) = caches
    got_k.copy_(want_k), got_v.copy_(want_v)
    cache_ops.reshape_and_cache(key, value, want_k, want_v, slots)
    cpu_kernels.reshape_and_cache(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_cache_write_refuses_a_slot_beyond_the_cache_and_writes_nothing():
    key, value = fused_kv(4, 2, 32)
    kc, vc = torch.randn(3, 2, 8, 16, 4), torch.randn(3, 2, 32, 16)
    before = kc.clone(), vc.clone()
    slots = torch.tensor([0, 5, 3 * 16, 7])  # the third is one past the last slot
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] is beyond the cache"):
        cpu_kernels.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


# ---- the engine's choice ----------------------------------------------------------------------


def backend(llm):
    return llm.engine.model_runner.attn_backend


def run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_engine_decodes_with_the_kernels_when_the_reference_pieces_are_in_place(
        monkeypatch, tiny_model, prompts, reference_outputs):
    kernel_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    # Wrapping a module's function is replacing it, so the PyTorch op is only observed here.
    # Op by op (enforce_eager): by default a decode step is one fused call (test_cpu_decode.py).
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64, enforce_eager=True)
    assert backend(llm).cpu_kernels is not None
    assert run(llm, prompts) == reference_outputs
    assert kernel_calls


@pytest.mark.parametrize("module, name", [
    (paged_attn, "forward_decode"), (paged_attn, "paged_attention_v1"),
    (cache_ops, "reshape_and_cache"),
])
def test_engine_runs_a_replaced_piece_not_the_kernels(monkeypatch, module, name, tiny_model,
                                                      prompts, reference_outputs):
    """A student's piece (here a stand-in wrapping the reference) must be what runs."""
    kernel_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    piece_calls = counting(monkeypatch, module, name)
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    assert run(llm, prompts) == reference_outputs
    assert piece_calls and not kernel_calls


def private_copy(module, folder: Path):
    """``module``'s source imported from another file, as the exam's stand-in students do."""
    path = folder / f"{module.__name__.replace('.', '_')}_copy.py"
    path.write_text(Path(module.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    copy = load_script(path.stem, path)
    del sys.modules[path.stem]  # the next call loads a fresh copy
    return copy


def test_a_piece_from_a_copy_of_the_reference_module_is_not_the_reference(
        monkeypatch, tmp_path, tiny_model, prompts, reference_outputs):
    """The exam's stand-in students run private copies of the reference modules (the same code
    in another file, imported after composition): those are the student's pieces, so the engine
    must run them and not the kernels, or a planted bug in them would go unseen."""
    stand_in = private_copy(paged_attn, tmp_path)
    monkeypatch.setattr(paged_attn, "paged_attention_v2_reduce", stand_in.paged_attention_v2_reduce)
    assert not attention_backend._reference_pieces_in_place()
    # The stand-ins' own copy of the backend's module, imported after the rebinding, agrees.
    assert not private_copy(attention_backend, tmp_path)._reference_pieces_in_place()
    kernel_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    assert run(llm, prompts) == reference_outputs
    assert not kernel_calls


def test_engine_with_another_block_size_uses_the_pytorch_ops(monkeypatch, tiny_model, prompts,
                                                             reference_outputs):
    kernel_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    llm = LLM(tiny_model, block_size=4, num_gpu_blocks=64)
    assert backend(llm).cpu_kernels is None
    assert run(llm, prompts) == reference_outputs
    assert not kernel_calls


def test_kernels_can_be_turned_off(monkeypatch, tiny_model, prompts, reference_outputs):
    monkeypatch.setenv("MINI_VLLM_DISABLE_CPU_KERNELS", "1")
    kernel_calls = counting(monkeypatch, cpu_kernels, "paged_decode")
    llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    assert backend(llm).cpu_kernels is None
    assert run(llm, prompts) == reference_outputs
    assert not kernel_calls


@pytest.mark.parametrize("compiler, message", [
    (None, "no C compiler"),
    (shutil.which("false"), "returned non-zero exit status"),  # a compiler that fails
])
def test_without_a_working_compiler_the_engine_warns_and_uses_the_pytorch_ops(
        monkeypatch, tmp_path, compiler, message, tiny_model, prompts, reference_outputs):
    if message.startswith("returned") and compiler is None:
        pytest.skip("no `false` command here")
    monkeypatch.setattr(cpu_kernels, "_lib", None)  # as in a fresh process
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: compiler)
    monkeypatch.setenv("MINI_VLLM_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=message):
        llm = LLM(tiny_model, block_size=16, num_gpu_blocks=64)
    assert backend(llm).cpu_kernels is None
    assert run(llm, prompts) == reference_outputs
    assert not list(tmp_path.iterdir()), "a failed build left a file behind"


# ------------------------------------------------------------------ threads, linear, bf16 weights

@pytest.fixture
def two_threads():
    """Two OpenMP threads for the kernels (PyTorch's setting is theirs), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_threaded_decode_and_cache_write_equal_one_thread(two_threads):
    """Sequences x KV heads are shared out over the threads; each is still summed alone, in one
    order, so the result is the one-thread result bit for bit."""
    query, key_cache, value_cache, tables, lens = paged_batch(7, 8, 2, 64, 16)
    threaded = cpu_kernels.paged_decode(query, key_cache, value_cache, tables, lens, 2, 0.125)
    key, value = fused_kv(300, 2, 64)  # large enough for the write to go parallel
    slots = torch.randperm(40 * 16)[:300]
    caches = [(torch.zeros(40, 2, 16, 16, 4), torch.zeros(40, 2, 64, 16)) for _ in range(2)]
    cpu_kernels.reshape_and_cache(key, value, *caches[0], slots)
    torch.set_num_threads(1)
    single = cpu_kernels.paged_decode(query, key_cache, value_cache, tables, lens, 2, 0.125)
    cpu_kernels.reshape_and_cache(key, value, *caches[1], slots)
    assert torch.equal(threaded, single)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    cache_ops.reshape_and_cache(key, value, *caches[1], slots)  # the lab's op agrees
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, out_features, in_features, bias", [
    (1, 12, 64, False),   # one decode row, whole blocks
    (5, 7, 20, True),     # a token block and one more; a partial row block; K not a multiple of 8
    (8, 130, 96, True),   # the most fp32 rows the kernel takes
    (32, 9, 24, False),   # the most bf16 rows
])
def test_linear_equals_torch_whatever_the_batch_and_threads(two_threads, weight_dtype, rows,
                                                            out_features, in_features, bias):
    """x W^T + b as PyTorch computes it with the weight widened to fp32; each row's result is the
    same bits alone or in a batch, on one thread or two."""
    if rows > cpu_kernels.LINEAR_MAX_ROWS[weight_dtype]:
        pytest.skip(f"{weight_dtype} products of {rows} rows are PyTorch's")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g).to(weight_dtype)
    b = torch.randn(out_features, generator=g) if bias else None
    assert cpu_kernels.linear_supported(x, weight)
    got = cpu_kernels.linear(x, weight, b)
    assert_close(got, torch.nn.functional.linear(x, weight.float(), b), dtype=torch.float32)
    alone = torch.cat([cpu_kernels.linear(x[i:i + 1], weight, b) for i in range(rows)])
    torch.set_num_threads(1)
    assert torch.equal(got, alone) and torch.equal(got, cpu_kernels.linear(x, weight, b))


def test_linear_leaves_big_batches_and_autograd_to_torch():
    weight = torch.randn(8, 16)
    for w in (weight, weight.bfloat16()):
        most = cpu_kernels.LINEAR_MAX_ROWS[w.dtype]
        assert cpu_kernels.linear_supported(torch.randn(most, 16), w)
        assert not cpu_kernels.linear_supported(torch.randn(most + 1, 16), w)
    assert not cpu_kernels.linear_supported(torch.randn(2, 16), weight.requires_grad_())
    assert not cpu_kernels.linear_supported(torch.randn(2, 16, dtype=torch.float64),
                                            weight.detach().double())


def test_fused_projections_are_views_that_compute_the_same():
    """fuse_projections keeps every parameter's name and value (each is a view of the fused
    weight: loading into it writes the fused one); replacing a parameter turns fusion off."""
    from mini_vllm.model_executor.models.llama import fused_weight

    model = make_tiny_model()
    ids = torch.tensor(make_prompts()[0])
    before = model.forward_reference(ids)
    names = list(model.state_dict())
    model.fuse_projections()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    fused = fused_weight(attn._qkv_fused, parts)
    assert fused is not None and fused[0].data_ptr() == attn.q_proj.weight.data_ptr()
    assert fused_weight(mlp._gate_up_fused, (mlp.gate_proj, mlp.up_proj)) is not None
    assert list(model.state_dict()) == names
    assert_close(model.forward_reference(ids), before, dtype=torch.float32)
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # in place: the fused weight sees it
    assert torch.equal(fused[0][attn.q_proj.weight.shape[0]:][:attn.k_proj.weight.shape[0]],
                       attn.k_proj.weight)
    model.double()  # new parameters: the fused copy is stale and must not be used
    assert fused_weight(attn._qkv_fused, parts) is None
    assert model.forward_reference(ids).dtype == torch.float64


def test_bf16_weights_are_weight_only_and_decode_through_the_kernels(monkeypatch, prompts):
    """LLM(weight_dtype="bfloat16"): linear weights in bf16 (the tied head untied), embeddings,
    norms, activations and the KV cache in fp32, the products in C; greedy tokens equal the
    no-cache reference of the same bf16-weight model."""
    calls = counting(monkeypatch, cpu_kernels, "linear")
    model = make_tiny_model()
    llm = LLM(model, weight_dtype="bfloat16", block_size=16, num_gpu_blocks=64)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16 == model.lm_head.weight.dtype
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert llm.engine.model_runner.kv_caches[0][0].dtype == torch.float32
    assert backend(llm).cpu_kernels is not None
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in prompts]
    assert run(llm, prompts) == want
    assert calls


def test_an_unknown_weight_dtype_is_refused_and_changes_nothing():
    model = make_tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^LLM: weight_dtype must be one of "
                       r"\['auto', 'bfloat16', 'q4_1', 'q8_0'\], got 'q4_0'$"):
        LLM(model, weight_dtype="q4_0")
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_quantized_weights_are_refused_off_the_cpu():
    with pytest.raises(ValueError, match=r"^LLM: weight_dtype='q4_1' runs on the CPU only"):
        LLM(weight_dtype="q4_1", device="cuda")


def test_the_cli_offers_every_weight_dtype():
    from mini_vllm.__main__ import WEIGHT_DTYPES
    from mini_vllm.model_executor.model_loader import loader

    assert list(WEIGHT_DTYPES) == list(loader.WEIGHT_DTYPES)


# ------------------------------------------------------------------ GGUF blocks: Q4_1, Q8_0

def gguf_blocks(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: gguf's quantizer (llama.cpp's reference rounding) and gguf's dequantize."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    blocks = gguf.quants.quantize(weight.numpy(), qtype)
    values = gguf.quants.dequantize(blocks, qtype).reshape(weight.shape)
    return torch.from_numpy(blocks), torch.from_numpy(values)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows, out_features, in_features, bias", [
    (1, 12, 64, False),   # one decode row
    (5, 7, 96, True),     # a token block and one more; a partial row block
    (32, 9, 32, False),   # the most rows the kernel takes; one block a row
])
def test_quantized_linear_is_the_fp32_product_of_the_dequantized_weights(
        two_threads, fmt, rows, out_features, in_features, bias):
    """Blocks in, dequantized in registers: the same bits as the fp32 kernel on the values
    gguf's dequantize gives (same rounding, same sums), PyTorch's product within fp32 rounding,
    and each row the same alone or batched, on one thread or two."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    weight[0, :32] = 0.0   # a block of zeros (scale 0)
    weight[-1, 3] = 1e3    # an outlier that sets its block's scale
    blocks, values = gguf_blocks(weight, fmt)
    b = torch.randn(out_features, generator=g) if bias else None
    assert cpu_kernels.linear_supported(x, blocks, fmt)
    assert_close(cpu_kernels.dequantize(blocks, fmt, in_features), values, atol=0, rtol=0)
    got = cpu_kernels.linear(x, blocks, b, fmt)
    assert_close(got, cpu_kernels.linear(x, values, b), atol=0, rtol=0)
    assert_close(got, torch.nn.functional.linear(x, values, b), dtype=torch.float32)
    alone = torch.cat([cpu_kernels.linear(x[i:i + 1], blocks, b, fmt) for i in range(rows)])
    torch.set_num_threads(1)
    assert torch.equal(got, alone) and torch.equal(got, cpu_kernels.linear(x, blocks, b, fmt))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_dequantize_reads_every_fp16_scale_as_gguf_does(monkeypatch, fmt):
    """Random blocks (scales of every sign, subnormal and normal halves, never inf or NaN): the
    C kernel and the PyTorch path (kernels off) give gguf's values bit for bit."""
    gguf = pytest.importorskip("gguf")
    from mini_vllm.model_executor.models.llama import dequantize

    g = torch.Generator().manual_seed(5)
    width = cpu_kernels.QUANT_BYTES[fmt]
    blocks = torch.randint(0, 256, (6, 3, width), dtype=torch.uint8, generator=g)
    halves = 2 if fmt == "q4_1" else 1
    blocks[..., 1:2 * halves:2] &= 0xFB  # clear an exponent bit of each half: no inf, no NaN
    blocks = blocks.reshape(6, 3 * width)
    want = torch.from_numpy(gguf.quants.dequantize(
        blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()]).reshape(6, 96).copy())
    assert_close(cpu_kernels.dequantize(blocks, fmt, 96), want, atol=0, rtol=0)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert_close(dequantize(blocks, fmt, 96), want, atol=0, rtol=0)


def test_quantized_blocks_of_the_wrong_shape_are_refused():
    blocks = torch.zeros(4, 20, dtype=torch.uint8)  # one Q4_1 block a row: 32 weights
    with pytest.raises(ValueError, match=r"q4_1 weights of rows of 64 must be .*\[rows, 40\]"):
        cpu_kernels.linear(torch.randn(1, 64), blocks, None, "q4_1")
    assert not cpu_kernels.linear_supported(torch.randn(1, 64), blocks, "q4_1")
    assert not cpu_kernels.linear_supported(torch.randn(1, 32), blocks, "q8_0")


def test_quantized_weights_decode_through_the_kernels(monkeypatch, prompts, fmt="q4_1"):
    """LLM(weight_dtype="q4_1") on a model of fp32 weights (q8_0 differs only in the block the
    kernel reads, tested above): every linear layer's weight becomes
    blocks quantized here (the tied head too, untied), fused q/k/v and gate/up stay fused, the
    embedding and the KV cache stay fp32; greedy tokens equal the no-cache reference of the same
    quantized model (prefill dequantizes, decode reads the blocks)."""
    pytest.importorskip("gguf")  # quantizes the weights
    calls = counting(monkeypatch, cpu_kernels, "linear")
    model = make_tiny_model()
    llm = LLM(model, weight_dtype=fmt, block_size=16, num_gpu_blocks=64)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert {m.weight_format for m in (attn.q_proj, mlp.down_proj, model.lm_head)} == {fmt}
    assert attn.q_proj.weight.dtype == torch.uint8 and attn._qkv_fused is not None
    assert mlp._gate_up_fused is not None
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert llm.engine.model_runner.kv_caches[0][0].dtype == torch.float32
    want = [greedy_reference(model, p, GREEDY.max_tokens) for p in prompts]
    assert run(llm, prompts) == want
    assert calls
