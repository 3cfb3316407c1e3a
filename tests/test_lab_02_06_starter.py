"""Lab 02-06's starter.cu (and its optional stretch_gqa.cu) with the TODOs filled in, run in the
CPU emulation.

Filled with the reference's own bodies, the starter must compute what the oracle computes, with
no sanitizer report: that checks the code students are given (the skeleton, the launchers, the
bindings) and not only the reference. Filled wrongly in the classic ways, it must fail with the
messages the lab's README promises: which mistake, which line of starter.cu, which block and
thread.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from course.labs.catalog import REPO_ROOT
from course.labs.numerics import assert_close

LAB = REPO_ROOT / "phase-02-paged-attention" / "labs" / "lab-06-cuda-kernel"
CSRC = REPO_ROOT / "mini_vllm" / "csrc"

pytestmark = pytest.mark.emulation


def _body(text: str, name: str) -> tuple[int, int]:
    """(start, end) of the body, braces included, of the function *defined* as `name(...)`."""
    m = re.search(rf"\b{name}\(", text)
    assert m, f"no definition of {name}"
    start = text.index("{", m.end())
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, i + 1
    raise AssertionError(f"unbalanced braces in {name}")


def solved_starter() -> str:
    """starter.cu with each task's body taken from the reference and every task marked done."""
    text = (LAB / "starter.cu").read_text(encoding="utf-8")
    sources = {"paged_attention_naive_kernel": "paged_attention_naive.cu",
               "qk_logits": "attention_core.cuh", "softmax_in_place": "attention_core.cuh",
               "accumulate_values": "attention_core.cuh",
               "partition_reduce_kernel": "partition_reduce.cuh"}
    for name, file in sources.items():
        ref = (CSRC / file).read_text(encoding="utf-8")
        rs, re_ = _body(ref, name)
        ss, se = _body(text, name)
        text = text[:ss] + ref[rs:re_] + text[se:]
    return re.sub(r"#define LAB_TASK_(\d)_DONE 0", r"#define LAB_TASK_\1_DONE 1", text)


def edit(text: str, find: str, replace: str) -> str:
    assert text.count(find) == 1, f"{find!r} occurs {text.count(find)} times"
    return text.replace(find, replace)


def load_starter(tmp_path: Path, cu_text: str):
    """The lab's starter.py, in a folder of its own next to `cu_text` as starter.cu."""
    folder = tmp_path / "lab-06"
    folder.mkdir()
    shutil.copy(LAB / "starter.py", folder / "starter.py")
    (folder / "starter.cu").write_text(cu_text, encoding="utf-8")
    name = f"lab_02_06_filled_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, folder / "starter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def line_of(text: str, snippet: str) -> int:
    return text[: text.index(snippet)].count("\n") + 1


