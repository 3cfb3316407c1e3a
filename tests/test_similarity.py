"""The grader's similarity against disguise (course/grading/similarity.py and structure.py).

The submissions are tests/fixtures/similarity/<lab>/*.py: honest implementations of labs 02-01
and 02-03 in different styles, and copies of the reference disguised at three levels (see that
folder's README). A disguised copy is flagged "copy of the reference" with its matching
functions named; honest work is not flagged, against the reference or against each other; the
published starter's own code counts for nothing.
"""

from __future__ import annotations

import ast
import csv
import io
import re
from pathlib import Path

import pytest

from course.grading import similarity, structure
from course.labs.catalog import REPO_ROOT, discover

FIXTURES = Path(__file__).parent / "fixtures" / "similarity"
LABS = {lab.id: lab for lab in discover() if lab.id in ("02-01", "02-03")}
DISGUISED = ("disguised_l1", "disguised_l2", "disguised_l3")
HONEST = ("honest_a", "honest_b", "honest_c")
# A function each disguised copy must be caught on, side by side with the reference's.
EVIDENCE = {"02-01": "BlockPool.free_blocks ~ reference BlockPool.free_blocks",
            "02-03": "KVCacheManager.allocate_slots ~ reference KVCacheManager.allocate_slots"}


def submission(lab_id: str, name: str) -> dict[str, bytes]:
    lab = LABS[lab_id]
    return {f"{lab.rel}/starter.py": (FIXTURES / lab_id / f"{name}.py").read_bytes()}


def against_reference(lab_id: str, name: str) -> similarity.Similarity:
    return similarity.class_similarity({name: submission(lab_id, name)}, [LABS[lab_id]],
                                       REPO_ROOT, peers=False)


@pytest.mark.parametrize("lab_id", sorted(LABS))
@pytest.mark.parametrize("name", DISGUISED)
def test_a_disguised_copy_is_flagged_with_its_functions(lab_id, name):
    sim = against_reference(lab_id, name)
    notes = [note for lab, note in sim.flags[name] if lab == lab_id]
    assert len(notes) == 1 and notes[0].startswith("copy of the reference"), notes
    assert EVIDENCE[lab_id] in notes[0]
    assert not sim.zero, "a disguised copy is flagged, not zeroed"
    assert sim.rows[0]["structure"] >= similarity.COPY


@pytest.mark.parametrize("lab_id", sorted(LABS))
@pytest.mark.parametrize("name", HONEST)
def test_honest_work_is_not_flagged(lab_id, name):
    sim = against_reference(lab_id, name)
    assert sim.flags[name] == [] and not sim.zero
    assert sim.rows[0]["structure"] < similarity.COPY


@pytest.mark.parametrize("lab_id", sorted(LABS))
def test_every_disguised_copy_ranks_above_every_honest_file(lab_id):
    files = {n: submission(lab_id, n) for n in (*DISGUISED, *HONEST)}
    sim = similarity.class_similarity(files, [LABS[lab_id]], REPO_ROOT, peers=False)
    score = {r["student"]: r["structure"] for r in sim.rows}
    assert min(score[n] for n in DISGUISED) > max(score[n] for n in HONEST)
    ranked = [r["student"] for r in csv.DictReader(io.StringIO(sim.to_csv()))]
    assert set(ranked[:len(DISGUISED)]) == set(DISGUISED)  # similarity.csv lists them first


@pytest.mark.parametrize("lab_id", sorted(LABS))
def test_peers_flag_copies_of_each_other_and_not_honest_work(lab_id):
    names = (*HONEST, "disguised_l1", "disguised_l3")
    sim = similarity.class_similarity({n: submission(lab_id, n) for n in names},
                                      [LABS[lab_id]], REPO_ROOT, peers=True)
    for name in HONEST:
        assert name not in sim.peer_flags, sim.peer_flags[name]
    (note,) = [n for lab, n in sim.peer_flags["disguised_l3"] if lab == lab_id]
    assert note.startswith("review starter.py: a copy of disguised_l1's") and "~" in note
    rows = list(csv.DictReader(io.StringIO(sim.to_csv())))
    # The columns before the structural ones are as they were (readers go by name).
    assert list(rows[0])[:7] == ["lab", "file", "student", "own_tokens", "reference",
                                 "closest_student", "closest_similarity"]


