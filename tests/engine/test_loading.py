"""Loading real checkpoints: folders written by ``transformers``' own ``save_pretrained``.

Each case builds a small random Llama or Qwen2 with ``transformers`` (with and without biases,
tied and untied embeddings), saves it the way Hugging Face checkpoints are published, loads it
with ``mini_vllm.model_executor.model_loader.hf_loader`` and compares the logits with
``transformers``' forward on CPU. Then the loader is fed what it must refuse: unknown and missing
tensors, a stale shard, a missing config field, a corrupt file, non-finite weights.
``transformers`` is a test dependency (pinned in requirements.txt); these tests take a few seconds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from course.labs.numerics import assert_close
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.hf_loader import config_from_hf, load_checkpoint
from mini_vllm.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-6, initializer_range=0.3)
IDS = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 12]

CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-biases-tied": ("llama", dict(attention_bias=True, mlp_bias=True,
                                        tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
}


def hf_model(kind: str, seed: int = 0):
    model_type, extra = CASES[kind]
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[model_type]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**SHAPE, **extra)).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(str(path), **kwargs)
    return path


def hf_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", list(CASES))
def test_save_pretrained_checkpoints_load_and_match_transformers(kind, tmp_path):
    src = hf_model(kind)
    model = load_checkpoint(save(src, tmp_path / kind))
    cfg = model.config
    assert cfg.tie_word_embeddings == src.config.tie_word_embeddings
    assert cfg.attention_bias == (kind.startswith("qwen2") or "biases" in kind)
    assert cfg.mlp_bias == ("biases" in kind)
    assert_close(model.forward_reference(torch.tensor(IDS)), hf_logits(src),
                 msg=f"{kind}: mini_vllm vs transformers logits")


def test_sharded_checkpoints_follow_the_index_and_ignore_stale_files(tmp_path):
    src = hf_model("llama-biases")
    folder = save(src, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "the checkpoint was meant to be sharded"
    # A stale file left over from an older save: same names, wrong values. The index does not
    # name it, so it must not be read.
    from safetensors.torch import save_file

    stale = {k: torch.full_like(v, 7.0).contiguous() for k, v in src.state_dict().items()}
    save_file(stale, str(folder / "model-stale.safetensors"))
    model = load_checkpoint(folder)
    assert_close(model.forward_reference(torch.tensor(IDS)), hf_logits(src))
    # An index naming a file that is gone is an error naming it.
    (folder / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_checkpoint(folder)


def test_several_files_without_an_index_are_refused(tmp_path):
    folder = save(hf_model("llama"), tmp_path / "m", max_shard_size="40KB")
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="no model.safetensors.index.json"):
        load_checkpoint(folder)


def test_greedy_generation_through_the_engine_equals_transformers(tmp_path):
    src = hf_model("qwen2-tied", seed=3)
    llm = LLM(save(src, tmp_path / "q"), block_size=4, num_gpu_blocks=32)
    assert llm.tokenizer is None, "no tokenizer.json: token-id prompts only"
    out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    with torch.no_grad():
        want = src.generate(torch.tensor([IDS]), max_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(IDS):].tolist()
    assert out[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


# ----------------------------------------------------------------------------- refusals


def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_unknown_and_missing_tensors_are_refused_by_name(tmp_path):
    folder = save(hf_model("llama-biases"), tmp_path / "m")
    weights = folder / "model.safetensors"
    _rewrite(weights, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight":
                                          torch.ones(8)}))
    with pytest.raises(ValueError, match=r"does not use.*q_norm") as err:
        load_checkpoint(folder)
    assert "model.safetensors" in str(err.value)
    _rewrite(weights, lambda t: (t.pop("model.layers.0.self_attn.q_norm.weight"),
                                 t.pop("model.layers.1.mlp.down_proj.bias")))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.mlp\.down_proj\.bias"):
        load_checkpoint(folder)


def test_biases_the_config_does_not_declare_are_refused(tmp_path):
    """The old loader silently dropped them and generated wrong tokens."""
    folder = save(hf_model("llama-biases"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "attention_bias": False,
                                                    "mlp_bias": False}))
    with pytest.raises(ValueError, match=r"does not use.*\.bias"):
        load_checkpoint(folder)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size",
                                   "max_position_embeddings", "model_type"])
def test_required_config_fields_are_required(tmp_path, field):
    folder = save(hf_model("llama"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[field]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json") as err:
        load_checkpoint(folder)
    assert field in str(err.value)


def test_features_the_model_lacks_are_refused(tmp_path):
    cfg = hf_model("llama").config.to_dict()
    for change, match in (
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope scaling"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 16}, "head_dim"),
    ):
        with pytest.raises(ValueError, match=match):
            config_from_hf({**cfg, **change}, "x/config.json")


def test_corrupt_and_non_finite_files_are_refused_naming_the_file(tmp_path):
    folder = save(hf_model("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    # Flip bytes in the middle of the data: as float32, 0xFFFFFFFF is a NaN.
    start = 8 + header_len + (len(data) - 8 - header_len) // 2
    data[start : start + 64] = b"\xff" * 64
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"NaN or infinite") as err:
        load_checkpoint(folder)
    assert str(weights) in str(err.value)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="not a readable safetensors file") as err:
        load_checkpoint(folder)
    assert str(weights) in str(err.value)
    (folder / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json: not a readable JSON"):
        load_checkpoint(folder)


def test_cli_shows_loading_errors_as_one_line(tmp_path, capsys):
    from mini_vllm.__main__ import main

    folder = save(hf_model("llama"), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"garbage")
    capsys.readouterr()  # transformers' progress bars
    assert main(["generate", "x", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.safetensors" in err and "Traceback" not in err
