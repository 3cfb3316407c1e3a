"""The draft-model proposer: a small model that shares the target's vocabulary guesses the next
tokens, one greedy step at a time, and the target checks them all in its next forward pass.

The draft keeps its own paged KV cache: one ``(key, value)`` pair per draft layer, with as many
blocks as the target's cache and addressed through the *same* block tables, as upstream's draft
layers live in the target's KV-cache groups. So the draft needs no blocks of its own, only slots
past a request's last token for the drafts it feeds back in: the scheduler's lookahead slots
(``num_lookahead_tokens = num_speculative_tokens``, claimed by ``allocate_slots``).

A request gets no lookahead slots on admission (as upstream: it has not drafted yet), so after
a prefill that fills its last block exactly, the draft has no slot for the sampled token and
the request's first drafts come one step later.

For a request whose ``token_ids`` now hold ``T`` tokens (the one just sampled included), a
proposal of ``n`` drafts is

* one forward pass over the tokens the draft has not seen yet (positions ``[computed, T)``: the
  whole prompt the first time, then the tokens the last step accepted), whose last row gives the
  first draft greedily;
* ``n - 1`` single-row passes, each feeding the previous draft at the next position.

All the requests of a step are batched in each pass. Drafts are greedy (argmax), and the
rejection sampler treats them as certain (``q`` is one-hot), as upstream's draft-model proposer
does by default; with ``temperatures`` (upstream's ``draft_sample_method="probabilistic"``) a
sampled request's drafts are drawn from the draft's distribution at its temperature, with its
own generator, and that distribution is kept for the rejection sampler
(:meth:`take_draft_probs`). The target's verdict alone decides what is emitted, so a poor draft
costs speed, never correctness.

Invariant: for every request it tracks, the draft cache holds the draft's K/V of the request's
tokens at positions ``[0, computed)`` in the request's current blocks, written by this proposer
for this request. The draft writes only into slots of the request's own block table (a block the
table does not reach yet caps the proposal instead), so it never touches another request's
blocks except with the same tokens at the same positions (a shared prefix block holds the same
values whoever writes them). Whatever moves a request's target KV (preemption, swapping, a block
copy) makes the runner call :meth:`forget` or :meth:`invalidate_blocks`, and the draft
recomputes that request from position 0.

upstream: vllm/v1/spec_decode/eagle.py:42 @ v0.11.0 (EAGLE's proposer: a draft network over the
target's block tables and lookahead slots; today's ``draft_model.py`` runs a plain draft model on
the same base, ``llm_base_proposer.py``, which drafts from the target's own step inputs; this
proposer catches up on the tokens it has not seen instead, and needs no hidden states from the
target)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from mini_vllm.attention import paged_attn
from mini_vllm.attention.backend import PagedAttentionBackend
from mini_vllm.attention.metadata import (
    build_attention_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)

if TYPE_CHECKING:
    from mini_vllm.model_executor.models.llama import LlamaForCausalLM

__all__ = ["DraftModelProposer"]


class DraftModelProposer:
    """Proposes up to ``num_speculative_tokens`` greedy draft tokens per request with ``model``.

    ``block_size`` and ``num_blocks`` are the target cache's: the draft cache mirrors it block
    for block. ``max_model_len`` caps every proposal (no draft at a position the model cannot
    hold). The runner may later set :attr:`fast_forward`, a faster forward pass for the draft
    (the CPU's compiled step, built over :attr:`kv_caches`) returning ``None`` where it does not
    apply.

    upstream: vllm/v1/spec_decode/eagle.py:42 @ v0.11.0
    """

    fast_forward: Callable[[torch.Tensor, object], torch.Tensor | None] | None = None

    def __init__(self, model: LlamaForCausalLM, *, num_speculative_tokens: int, block_size: int,
                 num_blocks: int, max_model_len: int) -> None:
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DraftModelProposer: {name} must be an int >= 1, got {value!r}")
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = min(max_model_len, model.config.max_position_embeddings)
        cfg = model.config
        param = next(model.parameters())
        dtype = param.dtype if param.dtype.is_floating_point else torch.float32
        self.device = param.device
        x = paged_attn.kv_cache_x(dtype)
        self.kv_caches = [
            (torch.zeros((num_blocks, cfg.num_key_value_heads, cfg.head_dim // x, block_size, x),
                         dtype=dtype, device=self.device),
             torch.zeros((num_blocks, cfg.num_key_value_heads, cfg.head_dim, block_size),
                         dtype=dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.attn_backend = PagedAttentionBackend(cfg.num_key_value_heads, None, "auto",
                                                  self.kv_caches)
        # Per request: how many leading tokens the draft cache holds, and the block table they
        # were written through (a table that no longer starts with it means the blocks moved).
        self.num_computed: dict[str, int] = {}
        self._tables: dict[str, list[int]] = {}
        # The last proposal's draft distributions (one row per draft) of sampled requests.
        self._draft_probs: dict[str, torch.Tensor] = {}

    def forget(self, req_id: str) -> None:
        """Drop what the draft cache holds for ``req_id`` (finished, preempted or resumed)."""
        self.num_computed.pop(req_id, None)
        self._tables.pop(req_id, None)

    def invalidate_blocks(self, block_ids: Sequence[int]) -> None:
        """Blocks whose target KV was moved or overwritten (swapped, copied): every request
        whose draft KV sits in one of them starts over."""
        moved = set(block_ids)
        for req_id in [r for r, table in self._tables.items() if moved.intersection(table)]:
            self.forget(req_id)

    def take_draft_probs(self) -> dict[str, torch.Tensor]:
        """The draft distributions of the last proposal, by request (``[drafts, vocab]``, only
        for requests whose drafts were sampled), and forget them."""
        probs, self._draft_probs = self._draft_probs, {}
        return probs

    @torch.no_grad()
    def propose(self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                block_ids: Sequence[Sequence[int]], max_drafts: Sequence[int],
                temperatures: Sequence[float] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> list[list[int]]:
        """One list of drafts per request: at most ``max_drafts[i]`` (and
        ``num_speculative_tokens``) for request ``req_ids[i]``, whose tokens so far are
        ``token_ids[i]`` and whose block table is ``block_ids[i]``; fewer where the table or
        ``max_model_len`` leaves no room, none for ``max_drafts[i] <= 0``. Greedy, except for a
        request with a ``temperatures[i] > 0``: sampled at that temperature with
        ``generators[i]`` (see the module docstring).

        upstream: vllm/v1/spec_decode/eagle.py:155 @ v0.11.0
        """
        drafts: dict[str, list[int]] = {r: [] for r in req_ids}
        todo: dict[str, int] = {}  # request -> drafts to make
        self._draft_probs = {}
        sampling = {r: (t, g) for r, t, g in zip(req_ids, temperatures or [],
                                                 generators or [None] * len(req_ids)) if t > 0}
        rows: dict[str, list[torch.Tensor]] = {r: [] for r in sampling}
        tokens_of, tables = {}, {}
        for req_id, tokens, table, limit in zip(req_ids, token_ids, block_ids, max_drafts):
            total = len(tokens)
            capacity = min(len(table) * self.block_size, self.max_model_len)
            # Draft j (0-based) is read off position total - 1 + j; feeding it back writes
            # position total + j, so n drafts write up to position total + n - 2.
            n = min(limit, self.k, capacity - total + 1, self.max_model_len - total)
            if n <= 0 or total < 1:
                continue
            known = self._tables.get(req_id)
            if known is not None and (list(table[:len(known)]) != known
                                      or self.num_computed[req_id] >= total):
                self.forget(req_id)  # new blocks, or fewer tokens: start this request over
            todo[req_id], tokens_of[req_id], tables[req_id] = n, list(tokens), list(table)
        if not todo:
            return [drafts[r] for r in req_ids]
        # Catch up: every token the draft has not seen, the last one's logits giving draft 1.
        computed = {r: self.num_computed.get(r, 0) for r in todo}
        scheduled = {r: len(tokens_of[r]) - computed[r] for r in todo}
        for group in self._disjoint_groups(list(todo), computed, tokens_of, tables):
            reorder_batch_to_split_decodes_and_prefills(group, scheduled)
            inputs = [t for r in group for t in tokens_of[r][computed[r]:]]
            next_tokens = self._step(group, inputs, scheduled, computed, tables, sampling, rows)
            for r, token in zip(group, next_tokens):
                drafts[r].append(token)
                self.num_computed[r] = len(tokens_of[r])
                self._tables[r] = tables[r]
        # Then one position at a time, feeding each draft back in (all rows are decodes, each
        # past its request's tokens: in a block of its own, never a shared prefix block).
        order = list(todo)
        for j in range(1, max(todo.values())):
            live = [r for r in order if todo[r] > j]
            positions = {r: len(tokens_of[r]) - 1 + j for r in live}
            next_tokens = self._step(live, [drafts[r][-1] for r in live],
                                     dict.fromkeys(live, 1), positions, tables, sampling, rows)
            for r, token in zip(live, next_tokens):
                drafts[r].append(token)
        self._draft_probs = {r: torch.stack(q) for r, q in rows.items() if q}
        return [drafts[r] for r in req_ids]

    def _disjoint_groups(self, req_ids: list[str], computed: dict[str, int],
                         tokens_of: dict[str, list[int]],
                         tables: dict[str, list[int]]) -> list[list[str]]:
        """Split the catch-up into passes in which no two requests write the same block: two
        requests sharing a cached prefix block would both write its slots (with the same
        values), and a pass writes each slot once. Almost always one pass."""
        groups: list[tuple[list[str], set[int]]] = []
        for r in req_ids:
            first, last = computed[r] // self.block_size, (len(tokens_of[r]) - 1) // self.block_size
            written = set(tables[r][first:last + 1])
            for members, blocks in groups:
                if not blocks & written:
                    members.append(r)
                    blocks |= written
                    break
            else:
                groups.append(([r], written))
        return [members for members, _ in groups]

    def _step(self, order: list[str], inputs: list[int], scheduled: dict[str, int],
              computed: dict[str, int], tables: dict[str, list[int]],
              sampling: dict[str, tuple[float, torch.Generator | None]],
              rows: dict[str, list[torch.Tensor]]) -> list[int]:
        """One draft forward pass over ``inputs`` (the requests' rows in ``order``); the next
        token after each request's last row: the argmax, or for a request in ``sampling`` a
        draw at its temperature, whose distribution is appended to ``rows``."""
        meta = build_attention_metadata(order, scheduled, computed, tables, self.block_size)
        input_ids = torch.tensor(inputs, dtype=torch.long, device=self.device)
        hidden = self.fast_forward(input_ids, meta) if self.fast_forward is not None else None
        if hidden is None:
            hidden = self.model(input_ids, meta.positions.to(self.device), self.kv_caches, meta,
                                self.attn_backend)
        last_rows = meta.query_start_loc[1:].to(self.device, torch.long) - 1
        logits = self.model.compute_logits(hidden[last_rows])
        tokens = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(order):
            if r in sampling:
                temperature, generator = sampling[r]
                q = (logits[i].double() / temperature).softmax(-1).cpu()
                tokens[i] = int(torch.multinomial(q, 1, generator=generator))
                rows[r].append(q)
        return tokens
