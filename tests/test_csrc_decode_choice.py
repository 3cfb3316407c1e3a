"""The engine's GPU decode, checked on a CPU: which kernel it picks (pure rules), that the choice
computes what the PyTorch path computes (the kernels run in the CPU emulation), and the worker
process that keeps one crashing kernel from failing every later GPU test."""

from __future__ import annotations

import pytest
import torch

from mini_vllm.csrc import ops

# ---- the GQA-aware kernel's partition size ---------------------------------------------------


@pytest.mark.parametrize("num_seqs, context, sms, want", [
    (8, 4096, 132, 512),   # the default shape: 512 blocks, 0.97 of a wave of 4 x 132
    (256, 4096, 132, 512),
    (1, 4096, 132, 64),    # batch 1: 8 blocks per 512-token split; 64-token partitions give 512
    (8, 512, 132, 64),     # a short context: the same
    (1, 32768, 132, 512),  # 64 partitions already fill the GPU
    (1, 100, 132, 64),     # two 64-token partitions rather than one of 512
    (1, 4096, 40, 128),    # a T4 has fewer SMs: 256 blocks are enough
    (1, 4096, 1, 512),     # one SM: nothing to gain
])
def test_gqa_partition_size_fills_the_gpu(num_seqs, context, sms, want):
    assert ops.gqa_partition_size(num_seqs, 64, 8, context, sms) == want


def test_gqa_partition_size_stays_within_the_given_buffers():
    # Buffers sized for v2 (8 partitions of 512 at 4096 tokens) allow 512 only; twice as wide, 256.
    assert ops.gqa_partition_size(1, 64, 8, 4096, 132, max_num_partitions=8) == 512
    assert ops.gqa_partition_size(1, 64, 8, 4096, 132, max_num_partitions=16) == 256
    assert ops.gqa_num_partitions(4096, 64) == 64 and ops.gqa_num_partitions(4097, 512) == 9
    with pytest.raises(ValueError, match="bad shape"):
        ops.gqa_partition_size(1, 6, 4, 4096, 132)


# ---- v1, v2 or the GQA-aware kernel -----------------------------------------------------------

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
H100 = 227 * 1024


@pytest.mark.parametrize("args, want", [
    # (max_seq_len, num_seqs, num_heads, num_kv_heads, dtype)
    ((4096, 8, 64, 8, F16), "gqa"),     # grouped-query attention in fp16/bf16
    ((300, 1, 32, 16, BF16), "gqa"),
    ((4096, 8, 64, 8, F32), "v2"),      # fp32: upstream's rule (64 x 8 = 512 pairs: not > 512)
    ((4096, 16, 64, 64, F16), "v1"),    # multi-head: 1024 (sequence, head) pairs, <= 8192 tokens
    ((4096, 2, 32, 32, F16), "v2"),     # few pairs and several partitions
    ((500, 2, 32, 32, F16), "v1"),      # one partition
    ((9000, 64, 32, 32, F16), "v2"),    # past 8192 tokens
])
def test_decode_kernel_follows_the_pytorch_rule_and_the_gqa_benefit(args, want):
    max_seq_len, num_seqs, num_heads, num_kv_heads, dtype = args
    assert ops.choose_decode_kernel(max_seq_len, num_seqs, num_heads, num_kv_heads, 128, 16,
                                    dtype, H100) == want
    # Without the GQA-aware kernel (an engine with a student's v2): upstream's rule alone.
    from mini_vllm.attention.paged_attn import use_v1

    no_gqa = ops.choose_decode_kernel(max_seq_len, num_seqs, num_heads, num_kv_heads, 128, 16,
                                      dtype, H100, gqa=False)
    assert no_gqa == ("v1" if use_v1(max_seq_len, num_seqs, num_heads) else "v2")


