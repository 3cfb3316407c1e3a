"""Code compared by its structure, function by function: what renaming, reordering, comments and
small rewrites leave unchanged.

Each function or method of a file becomes one *unit*: its body as a stream of syntax-tree tokens
after normalisation, as JPlag, MOSS and Dolos do, so that the disguises of a copied file cancel
out:

* comments and docstrings are gone (the syntax tree has none), and so are type annotations,
  ``assert`` statements and ``pass``;
* local variables, parameters and the file's own private names become one placeholder; what
  stays is the vocabulary every student shares: builtins, the names the published starter
  defines or imports (the lab's API) and public attribute names (``block.ref_cnt``);
* string contents are dropped (a reworded message is the same code);
* a list, set or dict built by an append loop reads as the comprehension that builds it;
  ``x = x + 1`` as ``x += 1``; ``a > b`` as ``b < a``; ``if not c: A else: B`` as
  ``if c: B else: A``; an ``else`` after a branch that returns as the code that follows it;
  ``a, b = x, y`` and ``a = b = x`` as one assignment per name;
* order between functions does not count: each unit is matched to its best counterpart.

Two units are compared by the k-grams of their token streams (Dice's coefficient of the two
multisets). A file is compared with another by matching each of its units to the other's most
similar one; the file's score is the mean of those similarities weighted by each unit's size,
so a long function copied counts for more than a one-line accessor that any two students write
alike.
"""

from __future__ import annotations

import ast
import builtins
from collections import Counter
from dataclasses import dataclass, field

K = 6  # tokens per k-gram: a statement or two of normalised code
GIVEN = 0.9  # a unit this similar to one of the published starter's is that one
LOCAL = "_"  # a local, parameter or private name
PRIVATE = "_a"  # a private attribute that is not the lab's (a student's own helper)
KEEP_ALWAYS = frozenset(dir(builtins)) | {"self", "cls"}


@dataclass(frozen=True)
class Unit:
    """One function or method: its qualified name and its normalised token k-grams."""

    name: str
    size: int  # tokens
    grams: Counter = field(compare=False, hash=False, repr=False)

    @property
    def count(self) -> int:
        return self.size - K + 1 if self.size >= K else 1


@dataclass(frozen=True)
class Match:
    """A unit of the compared file and its best counterpart in the other."""

    name: str
    other: str
    similarity: float
    size: int

    def describe(self, whose: str = "reference") -> str:
        return f"{self.name} ~ {whose} {self.other} ({self.similarity:.2f})"


@dataclass
class Comparison:
    """A file against another: the size-weighted mean of its units' best similarities."""

    score: float = 0.0
    size: int = 0  # tokens of the file's own units (given code left out)
    matches: list[Match] = field(default_factory=list)

    def strongest(self, n: int = 5) -> list[Match]:
        """The ``n`` matches that weigh most in the score (size times similarity)."""
        return sorted(self.matches, key=lambda m: (-m.size * m.similarity, m.name))[:n]

    def evidence(self, whose: str, n: int = 3) -> str:
        """The strongest matches side by side: "A ~ reference B (0.97); ..."."""
        return "; ".join(m.describe(whose) for m in self.strongest(n))


@dataclass(frozen=True)
class Vocabulary:
    """The names that stay as they are: Python's builtins and the names the published starter
    binds at module level (its definitions and imports), and, after a dot, every attribute or
    method name it spells. The starter's local variables and parameters are not part of it."""

    names: frozenset[str]
    attributes: frozenset[str]


def vocabulary(source: str) -> Vocabulary:
    """The lab's API as the published starter ``source`` spells it."""
    tree = ast.parse(source)
    names = set(KEEP_ALWAYS)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    attributes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attributes.add(node.attr)
        elif isinstance(node, ast.ClassDef):  # methods and fields are attributes too
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    attributes.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    attributes.add(item.target.id)
    return Vocabulary(frozenset(names), frozenset(attributes))


def units(source: str, keep: Vocabulary) -> list[Unit]:
    """Every top-level function and method of ``source`` (nested functions are part of the
    function that holds them), normalised with ``keep`` as the names that stay."""
    tree = ast.parse(source)
    found: list[Unit] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                tokens = _Tokens(keep).of_function(node)
                grams = Counter(tuple(tokens[i:i + K]) for i in range(max(1, len(tokens) - K + 1)))
                found.append(Unit(prefix + node.name, len(tokens), grams))

    visit(tree.body, "")
    return found


