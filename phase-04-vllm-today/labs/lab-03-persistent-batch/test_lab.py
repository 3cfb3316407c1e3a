"""Graded tests of lab 04-03: the persistent batch.

The headline property: the runner whose batch lives in rows across steps feeds the model exactly
what the per-step runner of lab 03-04 feeds it (the same tokens at the same positions into the
same slots), so the engine emits the same tokens in every configuration (chunked prefill,
preemption by recompute and by swap, speculative decoding, async scheduling), and its rows always
mirror the runner's records.

Groups, each using only its task and the ones before it (the engine tests at the end use all):
  1. tasks 1-2: ``InputBatch`` driven by hand (with the reference's ``BlockTable``), its rows
     read back as lists;
  2. task 3: ``BlockTable`` driven by hand, slots checked against the rule for every token;
  3. tasks 4-5: your runner stepped by a scheduler in this process, beside the per-step runner
     fed the same steps: after each step your rows are the records, and your inputs theirs (the
     reference's ``_prepare_inputs`` stands in for task 5 in the tests of task 4);
  4. your batch, table and runner in the engine, against the per-step engine.

Where the lab's code runs in a process of its own (course/labs/student_process.py), the runner
lives there and the test reaches it as data.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course.engine.compose import with_super_of
from course.labs.loader import load_lab
from course.labs.student_process import beside_the_student
from mini_vllm.config import SchedulerConfig, SpeculativeConfig
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from mini_vllm.core.sched.output import CachedRequestData, SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.engine.core import EngineCore as ReferenceEngineCore
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig, init_weights
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.model_runner import ModelRunner

lab = load_lab(__file__)

BLOCK = 4
MAX_STEPS = 2000  # a run of the engine tests takes a few hundred steps


@pytest.fixture(autouse=True)
def _fixed_root_hash():
    init_none_hash(sha256)


def _rows(batch):
    """The batch's rows in use, read back as lists: ``{req_id: (row, tokens, counts, blocks)}``
    plus the raw ``req_ids``; ``counts`` = (num_tokens, no_spec, prompt, computed)."""
    req_ids = list(batch.req_ids)
    arrays = {name: getattr(batch, name).tolist() for name in (
        "num_tokens", "num_tokens_no_spec", "num_prompt_tokens", "num_computed_tokens")}
    table = batch.block_table
    blocks, counts = table.block_table.tolist(), table.num_blocks_per_row.tolist()
    tokens = batch.token_ids.tolist()
    out = {}
    for row, rid in enumerate(req_ids):
        if rid is None:
            continue
        n = arrays["num_tokens"][row]
        out[rid] = (row, tokens[row][:n],
                    tuple(arrays[k][row] for k in ("num_tokens", "num_tokens_no_spec",
                                                   "num_prompt_tokens", "num_computed_tokens")),
                    blocks[row][:counts[row]])
    return req_ids, dict(batch.req_id_to_index), out


# ---------------------------------------------------------------------------- tasks 1 and 2


def _batch(rows=4, max_len=16):
    return lab.InputBatch(rows, max_len, BLOCK)


def test_a_request_takes_the_lowest_free_row():
    batch = _batch()
    got = [batch.add_request(r, [1, 2, 3], 3, 0, [7]) for r in "abc"]
    assert got == [0, 1, 2], f"a, b, c added to an empty batch took rows {got}, want [0, 1, 2]"
    assert batch.remove_request("b") == 1, "removing b (row 1) must return 1"
    req_ids, index, _ = _rows(batch)
    assert req_ids == ["a", None, "c"] and index == {"a": 0, "c": 2}, (
        f"after removing b: req_ids {req_ids}, req_id_to_index {index}; want ['a', None, 'c'] "
        "and {'a': 0, 'c': 2}: the row becomes a hole, the list keeps its length")
    assert batch.add_request("d", [4], 1, 0, []) == 1, "d must take the hole, row 1"
    assert batch.add_request("e", [5], 1, 0, []) == 3, "with no hole left, e takes row 3"
    assert batch.num_reqs == 4, f"num_reqs {batch.num_reqs}, want 4"


def test_a_row_holds_the_request_s_tokens_counts_and_blocks():
    batch = _batch()
    batch.add_request("a", [9, 9], 2, 0, [1])
    batch.add_request("b", [10, 11, 12, 13, 14], 3, 4, [5, 6])
    _, _, rows = _rows(batch)
    assert rows["b"] == (1, [10, 11, 12, 13, 14], (5, 5, 3, 4), [5, 6]), (
        f"request b's row: {rows['b']}; want (row 1, its 5 tokens, (num_tokens 5, no_spec 5, "
        "prompt 3, computed 4), blocks [5, 6])")


def test_a_request_added_over_a_longer_one_s_row_keeps_only_its_own_tokens_and_blocks():
    batch = _batch()
    batch.add_request("long", list(range(1, 13)), 12, 0, [1, 2, 3])
    batch.remove_request("long")
    batch.add_request("short", [40, 41], 2, 0, [9])
    _, _, rows = _rows(batch)
    assert rows["short"] == (0, [40, 41], (2, 2, 2, 0), [9]), (
        f"short took long's row: {rows['short']}; want (0, [40, 41], (2, 2, 2, 0), [9]): its "
        "counts and its whole block table replace the old ones")


def test_bad_adds_raise_and_change_nothing():
    batch = _batch(rows=2, max_len=8)
    batch.add_request("a", [1, 2], 2, 0, [3])
    before = _rows(batch)
    cases = {
        "an id that has a row": ("a", [1], 1, 0, []),
        "tokens past max_model_len": ("x", list(range(9)), 9, 0, []),
        "more blocks than a row holds": ("y", [1], 1, 0, [1, 2, 3]),
    }
    for what, args in cases.items():
        with pytest.raises(ValueError):
            batch.add_request(*args)
        assert _rows(batch) == before, f"adding {what} raised but changed the batch"
    # Exactly max_model_len tokens and a row's worth of blocks fit.
    assert batch.add_request("b", list(range(8)), 8, 0, [1, 2]) == 1, (
        "a request of exactly max_model_len=8 tokens in exactly 2 blocks of 4 fits a row")
    full = _rows(batch)
    with pytest.raises(ValueError):
        batch.add_request("c", [6], 1, 0, [])
    assert _rows(batch) == full, "adding to a full batch raised but changed it"


def test_removing_a_request_without_a_row_returns_none():
    batch = _batch()
    batch.add_request("a", [1], 1, 0, [])
    batch.add_request("b", [2], 1, 0, [])
    assert batch.remove_request("never") is None, "an unknown id has no row: return None"
    assert batch.remove_request("a") == 0, "removing a (row 0) must return 0"
    assert batch.remove_request("a") is None, "removing a twice: the second time, None"
    assert (list(batch.req_ids), batch.num_reqs) == ([None, "b"], 1), (
        f"after a was removed (and removed again): req_ids {list(batch.req_ids)}, num_reqs "
        f"{batch.num_reqs}; want [None, 'b'] and 1")


def test_swapping_rows_moves_everything_with_them():
    batch = _batch()
    batch.add_request("a", [1, 2, 3, 4, 5, 6], 4, 5, [1, 2])
    batch.add_request("b", [7], 1, 0, [3])
    batch.swap_states(0, 1)
    req_ids, index, rows = _rows(batch)
    assert req_ids == ["b", "a"] and index == {"b": 0, "a": 1}, (
        f"after swap_states(0, 1): req_ids {req_ids}, req_id_to_index {index}")
    assert rows["a"] == (1, [1, 2, 3, 4, 5, 6], (6, 6, 4, 5), [1, 2]) and \
        rows["b"] == (0, [7], (1, 1, 1, 0), [3]), (
            f"rows after the swap: a {rows['a']}, b {rows['b']}: each row's tokens (all of the "
            "longer one's), counts and blocks move with it")


def test_swapping_a_short_row_with_a_longer_one_after_it_moves_all_of_the_longer_one():
    batch = _batch()
    batch.add_request("s", [9], 1, 0, [4])
    batch.add_request("l", [1, 2, 3, 4, 5], 5, 2, [6, 7])
    batch.swap_states(0, 1)
    _, _, rows = _rows(batch)
    assert rows["l"] == (0, [1, 2, 3, 4, 5], (5, 5, 5, 2), [6, 7]) and \
        rows["s"] == (1, [9], (1, 1, 1, 0), [4]), (
            f"swap_states(0, 1) with the longer row second: l {rows['l']}, s {rows['s']}: move "
            "the tokens of the longer row whichever argument it is")


def test_a_row_swaps_with_a_hole():
    batch = _batch()
    for r in "abc":
        batch.add_request(r, [ord(r)], 1, 0, [])
    batch.add_request("d", [7, 8], 2, 1, [3])
    batch.remove_request("a")
    batch.swap_states(0, 3)
    req_ids, index, rows = _rows(batch)
    assert req_ids == ["d", "b", "c", None] and index == {"b": 1, "c": 2, "d": 0}, (
        f"swapping the hole at row 0 with d at row 3: req_ids {req_ids}, index {index}")
    assert rows["d"] == (0, [7, 8], (2, 2, 2, 1), [3]), (
        f"d moved into the hole as {rows['d']}: its tokens, counts and blocks move with it")


def test_condensing_fills_the_lowest_holes_with_the_last_rows():
    batch = _batch(rows=6)
    for i, r in enumerate("abcdef"):
        batch.add_request(r, [i + 1] * (i + 1), i + 1, i, [10 + i])
    for r in "bd":
        batch.remove_request(r)
    batch.condense()
    req_ids, index, rows = _rows(batch)
    assert req_ids == ["a", "f", "c", "e"], (
        f"rows a _ c _ e f condensed to {req_ids}; want ['a', 'f', 'c', 'e']: the last row "
        "fills the lowest hole, then the next last the next hole; the others keep their rows")
    assert index == {"a": 0, "f": 1, "c": 2, "e": 3}, f"req_id_to_index {index}"
    assert rows["f"] == (1, [6] * 6, (6, 6, 6, 5), [15]), (
        f"f moved to row 1 as {rows['f']}: its tokens, counts and blocks move with it")


def test_condensing_drops_trailing_holes_and_leaves_a_full_batch_alone():
    batch = _batch()
    for r in "abc":
        batch.add_request(r, [1], 1, 0, [])
    batch.remove_request("c")
    batch.condense()
    assert list(batch.req_ids) == ["a", "b"], (
        f"a b _ condensed to {list(batch.req_ids)}: a trailing hole just goes")
    batch.condense()
    assert list(batch.req_ids) == ["a", "b"], "condensing a batch without holes changes nothing"
    batch.remove_request("a")
    batch.remove_request("b")
    batch.condense()
    assert list(batch.req_ids) == [] and batch.add_request("z", [1], 1, 0, []) == 0, (
        "an emptied batch condenses to no rows, and the next request takes row 0")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aarrcs"), st.integers(0, 24)), max_size=30))
def test_any_sequence_of_adds_removes_swaps_and_condenses_keeps_every_request_s_row(ops):
    """Hypothesis: rows as the rules move them, checked after every operation (``s`` swaps two
    rows, holes included)."""
    batch = _batch(rows=5, max_len=12)
    model: list[str | None] = []  # the rows, as the rules say they are
    state: dict[str, tuple] = {}
    serial = 0
    for op, k in ops:
        k, j = k % 6, k // 6
        if op == "s" and len(model) > 1:
            a, b = j % len(model), (j + k) % len(model)
            batch.swap_states(a, b)
            model[a], model[b] = model[b], model[a]
        elif op == "a" and sum(r is not None for r in model) < 5:
            rid, serial = f"q{serial}", serial + 1
            tokens = [serial] * (k + 1)
            state[rid] = (tokens, (k + 1, k + 1, k + 1, k), [serial, serial + 1][: k % 3])
            row = next((i for i, r in enumerate(model) if r is None), len(model))
            model[row:row + 1] = [rid]
            got = batch.add_request(rid, tokens, k + 1, k, state[rid][2])
            assert got == row, f"rows {model}: {rid} took row {got}, the lowest free is {row}"
        elif op == "r":
            live = [r for r in model if r is not None]
            if not live:
                continue
            rid = live[k % len(live)]
            got = batch.remove_request(rid)
            assert got == model.index(rid), (
                f"removing {rid} of row {model.index(rid)} returned {got}")
            model[model.index(rid)] = None
        elif op == "c":
            batch.condense()
            for hole in [i for i, r in enumerate(model) if r is None]:
                while model and model[-1] is None:
                    model.pop()
                if hole >= len(model) - 1:
                    break
                model[hole] = model.pop()
            while model and model[-1] is None:
                model.pop()
        req_ids, index, rows = _rows(batch)
        if op == "c":
            assert req_ids == model, f"after condense: {req_ids}, want {model}"
        assert [r for r in req_ids if r is not None] == [r for r in model if r is not None], (
            f"rows in use {req_ids}, want {model}")
        for rid, (row, tokens, counts, blocks) in rows.items():
            assert (row, tokens, counts, blocks) == (model.index(rid), *state[rid]), (
                f"{rid}'s row {rows[rid]}, want {(model.index(rid), *state[rid])}")
        want = {r: i for i, r in enumerate(model) if r is not None}
        assert index == want, f"req_id_to_index {index}, want {want}"


# ---------------------------------------------------------------------------- task 3


def _table(rows=4, blocks=4):
    return lab.BlockTable(rows, blocks, BLOCK)


def _table_rows(table, n):
    blocks, counts = table.block_table.tolist(), table.num_blocks_per_row.tolist()
    return [blocks[i][:counts[i]] for i in range(n)]


def test_appending_blocks_extends_a_row():
    table = _table()
    table.append_row([3, 4], 1)
    table.append_row([], 1)
    table.append_row([9], 1)
    table.append_row([5], 0)
    assert _table_rows(table, 2) == [[5], [3, 4, 9]], (
        f"rows after appending [3, 4], [] and [9] to row 1 and [5] to row 0: "
        f"{_table_rows(table, 2)}")


def test_a_row_that_would_overflow_raises_and_keeps_its_blocks():
    table = _table(blocks=3)
    table.append_row([1, 2], 0)
    with pytest.raises(ValueError):
        table.append_row([3, 4], 0)
    with pytest.raises(ValueError):
        table.add_row([1, 2, 3, 4], 0)
    assert _table_rows(table, 1) == [[1, 2]], (
        f"row 0 after two refused writes: {_table_rows(table, 1)}, want [[1, 2]]")
    table.append_row([3], 0)
    assert _table_rows(table, 1) == [[1, 2, 3]], "a row may fill up to its capacity exactly"


def test_adding_a_row_replaces_its_whole_table():
    table = _table()
    table.append_row([1, 2, 3], 2)
    table.add_row([8], 2)
    table.add_row([], 3)
    assert _table_rows(table, 4)[2:] == [[8], []], (
        f"add_row([8], 2) over [1, 2, 3]: rows 2-3 {_table_rows(table, 4)[2:]}, want [[8], []]")


def test_moving_and_swapping_rows():
    table = _table()
    table.add_row([1, 2, 3], 0)
    table.add_row([4], 1)
    table.add_row([5, 6], 3)
    table.move_row(3, 1)
    assert _table_rows(table, 2) == [[1, 2, 3], [5, 6]], (
        f"move_row(3, 1): rows {_table_rows(table, 2)}, want [[1, 2, 3], [5, 6]]")
    table.swap_row(0, 1)
    assert _table_rows(table, 2) == [[5, 6], [1, 2, 3]], (
        f"swap_row(0, 1): rows {_table_rows(table, 2)}, want [[5, 6], [1, 2, 3]]")


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_every_token_s_slot_is_its_block_times_the_size_plus_its_offset(data):
    """Hypothesis: random tables and tokens; each slot checked against the rule."""
    tables = data.draw(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=4),
                                min_size=1, max_size=4))
    table = _table()
    for row, blocks in enumerate(tables):
        table.add_row(blocks, row)
    tokens = data.draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
    rows = [t % len(tables) for t in tokens]
    positions = [t % (len(tables[r]) * BLOCK) for t, r in zip(tokens, rows)]
    slots = table.compute_slot_mapping(lab.np.asarray(rows), lab.np.asarray(positions))
    assert str(slots.dtype) == "int64", f"slots have dtype {slots.dtype}, want int64"
    want = [tables[r][p // BLOCK] * BLOCK + p % BLOCK for r, p in zip(rows, positions)]
    assert slots.tolist() == want, f"rows {rows}, positions {positions}: slots {slots.tolist()}"


# ---------------------------------------------------------------------------- tasks 4 and 5

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
)


@functools.lru_cache(maxsize=1)
def tiny_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(TINY)
    init_weights(model, seed=3, std=0.5)
    return model.eval().requires_grad_(False)


def _config(**knobs) -> SchedulerConfig:
    kw = dict(block_size=BLOCK, num_gpu_blocks=64, max_num_batched_tokens=64, max_model_len=128,
              max_num_seqs=8)
    kw.update(knobs)
    return SchedulerConfig(**kw)


def _params(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _request(rid, prompt, max_tokens):
    return Request(rid, list(prompt), _params(max_tokens), eos_token_id=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def _prompts(seed=7, count=8):
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randrange(3, 30))]
            for _ in range(count)]


@beside_the_student
def _runner(upto, config):
    """Your runner, built where your code runs; the reference's ``_prepare_inputs`` stands in
    for task 5 when ``upto`` is 4. It keeps each step's inputs in ``last_inputs`` for the test."""
    from mini_vllm.worker.persistent_runner import PersistentBatchRunner as Reference

    base = lab.PersistentBatchRunner
    prepare = (with_super_of(vars(Reference)["_prepare_inputs"], base) if upto < 5
               else base._prepare_inputs)

    def kept(self, output):
        self.last_inputs = prepare(self, output)
        return self.last_inputs

    cls = type(f"PersistentBatchRunnerUpToTask{upto}", (base,), {"_prepare_inputs": kept})
    return cls(tiny_model(), block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks,
               num_cpu_blocks=config.num_cpu_blocks, max_num_reqs=config.max_num_seqs,
               max_model_len=config.max_model_len)


