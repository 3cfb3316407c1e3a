"""Resolve what ``LLM(model=..., tokenizer=...)`` names into a model and its tokenizer.

``None`` is the tiny Shakespeare model shipped in ``mini_vllm/checkpoints/``; a path is a
mini_vllm or Hugging Face safetensors checkpoint (:mod:`.hf_loader`) or a GGUF file
(:mod:`.gguf_loader`); a ``LlamaForCausalLM`` is taken as it is.

upstream: vllm/model_executor/model_loader/__init__.py (``get_model``)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mini_vllm.model_executor.models.llama import LlamaForCausalLM
from mini_vllm.tokenizers.tokenizer import ByteTokenizer

__all__ = ["DEFAULT_CHECKPOINT", "WEIGHT_DTYPES", "check_weight_dtype", "load_default_model",
           "load_draft_model", "store_weights"]


DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny_shakespeare"
# The shipped model's draft (lab 04-04): the same recipe, 2 layers of width 64.
DRAFT_CHECKPOINT = DEFAULT_CHECKPOINT.with_name("tiny_shakespeare_draft")


def load_default_model(device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The tiny Shakespeare model shipped in ``mini_vllm/checkpoints/``.

    upstream: none (course-only: the model this course trains and ships)
    """
    from mini_vllm.model_executor.model_loader.hf_loader import load_checkpoint

    return load_checkpoint(DEFAULT_CHECKPOINT, device=device)


