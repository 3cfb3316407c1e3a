"""The child process of ``python -m course engine``: compose one engine, run it, report as JSON.

Composition patches the process it runs in (:mod:`course.compose`), so every engine the command
compares (the student's, the reference, one lab at a time while bisecting) gets a fresh process.
The parent passes a JSON job on the command line and reads one JSON object per line from the
output file as the work goes, so a case that hangs or crashes the process still leaves the results
before it.

Job fields: ``labs`` (lab ids whose pieces are the student's), ``mode`` ("generate" or "exam"),
``gpu``; for generate ``prompts`` and ``max_tokens``; for the exam ``cases`` (names, or null for
all), ``sweep`` and ``timeout`` (seconds per case).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def run_generate(job: dict, out) -> None:
    from mini_vllm.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    _emit(out, {
        "type": "generate",
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "stats": llm.last_stats.summary(),
    })


def run_exam(job: dict, out, do_compose) -> None:
    """Run the exam's cases on the composed engine. When some pieces are the student's, the
    same cases run on the reference engine first (before composing), for its statistics."""
    from course.exam import Exam, cases, run_case

    wanted = job.get("cases")
    all_cases = cases(job["sweep"])
    if wanted:
        unknown = sorted(set(wanted) - {c.name for c in all_cases})
        if unknown:
            raise ValueError(
                f"no exam case named {', '.join(unknown)}; `python -m course engine --exam "
                "--list` shows them"
            )
        all_cases = [c for c in all_cases if c.name in wanted]
    stats = None
    if job["labs"]:
        # The reference engine's numbers for the same cases, before anything is composed.
        reference = Exam()
        stats = {}
        for case in all_cases:
            result = run_case(case, reference, job["timeout"])
            stats[case.name] = reference.recorded
            if result.outcome != "passed":
                raise RuntimeError(f"the reference engine fails case {case.name}: "
                                   f"{result.message}")
    do_compose()
    exam = Exam(stats)
    for case in all_cases:
        _emit(out, {"type": "case", **run_case(case, exam, job["timeout"]).as_dict()})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(argv[0])
    out_path = Path(job["out"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from course.compose import CompositionError, compose

    labs = job["labs"]
    with out_path.open("a", encoding="utf-8") as out:
        def do_compose():
            composition = compose(labs, gpu=job.get("gpu", False))
            _emit(out, {"type": "composition", "rows": composition.lab_rows()})

        try:
            if job["mode"] == "exam":
                run_exam(job, out, do_compose)
            else:
                do_compose()
                run_generate(job, out)
        except CompositionError as exc:
            _emit(out, {"type": "error", "message": str(exc)})
            return 2
        except KeyboardInterrupt:
            _emit(out, {"type": "error", "message": "interrupted"})
            return 2
        except Exception as exc:  # the student's engine crashed outside a case
            from course.exam import _where

            _emit(out, {"type": "error",
                        "message": f"{type(exc).__name__}: {exc} (at {_where(exc)})"})
            return 1
        _emit(out, {"type": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