def similarity(a: Unit, b: Unit) -> float:
    """Dice's coefficient of the two units' k-gram multisets, in [0, 1]."""
    common = sum((a.grams & b.grams).values())
    return 2 * common / (a.count + b.count)


def own(mine: list[Unit], given: list[Unit]) -> list[Unit]:
    """``mine`` without the published starter's code (``given``): a unit that is one of the
    given ones, layout and names aside, is boilerplate, and so is a task left unwritten."""
    return [u for u in mine if not any(_bound(u, g) >= GIVEN and similarity(u, g) >= GIVEN
                                       for g in given)]


def compare(mine: list[Unit], others: list[Unit]) -> Comparison:
    """Match each of ``mine`` with its most similar unit of ``others``; the score is the mean
    of those similarities weighted by each unit's size."""
    result = Comparison()
    weighted = 0.0
    for unit in mine:
        best, best_sim = None, 0.0
        for other in others:
            if _bound(unit, other) < best_sim:
                continue  # too different in size to beat the best so far
            sim = similarity(unit, other)
            # Ties go to the same name: the report then reads "touch ~ reference touch".
            if sim > best_sim or (sim == best_sim and other.name == unit.name):
                best, best_sim = other, sim
        result.matches.append(Match(unit.name, best.name if best else "-", round(best_sim, 2),
                                    unit.size))
        result.size += unit.size
        weighted += unit.size * best_sim
    result.score = weighted / result.size if result.size else 0.0
    return result


def combined(mine: list[Unit]) -> Counter:
    """The k-grams of all of ``mine`` together: a file's fingerprint, order aside."""
    total: Counter = Counter()
    for unit in mine:
        total.update(unit.grams)
    return total


def _bound(a: Unit, b: Unit) -> float:
    """The most Dice's coefficient can be for two units of these sizes."""
    return 2 * min(a.count, b.count) / (a.count + b.count)


class _Tokens:
    """Turns a function's syntax tree into its normalised token stream."""

    def __init__(self, keep: Vocabulary) -> None:
        self.keep = keep
        self.out: list[str] = []

    def of_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        self.block(node.body)
        return self.out

    # -- statements ---------------------------------------------------------------------------

    def block(self, body: list[ast.stmt]) -> None:
        body = _Rewrite.block(body)
        for stmt in body:
            self.stmt(stmt)

    def stmt(self, node: ast.stmt) -> None:
        if isinstance(node, (ast.Assert, ast.Pass)) or _is_docstring(node):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.out.append("def")
            self.block(node.body)
            self.out.append("end")
            return
        if isinstance(node, ast.ClassDef):
            self.out.append("class")
            self.block(node.body)
            self.out.append("end")
            return
        self.out.append(type(node).__name__)
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "type_comment", "simple"):
                continue
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.out.append(name)
                self.block(value)
                self.out.append("end")
            else:
                self.expr(value)

    # -- expressions --------------------------------------------------------------------------

    def expr(self, node) -> None:
        if isinstance(node, list):
            for item in node:
                self.expr(item)
            return
        if node is None or isinstance(node, (ast.expr_context, str, int)):
            return
        if isinstance(node, ast.Name):
            self.out.append(node.id if node.id in self.keep.names else LOCAL)
            return
        if isinstance(node, ast.Attribute):
            self.expr(node.value)
            attr = node.attr
            private = attr.startswith("_") and not attr.startswith("__")
            if private and attr not in self.keep.attributes:
                attr = PRIVATE
            self.out.append("." + attr)
            return
        if isinstance(node, ast.Constant):
            value = node.value
            self.out.append("str" if isinstance(value, (str, bytes)) else repr(value))
            return
        if isinstance(node, ast.JoinedStr):
            self.out.append("str")  # an f-string is a message: its words do not count
            return
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(
                node.ops[0], (ast.Gt, ast.GtE)):
            flipped = ast.Lt() if isinstance(node.ops[0], ast.Gt) else ast.LtE()
            node = ast.Compare(node.comparators[0], [flipped], [node.left])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "list", "set") and len(node.args) == 1 and isinstance(node.args[0],
                                                                         ast.GeneratorExp):
            gen = node.args[0]
            kind = ast.ListComp if node.func.id == "list" else ast.SetComp
            node = kind(gen.elt, gen.generators)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and isinstance(
                node.operand, ast.Compare) and len(node.operand.ops) == 1:
            node = _negate(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                node.func.id == "len" and len(node.args) == 1
                and isinstance(node.args[0], ast.ListComp)):
            # len([x for ...]) counts, as sum(1 for ...) does.
            counted = ast.GeneratorExp(ast.Constant(1), node.args[0].generators)
            node = ast.Call(ast.Name("sum", ast.Load()), [counted], [])
        if isinstance(node, ast.BoolOp):
            # `a and b` and `b and a`: the operands in a fixed order.
            parts = []
            for value in _operands(node):
                sub = _Tokens(self.keep)
                sub.expr(value)
                parts.append(sub.out)
            self.out.append(type(node.op).__name__)
            for part in sorted(parts):
                self.out.extend(part)
            return
        if isinstance(node, ast.Lambda):
            self.out.append("lambda")
            self.expr(node.body)
            return
        if isinstance(node, (ast.operator, ast.boolop, ast.unaryop, ast.cmpop)):
            self.out.append(type(node).__name__)
            return
        if isinstance(node, ast.arguments):
            return
        self.out.append(type(node).__name__)
        for name, value in ast.iter_fields(node):
            if name in ("ctx", "kind", "is_async", "conversion", "format_spec"):
                continue
            self.expr(value)


