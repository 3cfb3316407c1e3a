"""Today's pin: every upstream piece the course cites, found again in the newest release by file
and qualified name, with what changed since the pin the course teaches.

The map (``upstream_refs/map/*.toml``) anchors the course to lines of its pins. Each of its
entries also names the *piece* its line belongs to (``qualname``: the class, function or
method that holds the line, ``BlockPool.free_blocks``). ``upstream_refs/today/*.toml`` holds one
``[[piece]]`` per such piece::

    [[piece]]
    at = "vllm/v1/core/block_pool.py::BlockPool.free_blocks"    # at the cited pin (`version`)
    version = "0.11.0"
    today = "vllm/v1/core/block_pool.py::BlockPool.free_blocks"  # at today's pin; "" when gone
    changes = ["behaviour"]          # any of "signature", "behaviour"; "moved" and "gone" follow
    note = "what changed, in our words"  # from `at` and `today`
    cite = ["https://github.com/vllm-project/vllm/pull/NNNNN"]   # the change that made it
    replaced_by = ["vllm/...::Name"]  # a gone piece: where its job is done today

A location is ``file::qualname``, or a bare ``file`` for a whole module. Today's release is data
(``pins.toml``, ``[today] version``): moving the pin is one edit, after which
``course refs --vllm-src NEW --vllm-src PRIMARY`` lists every piece whose record is no longer
true.

Invariants checked without any source tree (:func:`check_today_consistency`): every map entry
names its piece, every piece the map names has exactly one record and every record is used; a
behaviour change and a gone piece say what happened (``note``) and a behaviour change cites the
upstream pull request or issue; every lab README ends with its "Upstream today" section, which
cites the change behind each behaviour change of that lab's pieces.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

from course.labs.catalog import REPO_ROOT
from course.upstream.refs import Ref, find_uses, load_map, toml_files
from course.upstream.symbols import Symbol, enclosing, signature_differences, symbols_of

CHANGES = ("signature", "behaviour")
SECTION = "## Upstream today"
CITE_RE = re.compile(r"https://github\.com/vllm-project/vllm/(?:pull|issues)/\d+")
ENGINE = "engine"  # the group of pieces no lab builds (mini_vllm's other modules)


@dataclass(frozen=True)
class Piece:
    at: str  # "file::qualname" (or "file") at the cited pin
    version: str
    today: str  # the same at today's pin; "" when the piece is gone
    changes: tuple[str, ...]
    note: str
    cite: tuple[str, ...]
    replaced_by: tuple[str, ...]
    source: str  # the today/*.toml file it came from

    @property
    def key(self) -> tuple[str, str]:
        return (self.version, self.at)

    def labels(self) -> list[str]:
        """What a reader of today's release meets: gone, or moved / signature / behaviour."""
        if not self.today:
            return ["gone"]
        moved = ["moved"] if self.today != self.at else []
        return moved + [c for c in CHANGES if c in self.changes]


def location(file: str, qualname: str) -> str:
    return f"{file}::{qualname}" if qualname else file


def split_location(where: str) -> tuple[str, str]:
    file, _, qualname = where.partition("::")
    return file, qualname


def today_version(root: Path = REPO_ROOT) -> str | None:
    pins = root / "upstream_refs" / "pins.toml"
    if not pins.is_file():
        return None
    return tomllib.loads(pins.read_text(encoding="utf-8")).get("today", {}).get("version")


def load_pieces(root: Path = REPO_ROOT) -> tuple[list[Piece], list[str]]:
    """All ``[[piece]]`` records, and the problems found while reading them."""
    pieces, problems = [], []
    for path, data in toml_files(root / "upstream_refs" / "today", problems, "today/"):
        for i, entry in enumerate(data.get("piece", [])):
            where = f"today/{path.name}: piece {i} ({entry.get('at', '?')})"
            missing = {"at", "version", "today"} - set(entry)
            if missing:
                problems.append(f"{where} lacks {', '.join(sorted(missing))}")
                continue
            piece = Piece(
                at=entry["at"],
                version=str(entry["version"]),
                today=entry["today"],
                changes=tuple(entry.get("changes", [])),
                note=entry.get("note", "").strip(),
                cite=tuple(entry.get("cite", [])),
                replaced_by=tuple(entry.get("replaced_by", [])),
                source=path.name,
            )
            problems += [f"{where}: {p}" for p in _record_problems(piece)]
            pieces.append(piece)
    return pieces, problems


