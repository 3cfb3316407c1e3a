"""Graded tests for lab 04-05: tensor parallelism.

No process and no network: a rank runs alone, and its group's collectives are answered by
*simulated peers* (``Peers``, here in the test): each all-reduce or all-gather returns what the
whole computation has at that point, and the rank's own contribution is kept. The expected
contributions are computed here, from the whole layer or the whole model and the split rule
written out below (never from the lab's code): a rank must send exactly its share, call by call,
and the shares of all ranks add up to the truth.

Groups: task 1 (the head split, on worked cases and on drawn configurations), task 2 (the two
linear splits), task 3 (the vocabulary split), task 4 (whole models cut, every rank's
contributions checked: a tiny GQA model at tp 2 and 4, the shipped model at tp 4 with its
vocabulary padded, a tied model).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from course.labs.loader import load_lab
from course.labs.numerics import assert_close
from course.labs.student_process import beside_the_student
from mini_vllm.distributed.parallel_state import TensorParallelGroup
from mini_vllm.model_executor.model_loader.loader import load_default_model
from mini_vllm.model_executor.models.llama import (
    Linear,
    LlamaForCausalLM,
    ModelConfig,
    init_weights,
)

lab = load_lab(__file__)

TINY = ModelConfig(vocab_size=66, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64)
IDS = torch.tensor([[3, 17, 42, 5, 65, 0, 8, 64]])


class Peers:
    """The other ranks of one rank's group, simulated: each collective is answered from
    ``answers`` in order, and what the rank sent is kept in ``sent`` as ``(op, tensor)``."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.sent: list[tuple[str, torch.Tensor]] = []

    def __call__(self, op, rank, tensor, dim=None):
        if len(self.sent) >= len(self.answers):
            raise AssertionError(f"rank {rank} made more collectives than the split needs "
                                 f"({len(self.answers)})")
        want, value = self.answers[len(self.sent)]
        self.sent.append((op, tensor.detach().clone()))
        if op != want:
            raise AssertionError(f"rank {rank}: collective {len(self.sent)} is {op}, expected "
                                 f"{want}")
        if op == "all_gather" and dim % tensor.dim() != tensor.dim() - 1:
            raise AssertionError(f"rank {rank}: the logits are gathered along dimension {dim} "
                                 "of their shape; the vocabulary is the last one")
        return value.clone()


def group(rank, tp, answers=()):
    peers = Peers(answers)
    return TensorParallelGroup(rank, tp, peers=peers), peers