def _operands(node: ast.BoolOp) -> list[ast.expr]:
    """``a or (b or c)`` as ``[a, b, c]``."""
    out = []
    for value in node.values:
        if isinstance(value, ast.BoolOp) and type(value.op) is type(node.op):
            out.extend(_operands(value))
        else:
            out.append(value)
    return out


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


class _Rewrite:
    """Statement-level rewrites that map equivalent forms onto one (see the module docstring)."""

    @staticmethod
    def block(body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            for new in _Rewrite.stmt(stmt):
                prev = out[-1] if out else None
                if (isinstance(prev, ast.If) and isinstance(new, ast.If) and not prev.orelse
                        and not new.orelse and _ends_flow(new.body)
                        and _same(prev.body, new.body)):
                    # `if a: return` + `if b: return` is `if a or b: return`.
                    out[-1] = ast.If(ast.BoolOp(ast.Or(), [prev.test, new.test]), new.body, [])
                else:
                    out.append(new)
        return _Rewrite.loops_to_comprehensions(out)

    @staticmethod
    def stmt(node: ast.stmt) -> list[ast.stmt]:
        if isinstance(node, ast.AnnAssign):
            if node.value is None:
                return []
            node = ast.Assign([node.target], node.value)
        if isinstance(node, ast.Assign):
            return _Rewrite.assign(node)
        if isinstance(node, ast.Expr):
            if _is_logging(node.value):
                return []  # what a function logs or prints is not how it works
            if isinstance(node.value, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
                # A comprehension run for its side effects is a loop.
                return [_loop_of(node.value.generators, [ast.Expr(node.value.elt)])]
        if (isinstance(node, ast.For) and isinstance(node.iter, ast.GeneratorExp)
                and not node.orelse):
            # `for x in (e for g in gs for e in g)` is the nested loops.
            gen = node.iter
            return [_loop_of(gen.generators, [ast.Assign([node.target], gen.elt), *node.body])]
        if isinstance(node, ast.If):
            test, body, orelse = node.test, node.body, node.orelse
            if orelse and isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                test, body, orelse = test.operand, orelse, body
            if orelse and _ends_flow(orelse) and not _ends_flow(body):
                test, body, orelse = _negate(test), orelse, body
            if orelse and _ends_flow(body):
                # `if c: return x` + `else: rest` is `if c: return x` + `rest`.
                rest = [new for stmt in orelse for new in _Rewrite.stmt(stmt)]
                return [*_Rewrite.stmt(ast.If(test, body, [])), *rest]
            if (len(body) == len(orelse) == 1 and isinstance(body[0], ast.Assign)
                    and isinstance(orelse[0], ast.Assign) and len(body[0].targets) == 1
                    and _same(body[0].targets, orelse[0].targets)):
                # `if c: x = a` + `else: x = b` is `x = a if c else b`.
                value = ast.IfExp(test, body[0].value, orelse[0].value)
                return _Rewrite.assign(ast.Assign(body[0].targets, value))
            return [ast.If(test, body, orelse)]
        return [node]

    @staticmethod
    def assign(node: ast.Assign) -> list[ast.stmt]:
        value = node.value
        if len(node.targets) > 1:  # a = b = x
            return [ast.Assign([t], value) for t in node.targets]
        target = node.targets[0]
        if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                and len(target.elts) == len(value.elts) and not _swaps(target, value)):
            return [ast.Assign([t], v) for t, v in zip(target.elts, value.elts)]
        if (isinstance(value, ast.BinOp) and isinstance(target, (ast.Name, ast.Attribute))
                and ast.dump(value.left) == ast.dump(_as_load(target))):
            return [ast.AugAssign(target, value.op, value.right)]
        return [node]

    @staticmethod
    def loops_to_comprehensions(body: list[ast.stmt]) -> list[ast.stmt]:
        """``x = []`` then ``for ...: [if c:] x.append(e)`` becomes ``x = [e for ... if c]``
        (and the same for a set's ``add`` and a dict's item assignment)."""
        out: list[ast.stmt] = []
        for stmt in body:
            prev = out[-1] if out else None
            comp = _comprehension_of(prev, stmt) if prev is not None else None
            if comp is not None:
                out[-1] = ast.Assign([prev.targets[0]], comp)
            else:
                out.append(stmt)
        return out


_INVERSE = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Lt: ast.GtE, ast.GtE: ast.Lt,
            ast.Gt: ast.LtE, ast.LtE: ast.Gt}
