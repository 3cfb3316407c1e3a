"""``python -m mini_vllm generate "PROMPT" ...``: generate text and print the engine statistics;
``python -m mini_vllm serve``: serve the model over HTTP with the OpenAI API.

Examples::

    python -m mini_vllm generate "HAMLET.\\n"
    python -m mini_vllm generate "KING.\\n" "QUEEN.\\n" --max-tokens 200 --temperature 0.8 --seed 1
    python -m mini_vllm generate --model smollm2 --chat "What is the capital of France?"
    python -m mini_vllm generate "Ber.\\n" --model path/to/hf_llama_dir --block-size 32
    python -m mini_vllm generate "HAMLET.\\n" --kv-cache-dtype fp8 --kv-cache-memory 1000000
    python -m mini_vllm generate "KING.\\n" --beam-width 4 --max-tokens 40
    python -m mini_vllm convert-gguf path/to/model.gguf path/to/hf_folder
    python -m mini_vllm serve --port 8000        # then: curl localhost:8000/v1/models
    python -m mini_vllm serve --model smollm2 --served-model-name smollm2

upstream: none (vLLM's command line is `vllm serve`/`vllm bench`; `serve` here takes a subset of
its options, `generate` is a demo of the engine)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# The API name of the shipped model when --model is not given.
DEFAULT_SERVED_NAME = "mini_vllm/tiny_shakespeare"


def _unescape(text: str) -> str:
    # Shells make a real newline awkward to type; accept the two-character "\n" as one.
    return text.replace("\\n", "\n")


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint: a mini_vllm .safetensors, a Hugging Face folder, a "
                        ".gguf file, or 'smollm2' (default: the shipped Shakespeare model)")


WEIGHT_DTYPES = ("auto", "bfloat16", "q4_1", "q8_0")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--threads", type=int, default=None,
        help="PyTorch CPU threads (default: 1 for a small model, else the free cores)")
    add("--block-size", type=int, default=16)
    add("--num-gpu-blocks", type=int, default=None)
    add("--max-num-batched-tokens", type=int, default=512)
    add("--max-num-seqs", type=int, default=64)
    add("--max-model-len", type=int, default=None)
    add("--no-prefix-caching", action="store_true")
    add("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    add("--num-cpu-blocks", type=int, default=0)
    add("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
        help="KV cache storage: the model's dtype (auto) or FP8 e4m3 with per-layer scales "
        "computed from the first prompts (half the bytes of fp16)")
    add("--kv-cache-memory", type=int, default=None,
        help="KV cache budget in bytes (instead of --num-gpu-blocks): the number of blocks is "
        "what fits")
    add("--kv-reservation", choices=("paged", "max", "pow2", "oracle"), default="paged",
        help="paged KV (vLLM) or an Orca-style reservation claimed on admission (lab 03-06)")
    add("--static-batching", action="store_true",
        help="admit new requests only when the running batch is done (lab 03-06's baseline)")
    add("--weight-dtype", choices=WEIGHT_DTYPES, default="auto",
        help="the linear layers' weights: as loaded (auto), bfloat16, or GGUF blocks q4_1 / q8_0 "
        "(a GGUF model's own), widened to float32 as they are read (fewer bytes per decoded "
        "token; activations and KV cache stay float32)")
    add("--enforce-eager", action="store_true",
        help="run every step op by op through the model's modules (by default a CPU decode "
        "step is one compiled call, the CPU's counterpart of a CUDA graph)")
    add("--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding, as vLLM\'s flag: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    add("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="plan each step while the one before it runs (vLLM's flag; default: on for a CUDA "
        "device, off on a CPU, never when speculating)")
    add("--persistent-batch", action="store_true",
        help="keep the runner's batch in rows updated by diffs across steps, as vLLM's runner "
        "does (default: rebuilt each step)")
    add("--attention-backend", choices=("paged", "triton"), default="paged",
        help="paged (default): PagedAttention and chunked-prefill attention; triton: one Triton "
        "kernel for the whole batch (lab 02-07; interpreted on a CPU: slow)")
    add("--tensor-parallel-size", "-tp", type=int, default=1,
        help="split the model and its KV cache over this many processes (vLLM's flag; "
        "`generate` only: the server's engine core runs in a process of its own)")
    add("--device", default="cpu")


def _json_object(text: str) -> dict:
    """argparse type: a JSON object (the error names what was wrong)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for each prompt")
    gen.add_argument("prompts", nargs="+", help='prompt text ("\\n" is a newline)')
    _add_model_arg(gen)
    gen.add_argument("--chat", action="store_true",
                     help="treat each prompt as a user message and apply the chat template")
    gen.add_argument("--system", default=None, help="with --chat: a system message")
    gen.add_argument("--max-tokens", type=int, default=120)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--beam-width", type=int, default=None,
                     help="beam search with this many beams (prints every beam and its score; "
                     "--max-tokens and --temperature apply)")
    gen.add_argument("--length-penalty", type=float, default=1.0,
                     help="with --beam-width: score = cumulative logprob / length ** this")
    gen.add_argument("--stop", action="append", default=None,
                     help="stop string (repeatable); the output ends before it")
    _add_engine_args(gen)
    srv = sub.add_parser("serve", help="serve the model over HTTP (the OpenAI API)")
    _add_model_arg(srv)
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help=f"the model's name in the API (default: --model, or "
                     f"{DEFAULT_SERVED_NAME!r})")
    srv.add_argument("--chat-template", default=None,
                     help="a Jinja chat template file for /v1/chat/completions (default: the "
                     "tokenizer's; the shipped model has none)")
    srv.add_argument("--log-level", default="info",
                     choices=("critical", "error", "warning", "info", "debug"))
    _add_engine_args(srv)
    conv = sub.add_parser("convert-gguf", help="convert a GGUF file to a Hugging Face folder")
    conv.add_argument("source", help="a .gguf file, or 'smollm2'")
    conv.add_argument("out", help="the folder to write")
    args = parser.parse_args(argv)

    try:
        if args.command == "convert-gguf":
            return _convert(args)
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _convert(args: argparse.Namespace) -> int:
    from mini_vllm.model_executor.model_loader.gguf_loader import (
        NAMED_MODELS,
        convert_gguf,
        named_model_file,
    )

    src = named_model_file(args.source) if args.source.lower() in NAMED_MODELS else args.source
    print(f"wrote {convert_gguf(src, args.out)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop,
    )
    llm = _make_llm(args)
    prompts = [_unescape(p) for p in args.prompts]
    if args.beam_width is not None:
        return _beam_search(llm, prompts, args)
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        conversations = [[*system, {"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params)
        shown = prompts
    else:
        outputs = llm.generate(prompts, params)
        shown = [out.prompt or "" for out in outputs]
    for prompt, out in zip(shown, outputs):
        print("=" * 72)
        if args.chat:
            print(f"> {prompt}\n{out.text}")
        else:
            print(f"{prompt}{out.text}")
        print(f"[finish: {out.outputs[0].finish_reason}, {len(out.outputs[0].token_ids)} tokens]")
    print("=" * 72)
    print(llm.last_stats.summary() + f"   threads: {llm.num_threads}")
    return 0


def _make_llm(args: argparse.Namespace) -> Any:
    from mini_vllm.entrypoints.llm import LLM

    return LLM(
        args.model,
        device=args.device,
        num_threads=args.threads,
        weight_dtype=args.weight_dtype,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        num_cpu_blocks=args.num_cpu_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager,
        kv_reservation=args.kv_reservation,
        static_batching=args.static_batching,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
        persistent_batch=args.persistent_batch,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _serve(args: argparse.Namespace) -> int:
    if args.tensor_parallel_size != 1:
        print("error: serve runs its engine core in a process of its own, which cannot start "
              "tensor-parallel workers yet; use `generate -tp N`, or serve with -tp 1",
              file=sys.stderr)
        return 2
    try:
        from mini_vllm.engine.async_llm import AsyncLLM
        from mini_vllm.entrypoints.openai.api_server import run_server
    except ImportError as exc:
        raise ImportError(
            f"serve needs the server's packages ({exc.name} is missing); install them with "
            "pip install -r requirements.txt"
        ) from exc
    template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    engine = AsyncLLM(_make_llm(args), model_name=name)
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
          file=sys.stderr)
    run_server(engine, host=args.host, port=args.port, model_name=name,
               chat_template=template, log_level=args.log_level)
    return 0


def _beam_search(llm, prompts: list[str], args: argparse.Namespace) -> int:
    from mini_vllm.entrypoints.beam_search import get_beam_search_score
    from mini_vllm.sampling_params import BeamSearchParams

    if args.chat or args.stop:
        raise ValueError("--beam-width takes plain prompts: leave out --chat and --stop")
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              temperature=args.temperature, length_penalty=args.length_penalty)
    outputs = llm.beam_search(prompts, params)
    eos = llm.engine.eos_token_id
    for out in outputs:
        print("=" * 72)
        for rank, beam in enumerate(out.sequences, 1):
            score = get_beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)
            print(f"--- beam {rank}: score {score:.4f}, cumulative logprob {beam.cum_logprob:.4f}, "
                  f"{len(beam.logprobs)} tokens")
            print(beam.text)
    print("=" * 72)
    print(llm.last_stats.summary() + f"   threads: {llm.num_threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