def tiny_model(config=TINY, seed=1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    init_weights(model, seed=seed, std=0.3)
    return model.eval().requires_grad_(False)


@beside_the_student
def _rebuilt(config: ModelConfig, state: dict) -> LlamaForCausalLM:
    """Set-up only: a copy of a whole model, built where the lab's code runs (a model is
    handed to ``shard_model`` there; what the rank sends is checked here)."""
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


def rebuilt(model: LlamaForCausalLM):
    return _rebuilt(model.config, dict(model.state_dict()), beside=lab)


# ------------------------------------------------------------------------------------------
# The split rule, written out independently of the lab
# ------------------------------------------------------------------------------------------


def expected_heads(heads, kv, tp, rank):
    per = heads // tp
    q = range(rank * per, (rank + 1) * per)
    if tp <= kv:
        return q, range(rank * (kv // tp), (rank + 1) * (kv // tp))
    first = rank // (tp // kv)
    return q, range(first, first + 1)


def splits(heads, kv, inter):
    return [n for n in range(1, heads + 1)
            if heads % n == 0 and (kv % n == 0 or n % kv == 0) and inter % n == 0]


# ------------------------------------------------------------------------------------------
# Task 1: the head split
# ------------------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("heads, kv, tp", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8),
                                           (9, 3, 3), (4, 4, 2), (6, 1, 3)])
def test_head_ranges_split_or_replicate_the_kv_heads(heads, kv, tp):
    """KV heads split evenly while tp <= KV heads (8/2 at tp 2), each kept whole by tp/KV
    ranks beyond (8/2 at tp 4 and 8, 6/1 at tp 3)."""
    cfg = ModelConfig(hidden_size=heads * 8, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=840)
    for rank in range(tp):
        got = lab.head_ranges(cfg, tp, rank)
        assert tuple(got) == expected_heads(heads, kv, tp, rank), (
            f"{heads} heads, {kv} KV heads, tp {tp}, rank {rank}: got {got}")


@settings(max_examples=40)
@given(kv=st.sampled_from([1, 2, 3, 4, 6, 8]), group_size=st.sampled_from([1, 2, 3, 4]),
       data=st.data())
def test_every_rank_reads_only_its_own_kv_heads(kv, group_size, data):
    """Drawn GQA shapes and every size that splits them: the ranks' query heads cover every
    head once, and each query head's KV head (h // group) is one its rank keeps."""
    heads = kv * group_size
    cfg = ModelConfig(hidden_size=heads * 8, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=840)
    tp = data.draw(st.sampled_from(splits(heads, kv, 840)))
    covered = []
    for rank in range(tp):
        q, kv_heads = lab.head_ranges(cfg, tp, rank)
        covered += list(q)
        assert all(h // group_size in kv_heads for h in q), (
            f"{heads}/{kv} heads at tp {tp}: rank {rank}'s query heads {q} read KV heads its "
            f"range {kv_heads} does not keep")
        assert len(kv_heads) == max(1, kv // tp), (
            f"{heads}/{kv} heads at tp {tp}: rank {rank} keeps {len(kv_heads)} KV heads, "
            f"expected {max(1, kv // tp)}")
    assert covered == list(range(heads)), (
        f"{heads} heads at tp {tp}: the ranks' query heads, in rank order, are {covered}; "
        "each head must be kept by exactly one rank, rank 0 first")


@pytest.mark.points(1)
def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3.*use one of \[1, 2, 4\]"):
        lab.check_tp_size(ModelConfig(num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=384), 3)
    # the MLP does not split in 4 (6 features)
    with pytest.raises(ValueError, match=r"use one of \[1, 2\]"):
        lab.check_tp_size(ModelConfig(hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=6), 4)
    # KV heads that neither split over tp nor divide it (6 KV heads at tp 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        lab.check_tp_size(ModelConfig(hidden_size=96, num_attention_heads=12,
                                      num_key_value_heads=6, intermediate_size=48), 4)
    for bad in (0, -2, 2.0):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            lab.check_tp_size(TINY, bad)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        lab.head_ranges(TINY, 3, 0)
    lab.check_tp_size(TINY, 4)  # fits: no error


# ------------------------------------------------------------------------------------------
# Task 2: the linear layers
# ------------------------------------------------------------------------------------------


def _full(in_f, out_f, bias, seed):
    torch.manual_seed(seed)
    layer = Linear(in_f, out_f, bias=bias)
    return layer.requires_grad_(False)


@pytest.mark.points(2)
@pytest.mark.parametrize("bias", [True, False])
def test_column_parallel_keeps_its_rows(bias):
    """Rows 4:8 of a [12, 16] layer: the weight's and the bias's, computed from the whole input;
    the shard's own copy (the whole layer zeroed afterwards changes nothing)."""
    full = _full(16, 12, bias, seed=2)
    want_w = full.weight[4:8].clone()
    want_b = full.bias[4:8].clone() if bias else None
    shard = lab.ColumnParallelLinear.from_full(full, 4, 8)
    assert (shard.in_features, shard.out_features) == (16, 4), (
        f"a [4, 16] shard says it is [{shard.out_features}, {shard.in_features}]")
    with torch.no_grad():
        full.weight.zero_()
    x = torch.randn(3, 16)
    assert_close(shard.weight, want_w, msg="the shard's weight")
    assert (shard.bias is None) == (not bias), "the bias is kept exactly when the layer has one"
    want = x @ want_w.T + (want_b if bias else 0)
    assert_close(shard(x), want, msg="the column-parallel output")


@pytest.mark.points(2)
@pytest.mark.parametrize("bias", [True, False])
def test_row_parallel_reduces_once_and_adds_the_bias_once(bias):
    """Columns 4:8 of a [6, 12] layer at rank 1 of 3: the rank sends its partial product (no
    bias) to one all-reduce and returns the sum it gets back plus the bias."""
    full = _full(12, 6, bias, seed=3)
    x = torch.randn(2, 12)
    total = torch.randn(2, 6)  # what the peers say the sum is
    tp, peers = group(1, 3, [("all_reduce", total)])
    shard = lab.RowParallelLinear.from_full(full, 4, 8, tp)
    assert (shard.in_features, shard.out_features) == (4, 6), (
        f"a [6, 4] shard says it is [{shard.out_features}, {shard.in_features}]")
    out = shard(x[:, 4:8])
    assert len(peers.sent) == 1, f"{len(peers.sent)} collectives; a row-parallel layer makes one"
    assert_close(peers.sent[0][1], x[:, 4:8] @ full.weight[:, 4:8].T,
                 msg="the rank's partial product (columns 4:8, no bias)")
    assert_close(out, total + (full.bias if bias else 0), msg="the reduced output")


