"""Upstream symbols by qualified name: where a definition starts and ends, and its signature.

A line number is a poor anchor across releases (upstream's files move by hundreds of lines); a
qualified name is a good one. This module finds the definitions of one source file:

- Python, with ``ast``: classes, functions and methods (``BlockPool.free_blocks``), and names
  assigned at module or class level (``NONE_HASH``, ``CacheConfig.block_size``);
- C, C++ and CUDA, with a small scanner (comments and strings blanked, braces matched):
  functions (``paged_attention_kernel``; an explicit specialisation keeps its template arguments,
  ``scaled_vec_conversion<uint8_t,float>``), structs, classes, enums and ``#define`` macros.
  It reads upstream's style, not all of C++: a definition's head is the text since the last
  ``;``, ``{`` or ``}`` at namespace or class scope.

Invariants: a symbol's span ``start..end`` (1-based, inclusive) contains every line of its
definition; spans of one file nest or are disjoint. A Python symbol's signature is read with
``ast`` into its parts (:class:`Param`: name, kind, annotation and default as source text, in
order; and the return annotation): it changes exactly when one of those does, not when
whitespace, comments or the spelling of a type do (``Optional[X]`` is ``X | None``).
:func:`signature_differences` says what changed, part by part. A C/C++ symbol's signature is
its parameter list as text, whitespace collapsed.
"""

from __future__ import annotations

import ast
import bisect
import copy
import re
from dataclasses import dataclass
from pathlib import Path

PY_SUFFIXES = (".py",)
C_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")


KINDS = ("positional-only", "regular", "*args", "keyword-only", "**kwargs")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS
    annotation: str  # the type as source text (one spelling), "" when unannotated
    default: str | None  # the default as source text, None when there is none

    def text(self) -> str:
        star = {"*args": "*", "**kwargs": "**"}.get(self.kind, "")
        out = star + self.name + (f": {self.annotation}" if self.annotation else "")
        if self.default is not None:
            out += f" = {self.default}" if self.annotation else f"={self.default}"
        return out


@dataclass(frozen=True)
class Signature:
    """A Python definition's parameters, in order, and its return annotation ("" if none)."""

    params: tuple[Param, ...]
    returns: str = ""

    def text(self) -> str:
        parts: list[str] = []
        kinds = [p.kind for p in self.params] + [""]
        for i, param in enumerate(self.params):
            if param.kind == "keyword-only" and not {"*args", "keyword-only"} & set(kinds[:i]):
                parts.append("*")  # keyword-only without *args
            parts.append(param.text())
            if param.kind == "positional-only" and kinds[i + 1] != "positional-only":
                parts.append("/")
        return "(" + ", ".join(parts) + ")" + (f" -> {self.returns}" if self.returns else "")


@dataclass(frozen=True)
class Symbol:
    qualname: str
    start: int
    end: int
    signature: str  # "" for names that take no parameters (constants, enums, macros)
    parts: Signature | None = None  # a Python function's or class's signature, by part


def symbols_of(path: Path) -> dict[str, Symbol]:
    """Every definition in ``path`` by qualified name (the first one wins on a repeat)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix in PY_SUFFIXES:
        return python_symbols(text)
    if path.suffix in C_SUFFIXES:
        return c_symbols(text)
    return {}


def enclosing(symbols: dict[str, Symbol], line: int) -> Symbol | None:
    """The innermost symbol whose span holds ``line`` (None at bare module level)."""
    holding = [s for s in symbols.values() if s.start <= line <= s.end]
    return min(holding, key=lambda s: s.end - s.start, default=None)


# --- Python -------------------------------------------------------------------------------


_TYPING_ALIASES = {"List": "list", "Dict": "dict", "Tuple": "tuple", "Set": "set",
                   "FrozenSet": "frozenset", "Type": "type"}


class _Spelling(ast.NodeTransformer):
    """One spelling per type: ``Optional[X]`` and ``Union[X, None]`` are ``X | None``,
    ``List`` is ``list``, a quoted annotation is its expression. Upstream rewrote its annotations
    between the pins (``Optional[int]`` to ``int | None``) without changing a type."""

    @staticmethod
    def _name(node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return node.attr if node.value.id == "typing" else ""
        return ""

    def visit_Constant(self, node: ast.Constant) -> ast.AST:  # noqa: N802 (ast's naming)
        if isinstance(node.value, str):
            try:
                return self.visit(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return node
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802
        return ast.Name(_TYPING_ALIASES.get(node.id, node.id), node.ctx)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:  # noqa: N802
        name = self._name(node)  # typing.List is list too
        return ast.Name(_TYPING_ALIASES[name], node.ctx) if name in _TYPING_ALIASES else node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:  # noqa: N802
        node = self.generic_visit(node)
        name = self._name(node.value)
        if name in ("Optional", "Union"):
            parts = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
            if name == "Optional":
                parts.append(ast.Constant(None))
            union = parts[0]
            for part in parts[1:]:
                union = ast.BinOp(union, ast.BitOr(), part)
            return union
        return node


def _type_text(annotation: ast.expr) -> str:
    return ast.unparse(_Spelling().visit(copy.deepcopy(annotation)))


def _param(arg: ast.arg, kind: str, default: ast.expr | None) -> Param:
    annotation = _type_text(arg.annotation) if arg.annotation else ""
    return Param(arg.arg, kind, annotation, None if default is None else ast.unparse(default))


def _py_signature(args: ast.arguments, returns: ast.expr | None = None) -> Signature:
    """Parameters in order, each with its kind, its annotation's type as text (one spelling)
    and its default as source text, and the return annotation: a parameter renamed, added,
    made keyword-only, given another default or another type (``touch(blocks:
    tuple[list[...], ...])`` becoming ``touch(blocks: Sequence[...])``) changes it."""
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    params = [
        _param(arg, "positional-only" if i < len(args.posonlyargs) else "regular", default)
        for i, (arg, default) in enumerate(zip(positional, defaults))
    ]
    if args.vararg:
        params.append(_param(args.vararg, "*args", None))
    params += [_param(arg, "keyword-only", default)
               for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(_param(args.kwarg, "**kwargs", None))
    return Signature(tuple(params), _type_text(returns) if returns else "")


def _class_signature(node: ast.ClassDef) -> Signature | None:
    """A class's parameters: its ``__init__``'s, else its annotated fields (a dataclass), else
    None (nothing to compare)."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            return _py_signature(item.args)
    fields = [
        Param(item.target.id, "regular", _type_text(item.annotation),
              ast.unparse(item.value) if item.value is not None else None)
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]
    return Signature(tuple(fields)) if fields else None