def batch(lens=(1, 17, 512, 513, 1100), heads=(8, 2), seed=0) -> dict:
    """A small fp16 decode batch (head 128, block 16) with tight block tables."""
    from mini_vllm.attention.reference import alibi_slopes

    gen = torch.Generator().manual_seed(seed)
    nh, nkv, hs, bs = *heads, 128, 16
    used = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(used), generator=gen).tolist()
    table = torch.zeros(len(lens), max(used), dtype=torch.int32)
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        start += n
    return dict(
        query=torch.randn(len(lens), nh, hs, generator=gen).half(),
        key_cache=torch.randn(sum(used), nkv, hs // 8, bs, 8, generator=gen).half(),
        value_cache=torch.randn(sum(used), nkv, hs, bs, generator=gen).half(),
        num_kv_heads=nkv, scale=hs**-0.5, block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_size=bs, max_seq_len=max(lens),
        alibi_slopes=alibi_slopes(nh),
    )


def run(module, version: str, b: dict, backend: str) -> torch.Tensor:
    out = torch.full_like(b["query"], float("nan"))
    args = [b[k] for k in ("query", "key_cache", "value_cache", "num_kv_heads", "scale",
                           "block_tables", "seq_lens", "block_size", "max_seq_len",
                           "alibi_slopes")]
    if version in ("naive", "v1"):
        getattr(module, f"paged_attention_{version}")(out, *args, backend=backend)
    else:
        parts = -(-b["max_seq_len"] // 512)
        n, h, d = b["query"].shape
        bufs = (torch.full((n, h, parts), float("nan")), torch.full((n, h, parts), float("nan")),
                torch.full((n, h, parts, d), float("nan"), dtype=b["query"].dtype))
        module.paged_attention_v2(out, *bufs, *args, backend=backend)
    return out


def expected(b: dict) -> torch.Tensor:
    from mini_vllm.attention.paged_attn import paged_attention_v1 as oracle

    out = torch.empty_like(b["query"])
    oracle(out, *[b[k] for k in ("query", "key_cache", "value_cache", "num_kv_heads", "scale",
                                 "block_tables", "seq_lens", "block_size", "max_seq_len",
                                 "alibi_slopes")])
    return out


def require(flavor: str) -> None:
    from mini_vllm.csrc.emulation import flavor_supported

    reason = flavor_supported(flavor)
    if reason:
        pytest.skip(reason)


# ---- filled right --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["emulation", "emulation-asan", "emulation-race"])
def test_the_starter_filled_with_the_reference_bodies_is_right(tmp_path, backend):
    require({"emulation": "plain", "emulation-asan": "asan", "emulation-race": "race"}[backend])
    starter = load_starter(tmp_path, solved_starter())
    b = batch() if backend != "emulation-race" else batch(lens=(17, 600), heads=(2, 1))
    for version in ("naive", "v1", "v2"):
        assert_close(run(starter, version, b, backend), expected(b),
                     msg=f"the solved starter's {version} ({backend})")


def test_an_unfinished_task_is_reported_before_anything_is_built(tmp_path, monkeypatch):
    text = solved_starter().replace("#define LAB_TASK_3_DONE 1", "#define LAB_TASK_3_DONE 0")
    starter = load_starter(tmp_path, text)
    monkeypatch.setattr(starter, "build", lambda *a, **k: pytest.fail("built an unfinished lab"))
    with pytest.raises(NotImplementedError, match="lab 02-06, task 3: write accumulate_values"):
        run(starter, "v1", batch(), "emulation")


def solved_stretch(done: tuple[int, ...] = (1, 2)) -> str:
    """stretch_gqa.cu with the reference's gqa_logits / gqa_values and tasks `done` marked."""
    text = (LAB / "stretch_gqa.cu").read_text(encoding="utf-8")
    ref = (CSRC / "paged_attention_gqa.cu").read_text(encoding="utf-8")
    for name in ("gqa_logits", "gqa_values"):
        rs, re_ = _body(ref, name)
        ss, se = _body(text, name)
        text = text[:ss] + ref[rs:re_] + text[se:]
    for task in done:
        text = text.replace(f"#define STRETCH_TASK_{task}_DONE 0",
                            f"#define STRETCH_TASK_{task}_DONE 1")
    return text


def load_stretch(tmp_path: Path, cu_text: str):
    """The lab's stretch.py, in a folder of its own next to `cu_text` as stretch_gqa.cu."""
    folder = tmp_path / "lab-06-stretch"
    folder.mkdir()
    shutil.copy(LAB / "stretch.py", folder / "stretch.py")
    (folder / "stretch_gqa.cu").write_text(cu_text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"lab_02_06_stretch_{uuid.uuid4().hex[:8]}",
                                                  folder / "stretch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_stretch(module, b: dict, backend: str, partition_size: int = 512) -> torch.Tensor:
    n, h, d = b["query"].shape
    parts = -(-b["max_seq_len"] // partition_size)
    bufs = (torch.full((n, h, parts), float("nan")), torch.full((n, h, parts), float("nan")),
            torch.full((n, h, parts, d), float("nan"), dtype=b["query"].dtype))
    out = torch.full_like(b["query"], float("nan"))
    module.paged_attention_gqa(out, *bufs, *[b[k] for k in (
        "query", "key_cache", "value_cache", "num_kv_heads", "scale", "block_tables", "seq_lens",
        "block_size", "max_seq_len", "alibi_slopes")], backend=backend,
        partition_size=partition_size)
    return out


@pytest.mark.parametrize("backend", ["emulation", "emulation-asan", "emulation-race"])
def test_the_stretch_filled_with_the_reference_bodies_is_right(tmp_path, backend):
    require({"emulation": "plain", "emulation-asan": "asan", "emulation-race": "race"}[backend])
    stretch = load_stretch(tmp_path, solved_stretch())
    b = batch() if backend != "emulation-race" else batch(lens=(17, 600), heads=(4, 1))
    assert_close(run_stretch(stretch, b, backend, 256), expected(b),
                 msg=f"the solved stretch ({backend})")


def test_an_unfinished_stretch_task_is_reported_before_anything_is_built(tmp_path, monkeypatch):
    stretch = load_stretch(tmp_path, solved_stretch(done=(1,)))
    assert stretch.stretch_started()
    monkeypatch.setattr(stretch, "build", lambda *a, **k: pytest.fail("built an unfinished one"))
    with pytest.raises(NotImplementedError, match="stretch task 2: write gqa_values"):
        run_stretch(stretch, batch(), "emulation")
    (tmp_path / "untouched").mkdir()
    untouched = load_stretch(tmp_path / "untouched", (LAB / "stretch_gqa.cu").read_text())
    assert not untouched.stretch_started()


# ---- filled wrongly ------------------------------------------------------------------------------


def test_threads_that_leave_while_others_wait_at_a_collective(tmp_path):
    """Task 4 returns early for the threads that have no partition; the others then wait for
    them in block_max's shuffles forever (a hang, or garbage, on the GPU)."""
    from mini_vllm.csrc.emulation import EmulationError

    text = edit(solved_starter(), "  float my_max = -FLT_MAX;\n  for (int i = tid; i < num_parts;",
                "  if (tid >= num_parts) return;\n"
                "  float my_max = -FLT_MAX;\n  for (int i = tid; i < num_parts;")
    call = line_of(text, "const float global_max = block_max<NUM_WARPS>(")
    starter = load_starter(tmp_path, text)
    with pytest.raises(EmulationError) as err:
        run(starter, "v2", batch(), "emulation")
    message = str(err.value)
    assert re.search(rf"threads 1-31 left the kernel while thread 0 waits at __shfl_xor_sync\(\) "
                     rf"at starter.cu:{call} \(in warp_max, common.cuh:\d+\)", message), message
    assert "partition_reduce_kernel<__half, 128, 128>, block (0,0,0)" in message, message


def test_warps_that_leave_while_others_wait_at_a_barrier(tmp_path):
    from mini_vllm.csrc.emulation import EmulationError

    text = edit(solved_starter(), "  float my_max = -FLT_MAX;\n  for (int i = tid; i < num_parts;",
                "  if (tid / kWarpSize >= num_parts) return;  // whole warps without a partition\n"
                "  float my_max = -FLT_MAX;\n  for (int i = tid; i < num_parts;")
    call = line_of(text, "const float global_max = block_max<NUM_WARPS>(")
    starter = load_starter(tmp_path, text)
    with pytest.raises(EmulationError) as err:
        run(starter, "v2", batch(), "emulation")
    message = str(err.value)
    assert re.search(rf"threads 32-127 left the kernel while threads 0-31 wait at the barrier at "
                     rf"starter.cu:{call} \(in block_max<4>, common.cuh:\d+\)", message), message


def test_a_shuffle_inside_a_branch_taken_by_some_lanes(tmp_path):
    from mini_vllm.csrc.emulation import EmulationError

    text = edit(solved_starter(),
                "    dot = group_sum<GROUP>(dot);\n    const int token = block * BLOCK_SIZE + "
                "token_in_block;\n    if (lane_in_group == 0) {\n",
                "    const int token = block * BLOCK_SIZE + token_in_block;\n"
                "    if (lane_in_group == 0) {\n      dot = group_sum<GROUP>(dot);\n")
    call = line_of(text, "      dot = group_sum<GROUP>(dot);")
    starter = load_starter(tmp_path, text)
    with pytest.raises(EmulationError) as err:
        run(starter, "v1", batch(), "emulation")
    message = str(err.value)
    assert re.search(rf"threads 0, 2, \.\.\., \d+ wait at __shfl_xor_sync\(\) at starter.cu:{call}"
                     r" \(in group_sum<2>", message), message
    assert "must reach the same call" in message and "block (0,0,0)" in message, message


def test_an_off_by_one_read_past_the_block_table(tmp_path):
    from mini_vllm.csrc.emulation import EmulationError

    require("asan")
    loop = "  for (int block = w.first_block + warp; block {} w.end_block; block += NUM_WARPS) {{"
    then = "\n    const int64_t physical = w.block_table[block];\n    // Chunk c"
    text = edit(solved_starter(), loop.format("<") + then, loop.format("<=") + then)
    read = line_of(text, "    const int64_t physical = w.block_table[block];\n    // Chunk c")
    starter = load_starter(tmp_path, text)
    with pytest.raises(EmulationError) as err:
        run(starter, "v1", batch(), "emulation-asan")
    message = str(err.value)
    assert re.search(rf"out-of-bounds read of block_tables at starter.cu:{read}, block "
                     r"\(\d+,4,0\), thread \d+", message), message


def test_a_missing_barrier_is_a_race_even_when_the_output_is_right(tmp_path):
    """Without the barrier before `probs` is reused for the warps' partial rows, a fast warp
    can overwrite probabilities a slow warp still reads. The emulation happens to run the warps
    in an order where the output is right; the race build reports it anyway."""
    from mini_vllm.csrc.emulation import EmulationError

    require("race")
    text = edit(solved_starter(),
                "  __syncthreads();  // every warp is done reading probs: reuse the buffer\n", "")
    starter = load_starter(tmp_path, text)
    b = batch(lens=(17, 600), heads=(2, 1))
    for version in ("v1", "v2"):
        assert_close(run(starter, version, b, "emulation"), expected(b),
                     msg="the plain emulation happens to get it right")
    with pytest.raises(EmulationError) as err:
        run(starter, "v1", b, "emulation-race")
    message = str(err.value)
    assert re.search(r"data race on shared memory 'logits' in block \(\d+,\d+,0\): thread \d+ "
                     r"(reads|writes) it at starter.cu:\d+ and thread \d+ (reads|writes) it at "
                     r"starter.cu:\d+ with no __syncthreads\(\)", message), message


def test_a_wrong_result_is_shown_element_by_element(tmp_path):
    text = edit(solved_starter(), "w.alibi_slope * static_cast<float>(token - (w.seq_len - 1))",
                "w.alibi_slope * static_cast<float>((w.seq_len - 1) - token)")
    starter = load_starter(tmp_path, text)
    b = batch()
    with pytest.raises(AssertionError, match=r"(?s)elements differ beyond .*first mismatches"):
        assert_close(run(starter, "v1", b, "emulation"), expected(b), msg="v1")
