"""``python -m mini_vllm generate "PROMPT" ...``: generate text and print the engine statistics.

Examples::

    python -m mini_vllm generate "HAMLET.\n"
    python -m mini_vllm generate "KING.\n" "QUEEN.\n" --max-tokens 200 --temperature 0.8 --seed 1
    python -m mini_vllm generate "Ber.\n" --model path/to/hf_llama_dir --block-size 32

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
    gen.add_argument("--model", default=None, help="checkpoint path (default: the shipped one)")
    gen.add_argument("--max-tokens", type=int, default=120)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--num-gpu-blocks", type=int, default=None)
    gen.add_argument("--max-num-batched-tokens", type=int, default=512)
    gen.add_argument("--max-num-seqs", type=int, default=64)
    gen.add_argument("--no-prefix-caching", action="store_true")
    gen.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    gen.add_argument("--num-cpu-blocks", type=int, default=0)
    gen.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from mini_vllm.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            max_tokens=args.max_tokens,
        )
        llm = LLM(
            args.model,
            device=args.device,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=not args.no_prefix_caching,
            preemption_mode=args.preemption_mode,
            num_cpu_blocks=args.num_cpu_blocks,
        )
        outputs = llm.generate([_unescape(p) for p in args.prompts], params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        print("=" * 72)
        print(f"{out.prompt}{out.text}")
        print(f"[finish: {out.outputs[0].finish_reason}, {len(out.outputs[0].token_ids)} tokens]")
    print("=" * 72)
    print(llm.last_stats.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