def _reference_runner(config):
    return ModelRunner(tiny_model(), block_size=config.block_size,
                       num_gpu_blocks=config.num_gpu_blocks, num_cpu_blocks=config.num_cpu_blocks)


def _reversed_cached(out):
    """The step with its cached requests listed the other way round (any order is a valid
    step: requests back in the batch then come before those that kept their rows)."""
    cached = out.scheduled_cached_reqs
    for name in ("req_ids", "resumed_from_preemption", "new_token_ids", "new_block_ids",
                 "num_computed_tokens"):
        setattr(cached, name, getattr(cached, name)[::-1])
    return out


def _step_both(config, waves, upto, check, reorder=None):
    """Step a scheduler (here) over ``waves`` of ``(rid, prompt, max_tokens)``, each step run by
    your runner and by the per-step runner (``reorder`` first rewrites the step's output);
    ``check(step, output, got, theirs, ref, yours)`` after each step that computes tokens.
    Returns the number of preemptions."""
    scheduler, ref = Scheduler(config), _reference_runner(config)
    yours = _runner(upto, config, beside=lab)
    for wave in waves:
        for rid, prompt, n in wave:
            scheduler.add_request(_request(rid, prompt, n))
        for step in range(MAX_STEPS):
            if not scheduler.has_unfinished_requests():
                break
            out = scheduler.schedule()
            if reorder is not None:
                out = reorder(out)
            theirs = ref.execute_model(out)
            got = yours.execute_model(out)
            if out.total_num_scheduled_tokens:
                check(step, out, got, theirs, ref, yours)
            scheduler.update_from_output(out, theirs)
        else:
            raise RuntimeError(f"set-up: the scheduler still had work after {MAX_STEPS} steps")
    return scheduler.stats.num_preemptions


