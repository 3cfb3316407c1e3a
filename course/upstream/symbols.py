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
definition; spans of one file nest or are disjoint; the signature is a normalised string that
changes exactly when the parameters (names, order, kinds, defaults present) change, not when
annotations, whitespace or comments do.
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


@dataclass(frozen=True)
class Symbol:
    qualname: str
    start: int
    end: int
    signature: str  # "" for names that take no parameters (constants, enums, macros)


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


def _annotated(arg: ast.arg) -> str:
    """``name: annotation`` with the annotation's type as text (one spelling), or the name."""
    return f"{arg.arg}: {_type_text(arg.annotation)}" if arg.annotation else arg.arg


def _py_signature(args: ast.arguments, returns: ast.expr | None = None) -> str:
    """Parameters in order with their annotations as text, ``/``, ``*`` and ``=`` for defaults
    (not their values), and the return annotation: a parameter renamed, added, made keyword-only
    or given another type (``touch(blocks: tuple[list[...], ...])`` becoming
    ``touch(blocks: Sequence[...])``) changes it."""
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    parts = []
    for i, arg in enumerate(positional):
        parts.append(_annotated(arg) + ("=" if i >= first_default else ""))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg:
        parts.append("*" + _annotated(args.vararg))
    elif args.kwonlyargs:
        parts.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        parts.append(_annotated(arg) + ("=" if default is not None else ""))
    if args.kwarg:
        parts.append("**" + _annotated(args.kwarg))
    return "(" + ", ".join(parts) + ")" + (f" -> {_type_text(returns)}" if returns else "")


def _class_signature(node: ast.ClassDef) -> str:
    """A class's parameters: its ``__init__``'s, else its annotated fields (a dataclass)."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            return _py_signature(item.args)
    fields = [
        f"{item.target.id}: {_type_text(item.annotation)}" + ("=" if item.value is not None else "")
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]
    return "(" + ", ".join(fields) + ")" if fields else ""


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
                found.setdefault(name, Symbol(name, start, end, _class_signature(node)))
                visit(node.body, name + ".")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + node.name
                signature = _py_signature(node.args, node.returns)
                found.setdefault(name, Symbol(name, start, end, signature))
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
