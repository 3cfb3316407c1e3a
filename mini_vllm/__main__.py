"""``python -m mini_vllm generate "PROMPT" ...``: generate text and print the engine statistics.

Examples::

    python -m mini_vllm generate "HAMLET.\\n"
    python -m mini_vllm generate "KING.\\n" "QUEEN.\\n" --max-tokens 200 --temperature 0.8 --seed 1
    python -m mini_vllm generate --model smollm2 --chat "What is the capital of France?"
    python -m mini_vllm generate "Ber.\\n" --model path/to/hf_llama_dir --block-size 32
    python -m mini_vllm generate "HAMLET.\\n" --kv-cache-dtype fp8 --kv-cache-memory 1000000
    python -m mini_vllm generate "KING.\\n" --beam-width 4 --max-tokens 40
    python -m mini_vllm convert-gguf path/to/model.gguf path/to/hf_folder

upstream: none (vLLM's command line is `vllm serve`/`vllm bench`; this is a demo of the engine)
"""

from __future__ import annotations

import argparse
import sys


def _unescape(text: str) -> str:
    # Shells make a real newline awkward to type; accept the two-character "\n" as one.
    return text.replace("\\n", "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for each prompt")
    gen.add_argument("prompts", nargs="+", help='prompt text ("\\n" is a newline)')
    gen.add_argument("--model", default=None,
                     help="checkpoint: a mini_vllm .safetensors, a Hugging Face folder, a .gguf "
                     "file, or 'smollm2' (default: the shipped Shakespeare model)")
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
    gen.add_argument("--threads", type=int, default=None,
                     help="PyTorch CPU threads (default: 1 for a small model, else the free "
                     "cores)")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--num-gpu-blocks", type=int, default=None)
    gen.add_argument("--max-num-batched-tokens", type=int, default=512)
    gen.add_argument("--max-num-seqs", type=int, default=64)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--no-prefix-caching", action="store_true")
    gen.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    gen.add_argument("--num-cpu-blocks", type=int, default=0)
    gen.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                     help="KV cache storage: the model's dtype (auto) or FP8 e4m3 with per-layer "
                     "scales computed from the first prompts (half the bytes of fp16)")
    gen.add_argument("--kv-cache-memory", type=int, default=None,
                     help="KV cache budget in bytes (instead of --num-gpu-blocks): the number "
                     "of blocks is what fits")
    gen.add_argument("--device", default="cpu")
    conv = sub.add_parser("convert-gguf", help="convert a GGUF file to a Hugging Face folder")
    conv.add_argument("source", help="a .gguf file, or 'smollm2'")
    conv.add_argument("out", help="the folder to write")
    args = parser.parse_args(argv)

    try:
        if args.command == "convert-gguf":
            return _convert(args)
        return _generate(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _convert(args: argparse.Namespace) -> int:
    from mini_vllm.gguf_loader import NAMED_MODELS, convert_gguf, named_model_file

    src = named_model_file(args.source) if args.source.lower() in NAMED_MODELS else args.source
    print(f"wrote {convert_gguf(src, args.out)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from mini_vllm.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop,
    )
    llm = LLM(
        args.model,
        device=args.device,
        num_threads=args.threads,
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
    )
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


def _beam_search(llm, prompts: list[str], args: argparse.Namespace) -> int:
    from mini_vllm.beam_search import get_beam_search_score
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
