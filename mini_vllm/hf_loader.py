"""Load weights into :class:`mini_vllm.model.LlamaForCausalLM` from local safetensors files.

Two layouts, both local (nothing is ever downloaded):

* mini_vllm's own: ``<name>.safetensors`` with ``<name>.json`` beside it (``{"model": {...}}``,
  the fields of :class:`~mini_vllm.model.ModelConfig`), as written by
  ``scripts/train_tiny_model.py``;
* a Hugging Face directory of a Llama or Qwen2 model: ``config.json`` plus one or more
  ``*.safetensors`` files. Parameter names already match (the model mirrors the HF layout), so
  loading is a name check and a copy. Only what this model implements is accepted: SiLU MLP,
  plain RoPE (no ``rope_scaling``), ``head_dim == hidden_size / num_attention_heads``.

A tokenizer is not loaded; pass one to ``LLM(tokenizer=...)`` (anything with ``encode``,
``decode`` and ``eos_token_id``) when the vocabulary is not byte-level.

upstream: vllm/model_executor/model_loader/default_loader.py:30 @ v0.11.0
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mini_vllm.model import LlamaForCausalLM, ModelConfig

__all__ = ["config_from_hf", "load_checkpoint"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict, refusing features this model lacks.

    upstream: none (vLLM reads the config through transformers' AutoConfig)
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; mini_vllm loads {SUPPORTED_MODEL_TYPES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' (SwiGLU)")
    if hf.get("rope_scaling"):
        raise ValueError("rope_scaling is not supported by mini_vllm's RotaryEmbedding")
    data = dict(hf)
    data.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    # Qwen2 always has q/k/v biases; Llama has them only when attention_bias is set.
    data["attention_bias"] = model_type == "qwen2" or bool(hf.get("attention_bias", False))
    config = ModelConfig.from_dict(data)
    if hf.get("head_dim") not in (None, config.head_dim):
        raise ValueError(
            f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads ({config.head_dim})"
        )
    return config


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def _resolve(path: Path) -> tuple[ModelConfig, list[Path]]:
    if path.is_dir():
        cfg_file = path / "config.json"
        files = sorted(path.glob("*.safetensors"))
        if not cfg_file.exists() or not files:
            raise FileNotFoundError(
                f"{path} is not a Hugging Face checkpoint directory: it needs config.json and "
                "*.safetensors files (PyTorch .bin files are not supported)"
            )
        return config_from_hf(json.loads(cfg_file.read_text())), files
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    weights, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    if not weights.exists() or not meta.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}: expected {weights.name} and {meta.name} side by side, "
            "or a Hugging Face directory"
        )
    data = json.loads(meta.read_text())
    return ModelConfig.from_dict(data.get("model", data)), [weights]


def load_checkpoint(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LlamaForCausalLM:
    """Build the model described at ``path`` and load its weights (eval mode, no grad).

    Every parameter of the model must be present (a missing or misshapen tensor is an error
    naming it); extra tensors are ignored, except that a tied ``lm_head`` needs none.

    upstream: vllm/model_executor/model_loader/default_loader.py:30 @ v0.11.0
    """
    config, files = _resolve(Path(path))
    weights = _read_safetensors(files)
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    missing = [k for k in state if k not in weights
               and not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, tensor in state.items():
        if name not in weights:
            continue
        if weights[name].shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(weights[name].shape)}, the model "
                f"expects {tuple(tensor.shape)}; does config.json match the weights?"
            )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in weights:
                param.copy_(weights[name].to(param.dtype))
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval().requires_grad_(False)