def _quoted(text: str | None) -> str:
    return "none" if not text else repr(text)


def signature_differences(then: Symbol, now: Symbol) -> list[str]:
    """What differs between two symbols' signatures, one phrase per difference (``parameter
    'blocks' annotation 'list[list[Block]]' -> 'Sequence[Block]'``); [] when they are the
    same. Symbols without parts (C, C++, constants) compare their signature text."""
    if then.parts is None or now.parts is None:
        if then.signature == now.signature:
            return []
        return [f"parameters {then.signature or '()'!r} -> {now.signature or '()'!r}"]
    old, new = then.parts.params, now.parts.params
    old_names, new_names = [p.name for p in old], [p.name for p in new]
    found: list[str] = []
    pairs: list[tuple[Param, Param]] = []
    renamed: set[str] = set()
    for a, b in zip(old, new):  # a new name in the place of a name now gone: renamed
        if a.name != b.name and a.name not in new_names and b.name not in old_names:
            found.append(f"parameter {a.name!r} renamed {b.name!r}")
            pairs.append((a, b))
            renamed |= {a.name, b.name}
    by_name = {p.name: p for p in new}
    for a in old:
        if a.name in renamed:
            continue
        if a.name in by_name:
            pairs.append((a, by_name[a.name]))
        else:
            found.append(f"parameter {a.name!r} removed")
    found += [f"parameter {b.name!r} added" for b in new
              if b.name not in old_names and b.name not in renamed]
    kept_old = [n for n in old_names if n in new_names]
    kept_new = [n for n in new_names if n in old_names]
    if kept_old != kept_new:
        found.append(f"parameters reordered ({', '.join(kept_old)}) -> ({', '.join(kept_new)})")
    for a, b in pairs:
        name = b.name
        if a.kind != b.kind:
            found.append(f"parameter {name!r} kind {a.kind} -> {b.kind}")
        if a.annotation != b.annotation:
            found.append(f"parameter {name!r} annotation {_quoted(a.annotation)} -> "
                         f"{_quoted(b.annotation)}")
        if a.default != b.default:
            found.append(f"parameter {name!r} default {_quoted(a.default)} -> "
                         f"{_quoted(b.default)}")
    if then.parts.returns != now.parts.returns:
        found.append(f"return annotation {_quoted(then.parts.returns)} -> "
                     f"{_quoted(now.parts.returns)}")
    return found


def python_symbols(text: str) -> dict[str, Symbol]:
    found: dict[str, Symbol] = {}

    def visit(body: list[ast.stmt], prefix: str, in_function: bool = False) -> None:
        """Definitions of ``body``; inside a function only nested classes and functions count
        (its local variables are part of the function, not pieces of their own)."""
        for node in body:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            end = node.end_lineno or node.lineno
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                parts = _class_signature(node)
                signature = parts.text() if parts else ""
                found.setdefault(name, Symbol(name, start, end, signature, parts))
                visit(node.body, name + ".")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + node.name
                parts = _py_signature(node.args, node.returns)
                found.setdefault(name, Symbol(name, start, end, parts.text(), parts))
                visit(node.body, name + ".", in_function=True)
            elif isinstance(node, ast.Assign | ast.AnnAssign) and not in_function:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        name = prefix + target.id
                        found.setdefault(name, Symbol(name, start, end, ""))
            elif isinstance(node, ast.If | ast.Try):  # definitions under `if TYPE_CHECKING:` etc.
                visit(node.body, prefix, in_function)
                visit(getattr(node, "orelse", []), prefix, in_function)

    visit(ast.parse(text).body, "")
    return found