def _check_rows(step, out, got, theirs, ref, yours):
    """After a step: the rows are the scheduled requests, each the per-step runner's record."""
    req_ids, _, rows = _rows(yours.input_batch)
    scheduled = set(out.num_scheduled_tokens)
    assert None not in req_ids and set(req_ids) == scheduled, (
        f"step {step}: rows {req_ids} after the step; want exactly the scheduled "
        f"{sorted(scheduled)}, no hole (condense after the diff)")
    for rid, (_, tokens, counts, blocks) in rows.items():
        record = ref.requests[rid]
        assert blocks == record.block_ids, (
            f"step {step}: {rid}'s block-table row {blocks}, its blocks {record.block_ids}")
        assert counts[3] == record.num_computed_tokens, (
            f"step {step}: {rid}'s row says {counts[3]} tokens computed before the step, the "
            f"scheduler {record.num_computed_tokens}")
        assert counts[2] == record.num_prompt_tokens and \
            tokens[:counts[1]] == record.token_ids[:counts[1]], (
                f"step {step}: {rid}'s row tokens {tokens} (prompt {counts[2]}), its tokens "
                f"{record.token_ids} (prompt {record.num_prompt_tokens})")
    assert list(got.req_ids) == list(yours.batch_req_ids) == req_ids, (
        f"step {step}: the output's order {list(got.req_ids)}, batch_req_ids "
        f"{list(yours.batch_req_ids)}, rows {req_ids}: all three are the step's order")
    mine = dict(zip(got.req_ids, got.sampled_token_ids))
    want = dict(zip(theirs.req_ids, theirs.sampled_token_ids))
    assert mine == want, f"step {step}: sampled {mine}, the per-step runner {want}"