def test_the_published_starter_counts_for_nothing():
    lab = LABS["02-01"]
    keep, given, refs = similarity._reference_units(lab, REPO_ROOT)
    published = (REPO_ROOT / lab.rel / "starter.py").read_text()
    assert structure.own(structure.units(published, keep), given) == []
    # A submission's given code (kept as published) is in none of its matches.
    mine = structure.own(structure.units((FIXTURES / "02-01" / "honest_a.py").read_text(),
                                         keep), given)
    names = {u.name for u in mine}
    assert "BlockPool.get_usage" not in names and "KVCacheBlock.__repr__" not in names
    assert "BlockPool.touch" in names
    # Nor do the reference's copies of given code count as something to copy.
    assert "BlockHashToBlockMap.insert" not in {u.name for u in refs}
    # The published starter submitted as is: nothing of its own, no flag.
    sim = similarity.class_similarity({"idle": {f"{lab.rel}/starter.py": published.encode()}},
                                      [lab], REPO_ROOT, peers=False)
    assert sim.flags["idle"] == [] and sim.rows[0]["structure"] == 0.0


def tokens(source: str) -> list[str]:
    keep = structure.vocabulary("class Pool:\n    def get(self):\n        self.items\n")
    (func,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    return structure._Tokens(keep).of_function(func)


@pytest.mark.parametrize("disguised", [
    # locals renamed, a comment and a docstring added, an annotation
    '''def f(pool, n):
    """Docstring."""
    # a new comment
    out: list = []
    for thing in pool.items:
        if thing.size < n:
            out.append(thing.size)
    return out''',
    # the loop as a comprehension
    '''def f(p, limit):
    sizes = [x.size for x in p.items if x.size < limit]
    return sizes''',
])
def test_the_normaliser_undoes_renames_comments_and_comprehensions(disguised):
    original = '''def f(pool, n):
    result = []
    for item in pool.items:
        if n > item.size:
            result.append(item.size)
    return result'''
    assert tokens(disguised) == tokens(original)


@pytest.mark.parametrize("a, b", [
    ("def f(x):\n    x.count = x.count + 1", "def f(y):\n    y.count += 1"),
    ("def f(a):\n    if not a.ok:\n        g(1)\n    else:\n        g(2)",
     "def f(a):\n    if a.ok:\n        g(2)\n    else:\n        g(1)"),
    ("def f(a):\n    if a.ok:\n        return 1\n    else:\n        return 2",
     "def f(a):\n    if a.ok:\n        return 1\n    return 2"),
    ("def f(a, b):\n    return a.ok and not b.ok", "def f(a, b):\n    return not b.ok and a.ok"),
    ("def f(a):\n    p, q = a.x, a.y", "def f(a):\n    p = a.x\n    q = a.y"),
    ("def f(a):\n    for b in a.items:\n        print(b)\n        a._helper(b)",
     "def f(a):\n    [a._other(b) for b in a.items]"),
])
def test_the_normaliser_maps_equivalent_forms_onto_one(a, b):
    assert tokens(a) == tokens(b)


def test_names_of_the_lab_api_stay():
    # `items` is the published starter's attribute: it stays, where a local's name does not.
    assert tokens("def f(p):\n    return p.items") != tokens("def f(p):\n    return p.other")
    assert tokens("def f(p):\n    return p") == tokens("def f(q):\n    return q")


def test_a_pasted_triton_kernel_piece_scores_zero():
    """Lab 02-07's reference keeps its source in a course copy (Triton compiles kernels from
    source text), so pasting it is possible: the lab's pieces taken from
    mini_vllm/attention/triton_unified.py into the starter, locals renamed, score 0."""
    lab = next(lab for lab in discover() if lab.id == "02-07")
    reference = (REPO_ROOT / "mini_vllm/attention/triton_unified.py").read_text(encoding="utf-8")
    lines = reference.splitlines()
    bodies = {node.name: "\n".join(lines[node.body[1].lineno - 1:node.end_lineno])
              for node in ast.parse(reference).body
              if isinstance(node, ast.FunctionDef) and len(node.body) > 1}
    pasted = (lab.path / "starter.py").read_text(encoding="utf-8")
    for name in ("load_q_tile", "load_kv_tile", "visible", "softmax_step", "reduce_segments",
                 "in_window", "first_tile"):
        body = bodies[name].replace("dims", "cols").replace("rows", "lanes")
        task = re.compile(r"    raise NotImplementedError\(\n[^\n]*implement " + name + " .*\n")
        pasted, n = task.subn(lambda _, body=body: body + "\n", pasted)
        assert n == 1, f"the 02-07 starter's {name} body was not found"
    sim = similarity.class_similarity({"paster": {f"{lab.rel}/starter.py": pasted.encode()}},
                                      [lab], REPO_ROOT, peers=False)
    assert sim.zero == {"paster": {"02-07"}}, sim.rows