@pytest.mark.parametrize("optin", [64 * 1024, 163 * 1024, 227 * 1024])
def test_v1_is_chosen_up_to_its_shared_memory_limit_and_not_past_it(optin, monkeypatch):
    """v1 keeps a logit per token in shared memory: on a T4, A100 or H100 it fits contexts up
    to about 16K, 41K or 57K tokens. Upstream's rule stops at 8192 tokens, well inside; with that
    threshold lifted, the shared memory decides, at the limit and one block past it."""
    static = 4 * 128 + 32  # the query row and the two reduction scratch arrays
    longest = (optin - static) // 4 // 16 * 16
    assert ops.v1_fits(longest, 128, 16, optin) and not ops.v1_fits(longest + 1, 128, 16, optin)
    args = (2000, 8, 8, 128, 16, F32, optin)  # many (sequence, head) pairs: v1 if it fits
    assert ops.choose_decode_kernel(longest, *args) == "v2"  # past upstream's 8192 tokens
    monkeypatch.setattr("mini_vllm.attention.paged_attn.V1_MAX_SEQ_LEN", 10**6)
    assert ops.choose_decode_kernel(longest, *args) == "v1"
    assert ops.choose_decode_kernel(longest + 1, *args) == "v2"
    # 48 KB need no opt-in on any GPU; the static part counts against them too.
    within_48k = (48 * 1024 - static) // 4 // 16 * 16
    assert ops.v1_fits(within_48k, 128, 16, 0) and not ops.v1_fits(within_48k + 1, 128, 16, 0)


@pytest.mark.emulation
@pytest.mark.parametrize("device", ["t4", "a100"])
def test_v1_fits_agrees_with_the_launcher_at_the_limit(device, monkeypatch):
    """The rule's arithmetic is the launcher's: at the longest context it allows, v1 runs (in the
    emulation of that GPU's limits); one block more and the launcher refuses."""
    from mini_vllm.csrc.emulation import flavor_supported

    if flavor_supported("plain"):
        pytest.skip(flavor_supported("plain"))
    monkeypatch.setenv("MINI_VLLM_EMU_DEVICE", device)
    optin = ops.EMULATED_SMEM_OPTIN[device]
    longest = max(n for n in range(16, 70000, 16) if ops.v1_fits(n, 64, 16, optin))
    for n, ok in ((longest, True), (longest + 16, False)):
        b = _batch(num_heads=(1, 1), head_size=64, lens=[n], dtype=F16)
        out = torch.empty_like(b["query"])
        if ok:
            ops.paged_attention_v1(out, *_args(b), backend="emulation")
            torch.testing.assert_close(out, _expected(b), atol=2e-3, rtol=1e-2)
        else:
            with pytest.raises(ValueError, match="use paged_attention_v2"):
                ops.paged_attention_v1(out, *_args(b), backend="emulation")


# ---- paged_decode: the choice, run ------------------------------------------------------------