ROW_CASES = {
    "one-wave": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=12),
    "few-seats": dict(max_num_seqs=3),
    "preemption": dict(num_gpu_blocks=14, max_num_batched_tokens=24),
    "swap": dict(num_gpu_blocks=14, max_num_batched_tokens=24, preemption_mode="swap",
                 num_cpu_blocks=64),
}


def _waves(count=1, seed=7):
    prompts, max_tokens = _prompts(seed), [1, 2, 3, 9, 17, 24, 5, 12]
    return [[(f"w{w}q{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
            for w in range(count)]


@pytest.mark.points(3)
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_after_each_step_your_rows_are_the_scheduled_requests_records(case):
    preemptions = _step_both(_config(**ROW_CASES[case]), _waves(2), 4, _check_rows)
    if case in ("preemption", "swap"):
        assert preemptions > 0, f"set-up: {case} was meant to preempt"


def test_a_request_back_in_the_batch_listed_first_does_not_stop_the_others_updates():
    preemptions = _step_both(_config(**ROW_CASES["preemption"]), _waves(2), 4, _check_rows,
                             reorder=_reversed_cached)
    assert preemptions > 0, "set-up: this run was meant to preempt"


@beside_the_student
def _count_adds(runner):
    """Set-up: count the rows your batch hands out from now on (how the code runs)."""
    batch = runner.input_batch
    add = batch.add_request

    def counted(*args, **kwargs):
        runner.rows_handed_out = getattr(runner, "rows_handed_out", 0) + 1
        return add(*args, **kwargs)

    batch.add_request = counted


def test_a_request_that_keeps_decoding_keeps_its_row():
    config = _config()
    scheduler = Scheduler(config)
    yours = _runner(4, config, beside=lab)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6, 7, 8, 9])):
        scheduler.add_request(_request(rid, prompt, 12))
    out = scheduler.schedule()
    scheduler.update_from_output(out, yours.execute_model(out))
    rows_before, batch = list(yours.input_batch.req_ids), yours.input_batch
    _count_adds(yours, beside=lab)
    for _ in range(6):
        out = scheduler.schedule()
        scheduler.update_from_output(out, yours.execute_model(out))
    handed_out = getattr(yours, "rows_handed_out", 0)
    assert yours.input_batch is batch, (
        "your runner replaced its InputBatch between two steps: the batch lives across steps")
    assert handed_out == 0 and list(yours.input_batch.req_ids) == rows_before, (
        f"six decode steps of a, b and c, no request arriving or leaving: your batch handed out "
        f"{handed_out} row(s) and went from {rows_before} to {list(yours.input_batch.req_ids)}; "
        "a request that stays keeps its row and gets only the diff (that is the point)")