@pytest.mark.points(1)
def test_quantized_weights_are_refused():
    """A layer whose weight holds GGUF blocks cannot be cut by rows or columns of numbers."""
    full = _full(32, 8, False, seed=6)
    full.weight_format = "q8_0"
    g, _ = group(0, 2)
    with pytest.raises(ValueError, match="unquantized"):
        lab.ColumnParallelLinear.from_full(full, 0, 4)
    with pytest.raises(ValueError, match="unquantized"):
        lab.RowParallelLinear.from_full(full, 0, 16, g)


# ------------------------------------------------------------------------------------------
# Task 3: the vocabulary
# ------------------------------------------------------------------------------------------


@pytest.mark.points(1)
@pytest.mark.parametrize("vocab, tp", [(258, 4), (64, 2), (10, 3), (5, 1)])
def test_vocab_ranges(vocab, tp):
    per = math.ceil(vocab / tp)
    for rank in range(tp):
        g, _ = group(rank, tp)
        got = tuple(lab.vocab_range(vocab, g))
        assert got == (rank * per, (rank + 1) * per), (
            f"vocabulary {vocab} at tp {tp}, rank {rank}: got {got}, expected "
            f"{(rank * per, (rank + 1) * per)} (ceil({vocab} / {tp}) rows a rank)")


@pytest.mark.points(2)
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_embedding_contributes_its_rows_only(rank):
    """A vocabulary of 10 over 3 ranks (4 rows each, the last two of rank 2 padding): each rank
    sends the rows of its ids and zeros elsewhere, and returns the all-reduce's answer."""
    torch.manual_seed(4)
    full = nn.Embedding(10, 6).requires_grad_(False)
    ids = torch.tensor([[0, 9, 4, 8, 3, 7]])
    total = torch.randn(1, 6, 6)
    tp, peers = group(rank, 3, [("all_reduce", total)])
    out = lab.VocabParallelEmbedding(full, tp)(ids)
    mine = (ids >= 4 * rank) & (ids < 4 * rank + 4)
    want = full.weight[ids] * mine.unsqueeze(-1)
    assert len(peers.sent) == 1, f"{len(peers.sent)} collectives; the embedding makes one"
    assert_close(peers.sent[0][1], want, msg=f"rank {rank}'s contribution")
    assert_close(out, total, msg="the embedding returns the all-reduce's answer")


@pytest.mark.points(2)
@pytest.mark.parametrize("rank", [0, 2])
def test_lm_head_gathers_and_cuts_the_padding(rank):
    """Logits over a vocabulary of 10 from 3 ranks of 4 rows: a rank sends its 4 columns
    (zeros for padding rows), and returns the gathered 12 columns cut to 10."""
    full = _full(6, 10, False, seed=5)
    h = torch.randn(2, 6)
    gathered = torch.randn(2, 12)
    tp, peers = group(rank, 3, [("all_gather", gathered)])
    out = lab.ParallelLMHead(full, tp)(h)
    rows = torch.zeros(4, 6)
    real = full.weight[4 * rank:4 * rank + 4]
    rows[:real.shape[0]] = real
    assert len(peers.sent) == 1 and peers.sent[0][0] == "all_gather", (
        f"collectives made: {[op for op, _ in peers.sent]}; the head makes one all-gather")
    assert_close(peers.sent[0][1], h @ rows.T, msg=f"rank {rank}'s logits")
    assert_close(out, gathered[:, :10], msg="the whole vocabulary's logits, padding cut")


# ------------------------------------------------------------------------------------------
# Task 4: a whole model
# ------------------------------------------------------------------------------------------


