"""Load weights into :class:`mini_vllm.model_executor.models.llama.LlamaForCausalLM` from local
safetensors files.

Two layouts, both local (nothing is ever downloaded):

* mini_vllm's own: ``<name>.safetensors`` with ``<name>.json`` beside it (``{"model": {...}}``,
  the fields of :class:`~mini_vllm.model_executor.models.llama.ModelConfig`), as written by
  ``scripts/train_tiny_model.py``;
* a Hugging Face directory of a Llama or Qwen2 model: ``config.json`` plus either one
  ``*.safetensors`` file or the files that ``model.safetensors.index.json`` names. Parameter
  names already match (the model mirrors the HF layout), so loading is a name check and a copy.

The loader refuses rather than guesses. Every tensor the model needs must be there, and every
tensor in the checkpoint must be one the model uses (both errors list the names); a tensor's
shape must match; a weight with a NaN or an infinity is refused; a config field that decides a
shape is required (a missing one is an error, never filled in); features this model lacks
(another activation, rope scaling, sliding windows, a head size other than hidden / heads) are
refused. Every error names the file it is about.

upstream: vllm/model_executor/model_loader/default_loader.py:30 @ v0.11.0
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig

__all__ = ["config_from_hf", "load_checkpoint", "read_generation_config"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# Fields that decide a tensor shape or the context length: a config without one is refused.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "intermediate_size", "max_position_embeddings")
# Tensors some checkpoints carry that hold nothing to load (the rotary table is recomputed).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict, refusing features this model lacks.

    Required: ``model_type`` and the :data:`REQUIRED_FIELDS`. Optional, with the defaults of
    ``transformers``' own config classes: ``num_key_value_heads`` (= heads), ``rope_theta``
    (10000; or ``rope_parameters["rope_theta"]`` as transformers 5 writes it), ``rms_norm_eps``
    (1e-6), ``tie_word_embeddings``, ``attention_bias`` and ``mlp_bias`` (False). Qwen2 always has
    q/k/v biases and no other; Llama's ``attention_bias`` also biases ``o_proj``.

    upstream: none (vLLM reads the config through transformers' AutoConfig)
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; mini_vllm loads "
            f"{SUPPORTED_MODEL_TYPES}"
        )
    missing = [k for k in REQUIRED_FIELDS if hf.get(k) is None]
    if missing:
        raise ValueError(f"{source}: required field(s) missing: {', '.join(missing)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}; only 'silu'")
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope scaling is not supported by mini_vllm's RotaryEmbedding")
    if hf.get("use_sliding_window") or any(
        t != "full_attention" for t in hf.get("layer_types") or ()
    ):
        raise ValueError(f"{source}: sliding-window attention is not supported; full only")
    qwen2 = model_type == "qwen2"
    attention_bias = bool(hf.get("attention_bias", False))
    try:
        config = ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or attention_bias,
            o_proj_bias=not qwen2 and attention_bias,
            mlp_bias=not qwen2 and bool(hf.get("mlp_bias", False)),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc
    if hf.get("head_dim") not in (None, config.head_dim):
        raise ValueError(
            f"{source}: head_dim {hf['head_dim']} != hidden_size / num_attention_heads "
            f"({config.head_dim}); mini_vllm's attention needs them equal"
        )
    return config


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """``generation_config.json`` of a Hugging Face directory (``{}`` when there is none).

    upstream: vllm/transformers_utils/config.py:950 @ v0.11.0
    """
    file = Path(path) / "generation_config.json"
    return _read_json(file) if Path(path).is_dir() and file.exists() else {}


def _weight_files(path: Path) -> dict[Path, set[str] | None]:
    """Which files to open, and which tensor names to take from each (``None``: all of them).

    With an index, exactly the files it names, and from each only the tensors it maps there (a
    stale tensor in another file, or a stale file, is never read). Without one, the directory
    must hold exactly one ``*.safetensors`` file.
    """
    index = path / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files: dict[Path, set[str] | None] = {}
        for name, filename in weight_map.items():
            files.setdefault(path / filename, set()).add(name)  # type: ignore[union-attr]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} names file(s) that do not exist: {absent}")
        return files
    found = sorted(path.glob("*.safetensors"))
    if len(found) > 1:
        raise ValueError(
            f"{path}: {len(found)} .safetensors files ({', '.join(f.name for f in found)}) and "
            f"no {INDEX_FILE} to say which tensor comes from which; keep one file or add the index"
        )
    return {found[0]: None} if found else {}


def _read_safetensors(files: dict[Path, set[str] | None]) -> dict[str, tuple[torch.Tensor, Path]]:
    """Every tensor to load, with the file it came from (for error messages)."""
    from safetensors import safe_open

    weights: dict[str, tuple[torch.Tensor, Path]] = {}
    for file, wanted in files.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                if wanted is not None:
                    lacking = sorted(wanted - set(names))
                    if lacking:
                        raise ValueError(
                            f"{file}: the index maps {len(lacking)} tensor(s) here that the file "
                            f"does not hold: {lacking[:5]}"
                        )
                    names = [n for n in names if n in wanted]
                for name in names:
                    weights[name] = (f.get_tensor(name), file)
        except ValueError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
    return weights


def _resolve(path: Path) -> tuple[ModelConfig, dict[Path, set[str] | None]]:
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: no config.json")
        files = _weight_files(path)
        if not files:
            raise FileNotFoundError(
                f"{path} has no *.safetensors weights (PyTorch .bin files are not supported)"
            )
        return config_from_hf(_read_json(cfg_file), str(cfg_file)), files
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    weights, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    if not weights.exists() or not meta.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}: expected {weights.name} and {meta.name} side by side, "
            "or a Hugging Face directory"
        )
    data = _read_json(meta)
    fields = data.get("model", data)
    missing = [k for k in REQUIRED_FIELDS if k not in fields]
    if missing:
        raise ValueError(f"{meta}: required field(s) missing from 'model': {', '.join(missing)}")
    try:
        config = ModelConfig.from_dict(fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{meta}: {exc}") from exc
    return config, {weights: None}


def load_checkpoint(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LlamaForCausalLM:
    """Build the model described at ``path`` and load its weights (eval mode, no grad).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for everything wrong
    inside one (see the module docstring); either names the file.

    upstream: vllm/model_executor/model_loader/default_loader.py:30 @ v0.11.0
    """
    path = Path(path)
    config, files = _resolve(path)
    weights = _read_safetensors(files)
    return build_model(config, weights, source=str(path), device=device, dtype=dtype)


@contextlib.contextmanager
def _skip_random_init() -> Iterator[None]:
    """Build modules without drawing random initial weights (they are overwritten at once; for a
    135M-parameter model the draws take seconds)."""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in ("kaiming_uniform_", "uniform_", "normal_")}
    try:
        for name in saved:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def build_model(
    config: ModelConfig, weights: dict[str, tuple[torch.Tensor, Path | str]], *, source: str,
    device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """A model of ``config`` with ``weights`` (name -> (tensor, file)), every check applied.

    upstream: vllm/model_executor/models/llama.py:419 @ v0.11.0
    """
    with _skip_random_init():
        model = LlamaForCausalLM(config)
    state = model.state_dict()
    tied = config.tie_word_embeddings
    needed = [k for k in state if not (tied and k == "lm_head.weight")]
    missing = [k for k in needed if k not in weights]
    if missing:
        raise ValueError(
            f"{source}: the checkpoint lacks {len(missing)} tensor(s) the model needs: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''} (does config.json match, e.g. "
            "its bias and tie_word_embeddings settings?)"
        )
    unknown = [k for k in weights if k not in state and not k.endswith(IGNORED_SUFFIXES)]
    if unknown:
        raise ValueError(
            f"{source}: the checkpoint has {len(unknown)} tensor(s) this model does not use: "
            f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''} (from {weights[unknown[0]][1]}); "
            "a bias the config does not declare, or another architecture?"
        )
    with torch.no_grad():
        for name in needed:
            tensor, file = weights[name]
            if tensor.shape != state[name].shape:
                raise ValueError(
                    f"{file}: tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(state[name].shape)}; does config.json match the weights?"
                )
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"{file}: tensor {name} is {tensor.dtype}, not a float tensor")
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ValueError(
                    f"{file}: tensor {name} has {bad} NaN or infinite value(s); the file is "
                    "corrupt or the weights diverged"
                )
        params = dict(model.named_parameters())
        for name in needed:
            params[name].copy_(weights[name][0].to(params[name].dtype))
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval().requires_grad_(False)