def test_a_finished_id_the_batch_never_held_is_not_an_error():
    config = _config()
    scheduler = Scheduler(config)
    yours = _runner(4, config, beside=lab)
    scheduler.add_request(_request("a", [1, 2, 3], 4))
    out = scheduler.schedule()
    out.finished_req_ids = {"never-seen"}
    got = yours.execute_model(out)
    assert list(yours.input_batch.req_ids) == ["a"] and list(got.req_ids) == ["a"], (
        f"a step naming a finished request the runner never saw (async scheduling sends such "
        f"news late) left rows {list(yours.input_batch.req_ids)}; want ['a'], and no error")


def test_an_id_used_again_after_an_abort_starts_afresh():
    config = _config()
    yours = _runner(4, config, beside=lab)
    first = Scheduler(config)
    first.add_request(_request("x", range(1, 10), 4))
    yours.execute_model(first.schedule())
    # The id comes back as a new request of another scheduler: the runner never heard that
    # the first one ended, and its row is still there.
    second = Scheduler(config)
    second.add_request(_request("x", [40, 41, 42], 4))
    out = second.schedule()
    yours.execute_model(out)
    _, _, rows = _rows(yours.input_batch)
    want_blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    assert rows["x"][1] == [40, 41, 42] and rows["x"][3] == want_blocks, (
        f"x came back as a new request with prompt [40, 41, 42] and blocks {want_blocks}: its "
        f"row {rows['x']} keeps the old request's state; free the row of each new request's "
        "id first")


