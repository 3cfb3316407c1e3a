"""How close each submitted starter file is to the reference and to the class's other files.

copydetect fingerprints code the way MOSS does (tokens with names and strings normalised,
k-grams, winnowing). The published starter's fingerprints are boilerplate, so the signatures,
docstrings and helpers every student receives do not count: what is compared is what the student
wrote. A similarity is the share of the student's own fingerprinted code that also occurs in the
other file.

Flags: at FLAG or more, a note for the instructor to read. At ZERO or more against the reference,
with at least MIN_TOKENS of the student's own code, the lab scores 0 (`--reference-zero` sets
it; 1.01 switches it off): pasting the shipped reference is not implementing it.
"""

from __future__ import annotations

import ast
import csv
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

FLAG = 0.5
ZERO = 0.9
MIN_TOKENS = 400  # filtered characters of the student's own code, for a zero
MIN_FLAG_TOKENS = 80  # below this, any two correct answers look alike
K, WINDOW = 25, 1


@dataclass
class Similarity:
    rows: list[dict] = field(default_factory=list)
    flags: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # vs the reference
    peer_flags: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # vs the class
    zero: dict[str, set[str]] = field(default_factory=dict)  # student -> lab ids

    def to_csv(self) -> str:
        buf = io.StringIO()
        cols = ["lab", "file", "student", "own_tokens", "reference", "closest_student",
                "closest_similarity"]
        w = csv.DictWriter(buf, cols)
        w.writeheader()
        w.writerows(sorted(self.rows, key=lambda r: (r["lab"], -r["reference"])))
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


def class_similarity(files: dict[str, dict[str, bytes]], labs, root: Path, flag: float = FLAG,
                     zero: float = ZERO, peers: bool = True) -> Similarity:
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
            prints = [(name, _fingerprint(data.decode(errors="replace"), rel, boiler))
                      for name, data in mine]
            for name, fp in prints:
                ref = max((_similar(fp, r) for r in refs), default=0.0)
                closest, best = "", 0.0
                for other, ofp in prints if peers else ():
                    if other != name:
                        sim = _similar(fp, ofp)
                        if sim > best:
                            closest, best = other, sim
                tokens = int(fp.token_coverage)
                result.rows.append({
                    "lab": lab.id, "file": fname, "student": name, "own_tokens": tokens,
                    "reference": round(ref, 3), "closest_student": closest,
                    "closest_similarity": round(best, 3),
                })
                notes = result.flags.setdefault(name, [])
                if ref >= zero and tokens >= MIN_TOKENS:
                    result.zero.setdefault(name, set()).add(lab.id)
                    notes.append((lab.id, f"{fname} is {ref:.0%} the reference's code; the lab "
                                  "scores 0"))
                elif ref >= flag and tokens >= MIN_FLAG_TOKENS:
                    notes.append((lab.id, f"review {fname}: {ref:.0%} like the reference"))
                if best >= flag and tokens >= MIN_FLAG_TOKENS:
                    result.peer_flags.setdefault(name, []).append(
                        (lab.id, f"review {fname}: {best:.0%} like {closest}'s"))
    return result


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