# --- C, C++, CUDA -------------------------------------------------------------------------

_BLANK_RE = re.compile(
    r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL
)
_SCOPE_RE = re.compile(r"\b(struct|class|union|enum\s+class|enum|namespace)\b\s*(\w*)[^;(]*$")
_TEMPLATE_RE = re.compile(r"^\s*template\s*<")
_CALL_RE = re.compile(r"([A-Za-z_][\w:]*(?:\s*<[^<>;{}()]*>)?)\s*\(")
_NOT_A_NAME = {"__launch_bounds__", "__attribute__", "alignas", "decltype", "sizeof",
               "__align__", "if", "for", "while", "switch", "return", "static_assert"}
_DEFINE_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(\([^)]*\))?", re.MULTILINE)


def _blank(text: str) -> str:
    """Comments and string literals replaced by spaces (newlines kept, so lines still count)."""
    return _BLANK_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def _match_brace(code: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return len(code) - 1


def _params(head: str, paren_at: int) -> str:
    """The text between the parenthesis at ``paren_at`` and its match, whitespace collapsed."""
    depth = 0
    for i in range(paren_at, len(head)):
        depth += {"(": 1, ")": -1}.get(head[i], 0)
        if depth == 0:
            return "(" + " ".join(head[paren_at + 1 : i].split()) + ")"
    return "(" + " ".join(head[paren_at + 1 :].split()) + ")"


def c_symbols(text: str) -> dict[str, Symbol]:
    lines = _blank(text).split("\n")
    found: dict[str, Symbol] = {}
    # Preprocessor lines: record each #define with its continuation lines, then blank them all,
    # so that the halves of an `#if ... #else` do not confuse the heads below.
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("#"):
            i += 1
            continue
        first = i
        while lines[i].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
        m = _DEFINE_RE.match(lines[first])
        if m:
            found.setdefault(m.group(1), Symbol(m.group(1), first + 1, i + 1, m.group(2) or ""))
        for k in range(first, i + 1):
            lines[k] = " " * len(lines[k])
        i += 1
    code = "\n".join(lines)
    line_of = _LineIndex(code)

    def record(head: str, head_at: int, close: int, prefix: str) -> str | None:
        """Record the definition whose head is ``head``; returns the scope prefix to scan its
        body with (namespaces, structs, classes), or None for a body not to scan."""
        start = line_of(head_at + len(head) - len(head.lstrip()))
        head = _without_template(head)
        scope = _SCOPE_RE.search(head)
        if scope:
            if scope.group(1) == "namespace" or not scope.group(2):
                return prefix
            name = prefix + scope.group(2)
            found.setdefault(name, Symbol(name, start, line_of(close), ""))
            return name + "::"
        if re.fullmatch(r'\s*extern\s*(\s+)?', head):  # extern "C" { (the string is blanked)
            return prefix
        for m in _CALL_RE.finditer(head):
            if _depth_at(head, m.start()) != 0 or m.group(1).split("<")[0] in _NOT_A_NAME:
                continue
            if "=" in head[: m.start()]:  # an initialiser, `auto f = [](...) {`, not a definition
                return None
            name = prefix + re.sub(r"\s+", "", m.group(1))
            found.setdefault(name, Symbol(name, start, line_of(close), _params(head, m.end() - 1)))
            return None
        return None

    def scan(lo: int, hi: int, prefix: str) -> None:
        head_start, i = lo, lo
        while i < hi:
            ch = code[i]
            if ch in ";}":
                head_start = i + 1
            elif ch == "{":
                close = _match_brace(code, i)
                inner = record(code[head_start:i], head_start, close, prefix)
                if inner is not None:
                    scan(i + 1, close, inner)
                i, head_start = close, close + 1
            i += 1

    scan(0, len(code), "")
    return found


def _without_template(head: str) -> str:
    """``head`` with a leading ``template <...>`` blanked (its defaults hold ``=`` and names)."""
    m = _TEMPLATE_RE.match(head)
    if not m:
        return head
    depth = 1
    for i in range(m.end(), len(head)):
        depth += {"<": 1, ">": -1}.get(head[i], 0)
        if depth == 0:
            return " " * (i + 1) + head[i + 1 :]
    return head


def _depth_at(text: str, pos: int) -> int:
    """Parenthesis depth at ``pos`` (template angle brackets are not counted)."""
    return text.count("(", 0, pos) - text.count(")", 0, pos)


class _LineIndex:
    """1-based line number of a character offset."""

    def __init__(self, text: str) -> None:
        self._starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def __call__(self, offset: int) -> int:
        return bisect.bisect_right(self._starts, offset)
