"""How close each submitted starter file is to the reference and to the class's other files.

Two measures, each for what it does best:

* copydetect fingerprints the text the way MOSS does (tokens with names and strings normalised,
  k-grams, winnowing). The published starter's fingerprints are boilerplate, so the signatures,
  docstrings and helpers every student receives do not count: what is compared is what the
  student wrote. Its similarity is the share of the student's own fingerprinted code that also
  occurs in the other file. It finds a pasted reference, and is blind to a disguised one: with
  locals renamed, methods reordered, comments added and loops turned into comprehensions, a copy
  of labs 02-01 and 02-03 measured 55-69%, inside the range of honest work.
* ``structure`` (course/grading/structure.py) compares function by function on normalised
  syntax trees, where those disguises cancel out. Its score is the size-weighted mean similarity
  of the student's own functions to their best counterparts; on this course's fixtures
  (tests/fixtures/similarity, measured by benchmarks/similarity_separation.py) disguised copies
  of the reference score 0.79-0.99 and honest work 0.21-0.55.

What follows from them:

* copydetect ZERO or more against the reference, with at least MIN_TOKENS of the student's own
  code: the lab scores 0 ("similarity"; ``--reference-zero`` sets it, 1.01 switches it off).
  Pasting the shipped reference is not implementing it, and a paste is a fact anyone can see.
* structure COPY or more against the reference, with at least MIN_STRUCTURE tokens of the
  student's own code: the flag "copy of the reference", with the matching functions side by
  side. It flags and does not zero. The reference is a faithful port of upstream vLLM, which
  the labs send students to read (the hint ladder's last level), so honest code that follows
  upstream closely converges on it function by function; and the normalisation erases on
  purpose what tells two authors apart. A high score is strong evidence for a person to weigh
  (the flag names the functions to open side by side), not proof for a rule to act on alone.
* structure COPY or more against another student's file: a flag for review (peer flags never
  change a score). copydetect's 50% no longer flags: honest work measured 52-73% against the
  reference, so its flag was on every report and hid the copies.
"""

from __future__ import annotations

import ast
import csv
import io
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import course.grading.structure as structure

ZERO = 0.9
MIN_TOKENS = 400  # filtered characters of the student's own code, for a zero
K, WINDOW = 25, 1
COPY = 0.7  # structure score of a copy; fixtures: honest work at most 0.55, disguised 0.79
MIN_STRUCTURE = 150  # structure tokens of the student's own code: below, answers look alike
PEER_PREFILTER = 0.4  # whole-file k-gram similarity below which two students are not compared


@dataclass
class Similarity:
    rows: list[dict] = field(default_factory=list)
    flags: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # vs the reference
    peer_flags: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # vs the class
    zero: dict[str, set[str]] = field(default_factory=dict)  # student -> lab ids

    def to_csv(self) -> str:
        buf = io.StringIO()
        # The last three columns came with the structural measure; readers go by name.
        cols = ["lab", "file", "student", "own_tokens", "reference", "closest_student",
                "closest_similarity", "structure", "structure_closest_student",
                "structure_closest_similarity"]
        w = csv.DictWriter(buf, cols)
        w.writeheader()
        # Most like the reference first, by structure (it sees through disguise), then text.
        w.writerows(sorted(self.rows, key=lambda r: (r["lab"], -(r["structure"] or 0),
                                                     -r["reference"])))
        return buf.getvalue()