def check_weight_dtype(weight_dtype: str, device: object) -> None:
    """``ValueError`` for a ``weight_dtype`` that is not one of :data:`WEIGHT_DTYPES`, or a
    quantized one (its kernel is C) on a device other than the CPU.

    upstream: none (vLLM's ``dtype`` casts the whole model; these weight-only formats are
    mini_vllm's, run by its C kernels)
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"LLM: weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got "
                         f"{weight_dtype!r}")
    if isinstance(WEIGHT_DTYPES[weight_dtype], str) and str(device).split(":")[0] != "cpu":
        raise ValueError(f"LLM: weight_dtype={weight_dtype!r} runs on the CPU only (its "
                         "kernel is C); use device='cpu', or weight_dtype='bfloat16'")


def load_draft_model(speculative_config: Any,
                     target: LlamaForCausalLM) -> LlamaForCausalLM | None:
    """The draft model a ``SpeculativeConfig`` with ``method="draft_model"`` names, on the
    target's device (``None`` for no config or another method): its ``model`` loaded as
    ``LLM(model=...)`` loads one (the name ``"tiny_shakespeare_draft"`` is the shipped draft),
    or the target's first ``num_draft_layers`` layers. ``ValueError`` when the draft cannot
    stand in for the target: another vocabulary, or not fewer layers than the target.

    upstream: vllm/v1/spec_decode/eagle.py:809 @ v0.11.0 (the proposer loads its draft; today
    in ``llm_base_proposer.py``, and ``draft_model.py`` loads a plain draft model)
    """
    if speculative_config is None or speculative_config.method != "draft_model":
        return None
    device = next(target.parameters()).device
    n_layers = speculative_config.num_draft_layers
    if n_layers is not None:
        if n_layers >= target.config.num_hidden_layers:
            raise ValueError(
                f"speculative_config: num_draft_layers={n_layers}, but the target has "
                f"{target.config.num_hidden_layers} layers; a self-speculative draft must be "
                "shallower than the target")
        return target.first_layers(n_layers)
    source = speculative_config.model
    if isinstance(source, str) and source == DRAFT_CHECKPOINT.name:
        source = DRAFT_CHECKPOINT
    draft = _load_model(source, None, device).model.eval()
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model has a vocabulary of {draft.config.vocab_size} "
            f"tokens, the target {target.config.vocab_size}; a draft must share the target's "
            "tokenizer (see SpeculativeConfig.num_draft_layers for a draft made of the target)")
    return draft


@dataclass
class _LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any
    # EOS ids beyond the tokenizer's (generation_config.json may list several): stop tokens.
    extra_eos_token_ids: list[int]
    # The path the model was read from (None: a model object or the shipped one).
    path: Path | None = None


def _load_model(model: object, tokenizer: object, device: torch.device) -> _LoadedModel:
    """Resolve ``LLM(model=..., tokenizer=...)`` into a model and the tokenizer that goes with
    it."""
    from mini_vllm.model_executor.model_loader import gguf_loader
    from mini_vllm.model_executor.model_loader.hf_loader import (
        load_checkpoint,
        read_generation_config,
    )
    from mini_vllm.tokenizers.tokenizer import load_tokenizer

    extra_eos: list[int] = []
    tok: Any = None
    path: Path | None = None
    if model is None:
        model, tok = load_default_model(device), ByteTokenizer()
    elif isinstance(model, (str, Path)):
        path = gguf_loader.resolve_model_name(model)
        if path.suffix == ".gguf":
            loaded = gguf_loader.load_gguf(path, device=device)
            model, tok, extra_eos = loaded.model, loaded.tokenizer, loaded.extra_eos_token_ids
        else:
            model = load_checkpoint(path, device=device)
            tok = load_tokenizer(path)
            if tok is None and model.config.vocab_size == ByteTokenizer.vocab_size:
                tok = ByteTokenizer()  # mini_vllm's own checkpoints are byte-level
            gen_eos = read_generation_config(path).get("eos_token_id")
            gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
            if tok is not None and tok.eos_token_id is None and gen_eos:
                tok.eos_token_id = gen_eos[0]
            primary = getattr(tok, "eos_token_id", None)
            extra_eos = [t for t in gen_eos if isinstance(t, int) and t != primary]
    elif not isinstance(model, LlamaForCausalLM):
        raise TypeError(
            "LLM: model must be a mini_vllm.model_executor.models.llama.LlamaForCausalLM, a "
            f"checkpoint path, or None for the shipped model; got {type(model).__name__}"
        )
    elif model.config.vocab_size == ByteTokenizer.vocab_size:
        tok = ByteTokenizer()
    if tokenizer is not None:
        if not (callable(getattr(tokenizer, "encode", None))
                and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(
                f"LLM: tokenizer must have encode() and decode(); got {type(tokenizer).__name__}"
            )
        tok = tokenizer
    vocab = model.config.vocab_size
    for tid in [getattr(tok, "eos_token_id", None), *extra_eos]:
        if tid is not None and not 0 <= tid < vocab:
            raise ValueError(f"LLM: EOS token id {tid} is outside the model's vocab [0, {vocab})")
    return _LoadedModel(model, tok, extra_eos, path)


# LLM(weight_dtype=...): the linear layers' storage, a dtype (None: as loaded) or a GGUF block
# format (the kernels' name for it).
WEIGHT_DTYPES: dict[str, torch.dtype | str | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "q4_1": "q4_1", "q8_0": "q8_0"}


def store_weights(model: LlamaForCausalLM, weight_dtype: str, path: Path | None) -> None:
    """Store ``model``'s linear layers as ``LLM(weight_dtype=...)`` asks (a key of
    :data:`WEIGHT_DTYPES`, checked by the caller): as loaded, in bf16, or as GGUF blocks (the
    file's own when ``path`` is the GGUF file or a folder converted from one).

    upstream: none (vLLM stores weights as its quantization config says, while it loads them)
    """
    storage = WEIGHT_DTYPES[weight_dtype]
    if isinstance(storage, str):
        from mini_vllm.model_executor.model_loader.gguf_loader import gguf_source, linear_blocks

        source = gguf_source(path) if path is not None else None
        try:
            blocks = linear_blocks(model, storage, source)
        except ValueError as exc:
            raise ValueError(f"LLM: weight_dtype={weight_dtype!r}: {exc}") from exc
        model.quantize_weights(blocks)
    elif storage is not None:
        model.set_weight_dtype(storage)