def _batch(num_heads, head_size, lens, dtype=F16, block_size=16, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    nh, nkv = num_heads
    x = 16 // torch.empty((), dtype=dtype).element_size()
    used = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(used), generator=gen).tolist()
    table = torch.zeros(len(lens), max(used), dtype=torch.int32)
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        start += n
    return dict(
        query=torch.randn(len(lens), nh, head_size, generator=gen).to(dtype),
        key_cache=torch.randn(sum(used), nkv, head_size // x, block_size, x, generator=gen)
        .to(dtype),
        value_cache=torch.randn(sum(used), nkv, head_size, block_size, generator=gen).to(dtype),
        num_kv_heads=nkv, scale=head_size**-0.5, block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_size=block_size,
        max_seq_len=max(lens),
    )


def _args(b: dict) -> tuple:
    return (b["query"], b["key_cache"], b["value_cache"], b["num_kv_heads"], b["scale"],
            b["block_tables"], b["seq_lens"], b["block_size"], b["max_seq_len"])


def _expected(b: dict) -> torch.Tensor:
    from mini_vllm.attention.paged_attn import paged_attention_v1

    out = torch.empty_like(b["query"])
    paged_attention_v1(out, *_args(b))
    return out


@pytest.mark.emulation
@pytest.mark.parametrize("heads, lens, want", [
    ((8, 2), [40, 700], "gqa"),
    ((4, 4), [40, 300], "v1"),
    ((4, 4), [40, 700], "v2"),
])
def test_paged_decode_runs_the_chosen_kernel_and_matches_pytorch(heads, lens, want):
    from course.labs.numerics import assert_close
    from mini_vllm.csrc.emulation import flavor_supported

    if flavor_supported("plain"):
        pytest.skip(flavor_supported("plain"))
    b = _batch(heads, 128, lens)
    out = torch.full_like(b["query"], float("nan"))
    assert ops.paged_decode(out, *_args(b), backend="emulation") == want
    assert_close(out, _expected(b), msg=f"paged_decode ({want})")


def test_paged_decode_runs_a_students_v2_rather_than_the_gqa_kernel(monkeypatch):
    """Composed with a student's lab 02-06 (course.engine.compose rebinds
    ops.paged_attention_v2), the engine's decode runs the student's kernels, never the reference's
    GQA-aware kernel."""
    calls = []

    def students_v2(out, *args, **kwargs):
        calls.append(kwargs.get("backend"))
        out.zero_()

    monkeypatch.setattr(ops, "paged_attention_v2", students_v2)
    monkeypatch.setattr(ops, "paged_attention_gqa", lambda *a, **k: pytest.fail("GQA kernel ran"))
    b = _batch((8, 2), 128, [40, 700])
    out = torch.empty_like(b["query"])
    assert ops.paged_decode(out, *_args(b), backend="emulation") == "v2"
    assert calls == ["emulation"]


@pytest.mark.emulation
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_engine_with_the_kernels_generates_what_it_does_with_the_pytorch_ops(
        kv_cache_dtype, monkeypatch):
    """The engine's GPU path on a CPU: the kernels in the emulation stand where a GPU's would
    (mini_vllm.attention.backend._load_cuda_ops), so the cache writes and the decodes go through
    ops.reshape_and_cache and ops.paged_decode (the fp8 path included) while chunked prefill
    stays in PyTorch; the tokens equal those of the PyTorch ops, which the engine tests compare
    with the no-cache oracle (tests/engine)."""
    from mini_vllm.csrc.emulation import flavor_supported
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
    from mini_vllm.sampling_params import SamplingParams
    from mini_vllm.worker import model_runner

    reason = flavor_supported("plain")
    if reason:
        pytest.skip(reason)
    cfg = ModelConfig(vocab_size=64, hidden_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                      max_position_embeddings=256)  # head size 64, one the kernels are built for
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    init_weights(model, seed=3, std=0.5)
    model = model.eval().requires_grad_(False)
    prompts = [[(7 * i + 3 * j) % 60 + 1 for j in range(n)] for i, n in enumerate((5, 21, 12))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = dict(block_size=16, num_gpu_blocks=16, max_num_batched_tokens=16,
                  kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        config["kv_scales"] = (0.02, 0.02)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = tokens(LLM(model, use_cuda_ops=False, **config))
    calls = []
    real_decode = ops.paged_decode

    def counted_decode(*args, **kwargs):
        calls.append(real_decode(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(ops, "paged_decode", counted_decode)
    monkeypatch.setattr(model_runner, "_load_cuda_ops", lambda device: ops)
    assert tokens(LLM(model, **config)) == want
    assert calls and set(calls) <= {"v1", "v2", "gqa"}, calls


def test_a_head_size_with_no_compiled_kernel_runs_the_pytorch_ops(monkeypatch):
    """On a GPU the engine takes the kernels only for the head sizes they are built for: a
    tiny model (head size 16) runs the PyTorch ops unless use_cuda_ops=True asks for the
    kernels, which is an error naming the head size. (Seen on an H200: the engine raised.)"""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig
    from mini_vllm.worker import model_runner

    monkeypatch.setattr(model_runner, "_load_cuda_ops", lambda device: ops)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                      max_position_embeddings=64)
    assert cfg.head_dim not in ops.SUPPORTED_HEAD_SIZES
    model = LlamaForCausalLM(cfg).eval()
    llm = LLM(model, block_size=16, num_gpu_blocks=8)
    assert llm.engine.model_runner.attn_backend.cuda_ops is None
    with pytest.raises(ValueError, match="not this model's 16"):
        LLM(model, block_size=16, num_gpu_blocks=8, use_cuda_ops=True)


def test_the_engine_backend_decodes_through_paged_decode():
    """PagedAttentionBackend (mini_vllm.attention.backend) hands GPU decodes to
    ops.paged_decode."""
    import inspect

    from mini_vllm.attention import backend

    source = inspect.getsource(backend.PagedAttentionBackend.__call__)
    assert "ops.paged_decode(" in source and "ops.paged_attention_v1(" not in source


# ---- the worker process of the GPU tests ------------------------------------------------------


def test_a_crashing_kernel_fails_one_call_and_the_next_call_gets_a_fresh_worker():
    from mini_vllm.csrc.isolation import IsolatedRunner, KernelCrashed

    runner = IsolatedRunner()
    try:
        first = runner.call("mini_vllm.csrc.isolation", "_probe", "pid")
        with pytest.raises(ValueError, match="nothing was run"):  # an ordinary error
            runner.call("mini_vllm.csrc.isolation", "_probe", "value-error")
        assert runner.call("mini_vllm.csrc.isolation", "_probe", "pid") == first  # same worker
        with pytest.raises(KernelCrashed, match="(?s)illegal memory access.*fresh process"):
            runner.call("mini_vllm.csrc.isolation", "_probe", "cuda-error")
        second = runner.call("mini_vllm.csrc.isolation", "_probe", "pid")
        assert second != first
        with pytest.raises(KernelCrashed, match="died \\(exit code 9\\)"):
            runner.call("mini_vllm.csrc.isolation", "_probe", "exit")
        third = runner.call("mini_vllm.csrc.isolation", "_probe", "pid")
        assert third not in (first, second)
        with pytest.raises(KernelCrashed, match="died \\(exit code -11\\)"):  # SIGSEGV
            runner.call("mini_vllm.csrc.isolation", "_probe", "segfault")
        fourth = runner.call("mini_vllm.csrc.isolation", "_probe", "pid")
        assert fourth not in (first, second, third)
        assert runner.restarts == 3
    finally:
        runner.close()
    assert runner.pid is None


def test_the_worker_loads_the_lab_implementation_the_tests_load():
    """The lab's GPU tests hand the worker the loader of the implementation they test
    (``lab.module_loader()``): the worker loads that file, whatever LAB_IMPL says there."""
    import pickle
    from pathlib import Path

    from course.labs.loader import load_lab
    from mini_vllm.csrc.isolation import _resolve

    folder = next(Path(__file__).resolve().parents[1].glob("phase-02-*/labs/lab-06-*"))
    for impl in ("starter", "solution"):
        where = pickle.loads(pickle.dumps(load_lab(folder / "test_lab.py", impl).module_loader()))
        kernel = _resolve(where, "paged_attention_v1")
        if impl == "starter":
            assert Path(kernel.__code__.co_filename) == folder / "starter.py"
        else:
            assert kernel is ops.paged_attention_v1


def test_the_worker_loads_a_file_of_no_package_by_its_path():
    """Lab 02-06's stretch tests hand the worker a loader of the student's stretch.py (a file of
    no package); the worker process loads that very file and runs the named function there."""
    import functools
    from pathlib import Path

    from course.labs.loader import load_script
    from mini_vllm.csrc.isolation import IsolatedRunner, _resolve

    folder = next(Path(__file__).resolve().parents[1].glob("phase-02-*/labs/lab-06-*"))
    where = functools.partial(load_script, "lab_02_06_stretch", folder / "stretch.py")
    stretch = _resolve(where, "paged_attention_gqa")
    assert Path(stretch.__code__.co_filename) == folder / "stretch.py"
    started = _resolve(where, "stretch_started")()
    runner = IsolatedRunner()
    try:
        assert runner.call(where, "stretch_started") is started
    finally:
        runner.close()


def test_the_workers_replies_are_read_as_data_never_unpickled(tmp_path):
    """The worker runs the student's code: a reply whose unpickling would run code (here, open a
    file for writing) is refused unread, and an error of the student's own class comes back as a
    RuntimeError naming it; builtin errors keep their class, and tensors and plain values pass."""
    from mini_vllm.csrc.isolation import IsolatedRunner

    marker = tmp_path / "written-by-unpickling"
    runner = IsolatedRunner()
    try:
        data = runner.call("mini_vllm.csrc.isolation", "_probe", "data")
        assert torch.equal(data["out"][0], torch.arange(3.0))
        assert (data["n"], data["name"], data["pair"]) == (1, "v1", (0.5, None))
        with pytest.raises(RuntimeError, match="not plain data .* refused unread"):
            runner.call("mini_vllm.csrc.isolation", "_probe", "forged", str(marker))
        assert not marker.exists()
        with pytest.raises(RuntimeError) as caught:
            runner.call("mini_vllm.csrc.isolation", "_probe", "foreign-error")
        assert type(caught.value) is RuntimeError and str(caught.value) == "StudentsError: mine"
        assert "worker traceback" in "".join(caught.value.__notes__)
    finally:
        runner.close()