_LOGGERS = {"logger", "logging", "log", "LOGGER", "warnings"}


def _negate(test: ast.expr) -> ast.expr:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return ast.Compare(test.left, [_INVERSE[type(test.ops[0])]()], test.comparators)
    return ast.UnaryOp(ast.Not(), test)


def _is_logging(node: ast.expr) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id in _LOGGERS)


def _loop_of(generators: list[ast.comprehension], body: list[ast.stmt]) -> ast.For:
    """The nested ``for``/``if`` statements a comprehension's clauses stand for."""
    for gen in reversed(generators):
        for cond in reversed(gen.ifs):
            body = [ast.If(cond, body, [])]
        body = [ast.For(gen.target, gen.iter, body, [])]
    return body[0]


def _same(a: list[ast.AST], b: list[ast.AST]) -> bool:
    return len(a) == len(b) and all(ast.dump(x) == ast.dump(y) for x, y in zip(a, b))


def _ends_flow(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _as_load(node: ast.expr) -> ast.expr:
    if isinstance(node, ast.Name):
        return ast.Name(node.id, ast.Load())
    return ast.Attribute(node.value, node.attr, ast.Load())


def _swaps(target: ast.Tuple, value: ast.Tuple) -> bool:
    """Whether a value reads a name the same tuple assignment binds (``a, b = b, a``)."""
    bound = {ast.dump(_as_load(t)) for t in target.elts if isinstance(t, (ast.Name,
                                                                           ast.Attribute))}
    return any(ast.dump(n) in bound for v in value.elts for n in ast.walk(v)
               if isinstance(n, (ast.Name, ast.Attribute)))


def _comprehension_of(prev: ast.stmt, loop: ast.stmt) -> ast.expr | None:
    if not (isinstance(prev, ast.Assign) and len(prev.targets) == 1
            and isinstance(prev.targets[0], ast.Name) and isinstance(loop, ast.For)
            and not loop.orelse and len(loop.body) == 1):
        return None
    name = prev.targets[0].id
    start = prev.value
    empty_list = isinstance(start, ast.List) and not start.elts
    empty_dict = isinstance(start, ast.Dict) and not start.keys
    empty_set = (isinstance(start, ast.Call) and isinstance(start.func, ast.Name)
                 and start.func.id == "set" and not start.args)
    inner, conds = loop.body[0], []
    while isinstance(inner, ast.If) and not inner.orelse and len(inner.body) == 1:
        conds.append(inner.test)
        inner = inner.body[0]
    gen = [ast.comprehension(loop.target, loop.iter, conds, 0)]
    if isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Call):
        call = inner.value
        if (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                and call.func.value.id == name and len(call.args) == 1 and not call.keywords):
            if call.func.attr == "append" and empty_list:
                return ast.ListComp(call.args[0], gen)
            if call.func.attr == "add" and empty_set:
                return ast.SetComp(call.args[0], gen)
    if (isinstance(inner, ast.Assign) and empty_dict and len(inner.targets) == 1
            and isinstance(inner.targets[0], ast.Subscript)
            and isinstance(inner.targets[0].value, ast.Name)
            and inner.targets[0].value.id == name):
        return ast.DictComp(inner.targets[0].slice, inner.value, gen)
    return None