def _per_request(input_ids, meta):
    """``{req_id: (tokens, positions, slots, seq_len, blocks)}`` of a step's inputs."""
    starts = meta.query_start_loc.tolist()
    ids, pos, slots = input_ids.tolist(), meta.positions.tolist(), meta.slot_mapping.tolist()
    seqs, tables = meta.seq_lens.tolist(), meta.block_tables.tolist()
    out = {}
    for i, rid in enumerate(meta.req_ids):
        a, b = starts[i], starts[i + 1]
        out[rid] = (ids[a:b], pos[a:b], slots[a:b], seqs[i], tables[i][:-(-seqs[i] // BLOCK)])
    return out


def _check_inputs(step, out, got, theirs, ref, yours):
    """Your step's inputs, request by request, are those the per-step runner built, and the
    batch is decodes first."""
    want = _per_request(*ref._prepare_inputs(out))
    input_ids, meta = yours.last_inputs
    mine = _per_request(input_ids, meta)
    assert set(mine) == set(want), (
        f"step {step}: your inputs are for {sorted(mine)}, the step schedules {sorted(want)}")
    for rid in want:
        assert mine.get(rid) == want[rid], (
            f"step {step}: request {rid}'s (tokens, positions, slots, seq_len, blocks) are "
            f"{mine.get(rid)}, the per-step runner's {want[rid]}")
    assert list(meta.req_ids) == list(yours.batch_req_ids) == list(yours.input_batch.req_ids), (
        f"step {step}: metadata order {list(meta.req_ids)}, batch_req_ids "
        f"{list(yours.batch_req_ids)}, rows {list(yours.input_batch.req_ids)}: the same order")
    queries = [out.num_scheduled_tokens[r] for r in meta.req_ids]
    decodes = sum(q == 1 for q in queries)
    assert all(q == 1 for q in queries[:decodes]) and meta.num_decodes == decodes, (
        f"step {step}: tokens per request in batch order {queries}: decodes must come first")


@pytest.mark.points(3)
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_your_inputs_are_the_per_step_runner_s(case):
    _step_both(_config(**ROW_CASES[case]), _waves(2, seed=9), 5, _check_inputs)


def test_a_row_behind_its_record_gets_the_missing_tokens_and_drops_rejected_drafts():
    config = _config()
    scheduler = Scheduler(config)
    yours = _runner(5, config, beside=lab)
    scheduler.add_request(_request("a", [1, 2, 3], 10))
    out = scheduler.schedule()
    got = yours.execute_model(out)
    sampled = list(got.sampled_token_ids[0])
    scheduler.update_from_output(out, got)
    # Step 2 checks two drafts; say 50 is accepted, 51 rejected, and the bonus token is 33.
    scheduler.requests["a"].spec_token_ids = [50, 51]
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [50, 51]}, "set-up: two drafts scheduled"
    input_ids, meta = _inputs_with_drafts(yours, out, beside=lab)
    assert input_ids.tolist() == [sampled[0], 50, 51], (
        f"step 2 of a (prompt [1, 2, 3], sampled {sampled}, drafts [50, 51]) fed "
        f"{input_ids.tolist()}; want [{sampled[0]}, 50, 51]: the token sampled last step, then "
        "the drafts")
    _reject_drafts(yours, [33], beside=lab)
    out3 = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(
            req_ids=["a"], resumed_from_preemption=[False], new_token_ids=[[]],
            new_block_ids=[None], num_computed_tokens=[5]),
        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
        num_common_prefix_blocks=[0], finished_req_ids=set())
    input_ids, meta = _inputs_with_drafts(yours, out3, beside=lab)
    assert input_ids.tolist() == [33] and meta.positions.tolist() == [5], (
        f"after draft 50 was accepted, 51 rejected and 33 emitted, step 3 fed "
        f"{input_ids.tolist()} at {meta.positions.tolist()}; want [33] at [5]: the row is as "
        "long as the record, but positions from num_tokens_no_spec on are stale and take the "
        "record's tokens")


@beside_the_student
def _inputs_with_drafts(runner, output):
    """Set-up: run the runner's update, then stage the drafts as its step does, then yours."""
    runner._update_states(output)
    runner._stage_drafts(output)
    return runner._prepare_inputs(output)


@beside_the_student
def _reject_drafts(runner, emitted):
    """Set-up: what the rejection sampler leaves in the record when the first of two drafts is
    accepted: the second gone, ``emitted`` appended."""
    record = runner.requests["a"]
    del record.token_ids[-1:]
    record.token_ids.extend(emitted)


# ---------------------------------------------------------------------------- your engine


@beside_the_student
def _with_your_pieces(waves, config, knobs):
    """Set-up: the engine core with your runner, your batch and your block table in it."""
    from mini_vllm.engine import core as core_module
    from mini_vllm.worker import input_batch as batch_module

    saved = core_module.PersistentBatchRunner, batch_module.BlockTable
    core_module.PersistentBatchRunner, batch_module.BlockTable = (lab.PersistentBatchRunner,
                                                                  lab.BlockTable)
    try:
        core = ReferenceEngineCore(tiny_model(), config, persistent_batch=True, **knobs)
    finally:
        core_module.PersistentBatchRunner, batch_module.BlockTable = saved
    got = {}
    try:
        for wave in waves:
            for rid, prompt, n in wave:
                core.add_request(core.make_request(rid, list(prompt), _params(n)))
                got[rid] = []
            for _ in range(MAX_STEPS):
                if not (core.has_unfinished_requests() or core.batch_queue):
                    break
                for out in core.step_fn() or []:
                    got[out.request_id] += out.new_token_ids
            else:
                raise RuntimeError(f"the engine still had work after {MAX_STEPS} steps: some "
                                   "request is never finished")
    finally:
        core.drain_batch_queue()
    return {"tokens": got, "blocks": int(core.num_blocks_in_use),
            "preemptions": core.scheduler.stats.num_preemptions}


def _per_step_engine(waves, config, knobs):
    core = ReferenceEngineCore(tiny_model(), config, **knobs)
    got = {}
    for wave in waves:
        for rid, prompt, n in wave:
            core.add_request(core.make_request(rid, list(prompt), _params(n)))
            got[rid] = []
        while core.has_unfinished_requests() or core.batch_queue:
            for out in core.step_fn() or []:
                got[out.request_id] += out.new_token_ids
    core.drain_batch_queue()
    return got


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                          prompt_lookup_min=1)
ENGINES = {
    "roomy": ({}, {}),
    "chunked-prefill": (dict(max_num_batched_tokens=12), {}),
    "preemption": (dict(num_gpu_blocks=14, max_num_batched_tokens=24), {}),
    "swap": (dict(num_gpu_blocks=14, max_num_batched_tokens=24, preemption_mode="swap",
                  num_cpu_blocks=64), {}),
    "speculative": ({}, dict(speculative_config=NGRAM)),
    "async-scheduling": (dict(max_num_batched_tokens=16), dict(async_scheduling=True)),
}


@pytest.mark.points(3)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_your_persistent_engine_gives_the_per_step_engine_s_tokens(engine):
    knobs, engine_knobs = ENGINES[engine]
    config = _config(**knobs)
    waves = [[(f"w{w}q{i}", p, n) for i, (p, n) in enumerate(zip(
        _prompts(seed=13 + w), [1, 2, 3, 9, 17, 24, 5, 12]))] for w in range(2)]
    want = _per_step_engine(waves, config, engine_knobs)
    got = _with_your_pieces(waves, config, engine_knobs, beside=lab)
    assert got["tokens"] == want, (
        f"{engine}: your persistent engine's tokens differ from the per-step engine's: "
        + "; ".join(f"{r}: {got['tokens'].get(r)} vs {want[r]}" for r in want
                    if got["tokens"].get(r) != want[r])[:600])
    assert got["blocks"] == 0, f"{engine}: {got['blocks']} block(s) held at the end, want 0"
    if engine in ("preemption", "swap"):
        assert got["preemptions"] > 0, f"set-up: {engine} was meant to preempt"