def _record_problems(piece: Piece) -> list[str]:
    problems = []
    unknown = set(piece.changes) - set(CHANGES)
    if unknown:
        problems.append(f"unknown change(s) {sorted(unknown)}; use {list(CHANGES)}")
    if not piece.today and piece.changes:
        problems.append("a gone piece lists changes; say what replaced it in note/replaced_by")
    if (not piece.today or "behaviour" in piece.changes) and not piece.note:
        problems.append("say what happened to it (note)")
    if "behaviour" in piece.changes and not piece.cite:
        problems.append("a behaviour change cites the upstream pull request or issue (cite)")
    for url in piece.cite:
        if not CITE_RE.fullmatch(url):
            problems.append(f"cite {url!r} is not a vllm-project/vllm pull request or issue URL")
    return problems


# --- the map's pieces and the labs they belong to --------------------------------------------


def piece_key(ref: Ref) -> tuple[str, str] | None:
    """The piece a map entry's line belongs to, or None when the entry does not name it."""
    if ref.qualname is None:
        return None
    return (ref.version, location(ref.file, ref.qualname))


def _lab_folders(root: Path) -> dict[str, Path]:
    labs = {}
    for folder in sorted(root.glob("phase-*/labs/lab-*")):
        phase = re.match(r"phase-(\d+)", folder.parent.parent.name)
        lab = re.match(r"lab-(\d+)", folder.name)
        if phase and lab and (folder / "README.md").is_file():
            labs[f"{phase.group(1)}-{lab.group(1)}"] = folder
    return labs