def reference_files(lab, fname: str, root: Path) -> list[Path]:
    """The reference code a starter file could be copied from: the lab's solution.py and the
    mini_vllm modules it imports (for starter.cu: mini_vllm/csrc's CUDA sources)."""
    if fname.endswith(".cu"):
        return sorted(p for p in (root / "mini_vllm" / "csrc").rglob("*.cu*") if p.is_file())
    files = [lab.path / "solution.py"]
    tree = ast.parse(files[0].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mini_vllm"):
            base = root / Path(*node.module.split("."))
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    files.append(candidate)
    return files


def _fingerprint(text: str, name: str, boilerplate=None):
    from copydetect import CodeFingerprint

    return CodeFingerprint(name, K, WINDOW, boilerplate=boilerplate, fp=io.StringIO(text))


def _similar(a, b) -> float:
    from copydetect import compare_files

    if not len(a.hashes) or not len(b.hashes):
        return 0.0
    return float(compare_files(a, b)[1][0])


def class_similarity(files: dict[str, dict[str, bytes]], labs, root: Path, zero: float = ZERO,
                     peers: bool = True) -> Similarity:
    """Compare each student's files ({student: {lab rel/starter.py: bytes}}) with the reference
    and, with `peers`, with each other. Against the reference, a student's result does not depend
    on the class (intake decides zeros with one student at a time); peer notes go to
    `peer_flags`, which only flag and never change a score."""
    logging.getLogger().setLevel(logging.ERROR)  # copydetect warns about every short file
    result = Similarity()
    names = sorted(files)
    for lab in labs:
        for fname in ("starter.py", "starter.cu"):
            rel = f"{lab.rel}/{fname}"
            mine = [(name, files[name][rel]) for name in names if rel in files[name]]
            if not mine:
                continue
            boiler, refs = _reference_prints(lab, fname, root)
            texts = {name: data.decode(errors="replace") for name, data in mine}
            prints = [(name, _fingerprint(texts[name], rel, boiler)) for name, _ in mine]
            shapes = _shapes(lab, fname, root, texts)
            for name, fp in prints:
                ref = max((_similar(fp, r) for r in refs), default=0.0)
                closest, best = "", 0.0
                for other, ofp in prints if peers else ():
                    if other != name:
                        sim = _similar(fp, ofp)
                        if sim > best:
                            closest, best = other, sim
                tokens = int(fp.token_coverage)
                shape = shapes.get(name)
                row = {
                    "lab": lab.id, "file": fname, "student": name, "own_tokens": tokens,
                    "reference": round(ref, 3), "closest_student": closest,
                    "closest_similarity": round(best, 3), "structure": "",
                    "structure_closest_student": "", "structure_closest_similarity": "",
                }
                result.rows.append(row)
                notes = result.flags.setdefault(name, [])
                if ref >= zero and tokens >= MIN_TOKENS:
                    result.zero.setdefault(name, set()).add(lab.id)
                    notes.append((lab.id, f"{fname} is {ref:.0%} the reference's code; the lab "
                                  "scores 0"))
                if shape is None:
                    continue
                row["structure"] = round(shape.reference.score, 3)
                if shape.big_enough and shape.reference.score >= COPY \
                        and lab.id not in result.zero.get(name, ()):
                    notes.append((lab.id, f"copy of the reference: {fname} matches it function by "
                                  f"function ({shape.reference.score:.2f} of "
                                  f"{shape.reference.size} tokens): "
                                  + shape.reference.evidence("reference")))
                if peers:
                    _peer_review(result, row, lab.id, fname, name, shapes)
    return result


@dataclass
class _Shape:
    """One student's file as structure sees it: their own functions, and how they match the
    reference."""

    units: list[structure.Unit]
    reference: structure.Comparison
    grams: Counter  # all of its units' k-grams

    @property
    def big_enough(self) -> bool:
        return self.reference.size >= MIN_STRUCTURE


def _shapes(lab, fname: str, root: Path, texts: dict[str, str]) -> dict[str, _Shape]:
    """{student: _Shape} for the students whose Python file parses (none for starter.cu)."""
    if not fname.endswith(".py"):
        return {}
    keep, given, refs = _reference_units(lab, root)
    shapes = {}
    for name, text in texts.items():
        try:
            mine = structure.own(structure.units(text, keep), given)
        except (SyntaxError, ValueError, RecursionError):
            continue  # a file that does not parse scores 0 anyway
        shapes[name] = _Shape(mine, structure.compare(mine, refs), structure.combined(mine))
    return shapes


def _peer_review(result: Similarity, row: dict, lab_id: str, fname: str, name: str,
                 shapes: dict[str, _Shape]) -> None:
    """The student's closest classmate by structure; a flag at COPY or more. Whole files are
    compared first (cheap), function by function only where they are alike at all."""
    shape = shapes[name]
    closest, best = None, None
    total = sum(shape.grams.values())
    for other, oshape in shapes.items():
        if other == name or not oshape.units:
            continue
        common = sum((shape.grams & oshape.grams).values())
        if 2 * common < PEER_PREFILTER * (total + sum(oshape.grams.values())):
            continue
        comparison = structure.compare(shape.units, oshape.units)
        if best is None or comparison.score > best.score:
            closest, best = other, comparison
    if best is None:
        return
    row["structure_closest_student"] = closest
    row["structure_closest_similarity"] = round(best.score, 3)
    if best.score >= COPY and shape.big_enough:
        result.peer_flags.setdefault(name, []).append(
            (lab_id, f"review {fname}: a copy of {closest}'s, function by function "
                     f"({best.score:.2f}): " + best.evidence(f"{closest}'s")))


_REFERENCE_PRINTS: dict = {}


def _reference_prints(lab, fname: str, root: Path):
    """The published starter's fingerprints (boilerplate) and the reference files' (cached)."""
    key = (str(root), lab.rel, fname)
    if key not in _REFERENCE_PRINTS:
        rel = f"{lab.rel}/{fname}"
        published = _fingerprint((root / rel).read_text(encoding="utf-8"), rel)
        boiler = list(published.hashes)
        refs = [_fingerprint(p.read_text(encoding="utf-8"), str(p), boiler)
                for p in reference_files(lab, fname, root)]
        _REFERENCE_PRINTS[key] = (boiler, refs)
    return _REFERENCE_PRINTS[key]


_REFERENCE_UNITS: dict = {}


def _reference_units(lab, root: Path):
    """The lab's vocabulary (the names of its published starter), the published starter's units
    (boilerplate) and the reference files' own units (cached)."""
    key = (str(root), lab.rel)
    if key not in _REFERENCE_UNITS:
        published = (root / lab.rel / "starter.py").read_text(encoding="utf-8")
        keep = structure.vocabulary(published)
        given = structure.units(published, keep)
        refs = [u for p in reference_files(lab, "starter.py", root)
                for u in structure.units(p.read_text(encoding="utf-8"), keep)]
        _REFERENCE_UNITS[key] = (keep, given, structure.own(refs, given))
    return _REFERENCE_UNITS[key]