def collectives(model, ids, tp):
    """For each collective of a split run, in call order: its op, the whole value it returns,
    and what each rank must contribute, all read off the whole model."""
    cfg, d = model.config, model.config.head_dim
    calls, hooks = [], []
    embed = model.model.embed_tokens.weight
    per = math.ceil(cfg.vocab_size / tp)

    def on_embedding(_m, args, out):
        parts = []
        for r in range(tp):
            mine = (args[0] >= r * per) & (args[0] < (r + 1) * per)
            parts.append(embed[args[0]] * mine.unsqueeze(-1))
        calls.append(("all_reduce", out, parts))

    def on_row(cols_of):
        def hook(module, args, out):
            x = args[0]
            parts = [x[..., cols_of(r)] @ module.weight[:, cols_of(r)].T for r in range(tp)]
            bias = module.bias if module.bias is not None else 0
            calls.append(("all_reduce", out - bias, parts))
        return hook

    def q_cols(r):
        q, _ = expected_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp, r)
        return slice(q.start * d, q.stop * d)

    inter = cfg.intermediate_size // tp
    hooks.append(model.model.embed_tokens.register_forward_hook(on_embedding))
    for layer in model.model.layers:
        hooks.append(layer.self_attn.o_proj.register_forward_hook(on_row(q_cols)))
        hooks.append(layer.mlp.down_proj.register_forward_hook(
            on_row(lambda r: slice(r * inter, (r + 1) * inter))))
    with torch.no_grad():
        logits = model.forward_reference(ids)
    for h in hooks:
        h.remove()
    padded = torch.zeros(*logits.shape[:-1], per * tp)
    padded[..., :cfg.vocab_size] = logits
    calls.append(("all_gather", padded, list(padded.split(per, dim=-1))))
    return calls


def check_every_rank(model, tp, ids=IDS):
    calls = collectives(model, ids, tp)
    for rank in range(tp):
        g, peers = group(rank, tp, [(op, value) for op, value, _ in calls])
        shard = lab.shard_model(rebuilt(model), g)
        with torch.no_grad():
            shard.forward_reference(ids)
        assert len(peers.sent) == len(calls), (
            f"rank {rank} of {tp}: {len(peers.sent)} collectives, the split needs "
            f"{len(calls)} (the embedding, two a layer, the logits)")
        for k, ((op, tensor), (_, _, parts)) in enumerate(zip(peers.sent, calls)):
            assert_close(tensor, parts[rank], rtol=1e-4, atol=1e-4,
                         msg=f"rank {rank} of {tp}, collective {k} ({op}): its contribution")


@pytest.mark.points(3)
@pytest.mark.parametrize("tp", [2, 4])
def test_a_gqa_model_splits_at_tp_2_and_4(tp):
    """8 query heads on 2 KV heads (at tp 4 each KV head is kept by two ranks), a vocabulary
    of 66 padded to 68 at tp 4: every rank's every contribution."""
    check_every_rank(tiny_model(), tp)


@pytest.mark.points(2)
def test_the_shipped_model_splits_at_tp_4():
    """The shipped model (4 heads, 2 KV heads, a 258-token vocabulary padded to 4 x 65)."""
    check_every_rank(load_default_model(), 4)


@pytest.mark.points(2)
def test_a_shard_has_the_rank_s_shapes_and_a_tied_head():
    """Rank 1 of 2 of a model with tied embeddings and biases on q/k/v and o: the attention's
    head counts, the layers' shapes, the head sharing the embedding's shard, and every
    contribution (the o_proj bias added once, after the reduce)."""
    cfg = ModelConfig(vocab_size=66, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True,
                      attention_bias=True, o_proj_bias=True)
    model = tiny_model(cfg, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_()
    check_every_rank(model, 2)
    g, _ = group(1, 2)
    shard = lab.shard_model(rebuilt(model), g)
    attn, mlp, d = shard.model.layers[0].self_attn, shard.model.layers[0].mlp, cfg.head_dim
    shapes = {"(num_heads, num_kv_heads)": (attn.num_heads, attn.num_kv_heads),
              **{name: tuple(module.weight.shape) for name, module in (
                  ("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("o_proj", attn.o_proj),
                  ("down_proj", mlp.down_proj))}}
    want = {"(num_heads, num_kv_heads)": (4, 1), "q_proj": (4 * d, 64), "k_proj": (d, 64),
            "o_proj": (64, 4 * d), "down_proj": (64, 48)}
    assert shapes == want, f"rank 1 of 2: got {shapes}, expected {want}"
    head, embedding = shard.lm_head.weight, shard.model.embed_tokens.weight
    assert head.data_ptr() == embedding.data_ptr() and head.shape == embedding.shape, (
        "with tied embeddings the LM head must share the embedding's shard (one tensor)")


# ------------------------------------------------------------------------------------------
# Not graded
# ------------------------------------------------------------------------------------------


@pytest.mark.starter_ok
def test_a_group_of_one_leaves_the_model_whole():
    """Not graded (a starter that returns the model passes it too): tp 1 is the model."""
    model = tiny_model()
    want = model.forward_reference(IDS)
    g, peers = group(0, 1)
    got = lab.shard_model(rebuilt(model), g).forward_reference(IDS)
    assert_close(got, want, msg="tp 1: the model as it was")
    assert not peers.sent, "a group of one makes no collective"