def _exported(solution: Path) -> set[str]:
    """``mini_vllm.module.Name`` for each name a lab's solution.py takes from mini_vllm."""
    names = set()
    if not solution.is_file():
        return names
    for node in ast.walk(ast.parse(solution.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mini_vllm"):
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def labs_of_refs(refs: list[Ref], root: Path = REPO_ROOT) -> dict[Ref, set[str]]:
    """The labs each map entry belongs to: a lab whose folder cites it (README, hints, tests),
    or whose solution.py exports the mini_vllm symbol it documents (or that symbol's class)."""
    folders = _lab_folders(root)
    exported = {lab: _exported(folder / "solution.py") for lab, folder in folders.items()}
    uses = find_uses(root)
    out: dict[Ref, set[str]] = {}
    for ref in refs:
        labs = set()
        for where in uses.get(ref.key, []):
            for lab, folder in folders.items():
                if where.startswith(str(folder.relative_to(root)) + "/"):
                    labs.add(lab)
        symbol = ref.symbol.split(":")[0].split(" ")[0]
        for lab, names in exported.items():
            if any(symbol == n or symbol.startswith(n + ".") for n in names):
                labs.add(lab)
        out[ref] = labs
    return out


def pieces_by_lab(root: Path = REPO_ROOT) -> dict[str, list[Piece]]:
    """Each lab's pieces (and ``engine`` for the pieces no lab builds), in map order."""
    refs, _ = load_map(root)
    pieces, _ = load_pieces(root)
    by_key = {p.key: p for p in pieces}
    grouped: dict[str, list[Piece]] = {lab: [] for lab in _lab_folders(root)}
    grouped[ENGINE] = []
    for ref, labs in labs_of_refs(refs, root).items():
        piece = by_key.get(piece_key(ref) or ("", ""))
        if piece is None:
            continue
        for lab in labs or {ENGINE}:
            if piece not in grouped[lab]:
                grouped[lab].append(piece)
    return grouped


# --- checks --------------------------------------------------------------------------------


def _section(readme: Path) -> str | None:
    """The README's last ``## `` section if it is "Upstream today", else None."""
    text = readme.read_text(encoding="utf-8")
    headings = [m for m in re.finditer(r"^## .*$", text, re.MULTILINE)]
    if not headings or not headings[-1].group().startswith(SECTION):
        return None
    return text[headings[-1].start() :]


def check_today_consistency(root: Path = REPO_ROOT) -> list[str]:
    """Map, today's records and lab READMEs agree (no source tree needed). A course with no
    ``[today]`` pin and no records has nothing to check."""
    refs, _ = load_map(root)
    pieces, problems = load_pieces(root)
    if today_version(root) is None:
        if not pieces and not problems:
            return []  # a course that does not follow a today's pin (a fixture, a fork)
        problems.append("pins.toml has no [today] version (the newest release, by symbol)")
    keys: dict[tuple[str, str], Piece] = {}
    for piece in pieces:
        if piece.key in keys:
            problems.append(f"today/{piece.source}: {piece.at} @ v{piece.version} recorded twice")
        keys.setdefault(piece.key, piece)
    wanted: set[tuple[str, str]] = set()
    for ref in refs:
        key = piece_key(ref)
        if key is None:
            problems.append(
                f"{ref.source}: {ref.file}:{ref.line} @ v{ref.version} ({ref.symbol}) lacks "
                f"qualname (the upstream class/function holding the line; `course refs "
                f"--vllm-src <v{ref.version} tree>` prints it)"
            )
            continue
        wanted.add(key)
        if key not in keys:
            problems.append(
                f"{ref.source}: {key[1]} @ v{key[0]} ({ref.symbol}) has no [[piece]] in "
                f"upstream_refs/today/ (where is it today, and what changed?)"
            )
    for key, piece in sorted(keys.items()):
        if key not in wanted:
            problems.append(f"today/{piece.source}: {piece.at} @ v{piece.version} is never used")
    problems += _check_readmes(root)
    return problems


def _check_readmes(root: Path) -> list[str]:
    problems = []
    grouped = pieces_by_lab(root)
    for lab, folder in _lab_folders(root).items():
        readme = folder / "README.md"
        section = _section(readme)
        where = readme.relative_to(root)
        if section is None:
            problems.append(
                f"{where}: end the README with a '{SECTION}' section (what a reader of today's "
                f"release meets for this lab's pieces, each change cited)"
            )
            continue
        version = today_version(root)
        if version and f"v{version}" not in section:
            problems.append(
                f"{where}: '{SECTION}' does not say what v{version} (today's pin) has; "
                f"bring it up to that release"
            )
        if not CITE_RE.search(section):
            problems.append(f"{where}: '{SECTION}' cites no upstream pull request or issue")
        for piece in grouped.get(lab, []):
            if "behaviour" in piece.changes and not any(url in section for url in piece.cite):
                problems.append(
                    f"{where}: '{SECTION}' does not cite the change to {piece.today} "
                    f"({', '.join(piece.cite)})"
                )
    return problems


def _resolve(tree: Path, where: str, cache: dict[Path, dict[str, Symbol]]) -> Symbol | bool:
    """The symbol at ``where`` in ``tree``; True for a module that exists; False when absent."""
    file, qualname = split_location(where)
    path = tree / file
    if not path.is_file():
        return False
    if not qualname:
        return True
    if path not in cache:
        cache[path] = symbols_of(path)
    return cache[path].get(qualname, False)


def _elsewhere(tree: Path, where: str, most: int = 3) -> str:
    """Where else ``tree`` defines the name of ``where`` (a hint for moving the pin), or ""."""
    file, qualname = split_location(where)
    name = re.split(r"\.|::", qualname)[-1].split("<")[0] if qualname else ""
    if not name:
        return ""
    if file.endswith(".py"):
        pattern = re.compile(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b", re.M)
        files = [p for top in ("vllm", "tests", "benchmarks") for p in (tree / top).rglob("*.py")]
    else:
        pattern = re.compile(rf"^[^;\n]*\b{re.escape(name)}\s*(?:<[^;{{}}\n]*>)?\s*\([^;]*$",
                             re.M)
        files = [p for p in (tree / "csrc").rglob("*") if p.suffix in (".cu", ".cuh", ".cpp", ".h")]
    found = []
    for path in sorted(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        if name in text and pattern.search(text):
            found.append(str(path.relative_to(tree)))
            if len(found) == most:
                break
    return f"; {name} is defined in {', '.join(found)}" if found else f"; {name} is defined nowhere"


def check_today_source(
    today_tree: Path, pinned_trees: dict[str, Path], root: Path = REPO_ROOT
) -> tuple[list[str], int]:
    """(problems, pieces checked) of every record against today's release, and, where the pin a
    record cites is also given, the record's signature flag against both releases: the full
    signatures at ``at`` and at ``today`` (a class's: its ``__init__``'s, else its fields),
    parameter by parameter (name, order, kind, annotation and default as source text) and the
    return annotation. A record that keeps its signature where they differ names what differs;
    one that flags a change where none is, is wrong too."""
    pieces, problems = load_pieces(root)
    cache: dict[Path, dict[str, Symbol]] = {}
    version = today_version(root)
    checked = 0
    for piece in pieces:
        where = f"today/{piece.source}: {piece.at} @ v{piece.version}"
        checked += 1
        if piece.today:
            now = _resolve(today_tree, piece.today, cache)
            if now is False:
                problems.append(f"{where}: {piece.today} is not in v{version}"
                                f"{_elsewhere(today_tree, piece.today)}")
                continue
        else:
            still = _resolve(today_tree, piece.at, cache)
            if still is not False:
                problems.append(f"{where}: recorded as gone, but v{version} still has it")
            now = None
        for other in piece.replaced_by:
            if _resolve(today_tree, other, cache) is False:
                problems.append(f"{where}: replaced_by {other} is not in v{version}")
        pinned = pinned_trees.get(piece.version)
        if pinned is None or not piece.today:
            continue
        then = _resolve(pinned, piece.at, cache)
        if then is False:
            problems.append(f"{where}: not in v{piece.version} itself")
        elif isinstance(then, Symbol) and isinstance(now, Symbol):
            differences = signature_differences(then, now)
            if differences and "signature" not in piece.changes:
                problems.append(
                    f"{where}: recorded with its signature kept, but it changed from "
                    f"v{piece.version} to v{version}: {'; '.join(differences)} "
                    f"({then.signature} -> {now.signature}); add 'signature' in changes"
                )
            elif not differences and "signature" in piece.changes:
                problems.append(
                    f"{where}: recorded with a signature change, but the signature did not "
                    f"change from v{piece.version} to v{version} ({then.signature}); "
                    f"drop 'signature' in changes"
                )
    return problems, checked


def check_qualnames(tree: Path, version: str, root: Path = REPO_ROOT) -> list[str]:
    """Each map entry of ``version`` names the piece its line belongs to in ``tree``."""
    refs, _ = load_map(root)
    cache: dict[Path, dict[str, Symbol]] = {}
    problems = []
    for ref in refs:
        path = tree / ref.file
        if ref.version != version or not path.is_file():
            continue
        if path not in cache:
            cache[path] = symbols_of(path)
        holder = enclosing(cache[path], ref.line)
        actual = holder.qualname if holder else ""
        if ref.qualname != actual:
            problems.append(
                f"{ref.source}: {ref.file}:{ref.line} @ v{ref.version} ({ref.symbol}): "
                f"qualname = {actual!r} (the map says {ref.qualname!r})"
            )
    return problems


def changes_report(root: Path = REPO_ROOT, only: str | None = None) -> list[str]:
    """Lines of the per-lab report: which pieces moved, changed signature, changed behaviour or
    vanished between the pin each was cited at and today's pin (``engine``: the pieces no lab
    builds). ``only``: one lab, with each piece's note; KeyError for an unknown one."""
    version = today_version(root)
    grouped = pieces_by_lab(root)
    if only and only not in grouped:
        raise KeyError(f"no lab {only!r}; the groups are {', '.join(grouped)}")
    lines = []
    for lab, pieces in grouped.items():
        if only and lab != only:
            continue
        changed = [p for p in pieces if p.labels()]
        counts = {k: sum(k in p.labels() for p in pieces)
                  for k in ("moved", "signature", "behaviour", "gone")}
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "all unchanged"
        lines.append(f"{lab}: {len(pieces)} pieces at v{version}: {summary}")
        for piece in changed:
            labels = "/".join(piece.labels())
            target = piece.today or "; ".join(piece.replaced_by) or "-"
            arrow = f" -> {target}" if piece.today != piece.at else ""
            lines.append(f"  {labels:<20} {piece.at}{arrow}")
            if only and piece.note:
                lines.append(f"  {'':<20} {piece.note}")
    return lines


def check_trees(srcs: list[Path], root: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """(problems, lines to print) for the source trees given to ``course refs``.

    A tree of a pinned release is checked line by line (the map) and piece by piece (each
    entry's qualname); a tree of today's release is checked piece by piece (each record's
    location, and its signature flag when the cited pin's tree is given too). A tree that is
    neither, or that no entry cites, is a problem: nothing checked must not read as a pass."""
    from course.upstream.layout import LAYOUT, check_layout_tree
    from course.upstream.refs import check_against_source, source_version

    refs, _ = load_map(root)
    cited = {r.version for r in refs}
    today = today_version(root)
    problems: list[str] = []
    lines: list[str] = []
    trees: dict[str, Path] = {}
    for src in srcs:
        version = source_version(src)
        if version is None:
            problems.append(
                f"{src}: cannot tell which release this is (no PKG-INFO, no vX.Y.Z name)"
            )
        elif version not in cited and version != today:
            known = ", ".join(f"v{v}" for v in sorted(cited | ({today} - {None})))
            problems.append(
                f"{src} holds v{version}, which matches no entry (the pins are {known}): "
                f"nothing was checked; pass a pinned release, or move [today] in pins.toml"
            )
        else:
            trees[version] = src
    pinned = {v: p for v, p in trees.items() if v in cited}
    if pinned:
        mismatches, notes, checked = check_against_source(list(pinned.values()), root)
        for version, tree in pinned.items():
            mismatches += check_qualnames(tree, version, root)
        problems += mismatches
        lines.append(f"{checked} map entries checked against their pinned source; "
                     f"{len(mismatches)} mismatch(es).")
        lines += [f"note: {n}" for n in notes]
    elif today in trees:
        lines.append(f"note: the map's {len(refs)} line references are checked only against "
                     f"their pinned releases (pass --vllm-src for v" + ", v".join(sorted(cited))
                     + ")")
    if today in trees:
        found, checked = check_today_source(trees[today], pinned, root)
        problems += found
        lines.append(f"{checked} pieces checked against today's pin v{today}; "
                     f"{len(found)} mismatch(es).")
        if not set(pinned) >= {p.version for p in load_pieces(root)[0]}:
            lines.append("note: signature changes are checked only for the pins given too")
    if (root / LAYOUT).is_file():
        layout_checked, found_layout = 0, []
        for version, tree in trees.items():
            found, checked = check_layout_tree(tree, version, root, today)
            found_layout += found
            layout_checked += checked
        problems += found_layout
        lines.append(f"{layout_checked} upstream paths of mini_vllm's layout checked in the "
                     f"releases given; {len(found_layout)} mismatch(es).")
    return problems, lines
