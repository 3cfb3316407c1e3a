"""Compare the public API of a lab's starter.py and solution.py (names and signatures)."""

from __future__ import annotations

import inspect
from types import ModuleType


def _signature(obj) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    # Annotations are ignored on purpose: the two files may spell the same type differently.
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _members(cls: type) -> dict[str, str]:
    """Public methods/properties/attributes of a class (its own and inherited, not object's)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        for name, value in vars(klass).items():
            if name.startswith("__") and name != "__init__":
                continue
            if isinstance(value, property):
                out[name] = "property"
            elif isinstance(value, (staticmethod, classmethod)):
                out[name] = f"{type(value).__name__}{_signature(value.__func__)}"
            elif inspect.isfunction(value):
                out[name] = f"method{_signature(value)}"
    return out


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return type(obj).__name__


def compare(starter: ModuleType, solution: ModuleType) -> list[str]:
    """Differences between the two modules' public APIs; empty when they match."""
    problems = []
    names = {}
    for label, mod in (("starter.py", starter), ("solution.py", solution)):
        exported = getattr(mod, "__all__", None)
        if exported is None:
            problems.append(f"{label} defines no __all__")
        names[label] = set(exported or ())
    if problems:
        return problems
    for name in sorted(names["solution.py"] - names["starter.py"]):
        problems.append(f"{name!r} is exported by solution.py but not by starter.py")
    for name in sorted(names["starter.py"] - names["solution.py"]):
        problems.append(f"{name!r} is exported by starter.py but not by solution.py")
    for name in sorted(names["starter.py"] & names["solution.py"]):
        s_obj, r_obj = getattr(starter, name, None), getattr(solution, name, None)
        if s_obj is None or r_obj is None:
            problems.append(f"{name!r} is in __all__ but not defined in both files")
            continue
        if _kind(s_obj) != _kind(r_obj):
            problems.append(f"{name}: starter has a {_kind(s_obj)}, solution a {_kind(r_obj)}")
            continue
        if inspect.isclass(s_obj):
            s_mem, r_mem = _members(s_obj), _members(r_obj)
            for m in sorted(set(s_mem) | set(r_mem)):
                public = not m.startswith("_") or m == "__init__"
                if m not in r_mem:
                    problems.append(f"{name}.{m} is in starter.py but not in solution.py")
                elif m not in s_mem:
                    if public:
                        problems.append(f"{name}.{m} is in solution.py but not in starter.py")
                elif s_mem[m] != r_mem[m]:
                    problems.append(
                        f"{name}.{m}: starter {s_mem[m]} differs from solution {r_mem[m]}"
                    )
        elif inspect.isfunction(s_obj) or inspect.isbuiltin(s_obj):
            if _signature(s_obj) != _signature(r_obj):
                problems.append(
                    f"{name}: starter{_signature(s_obj)} differs from solution{_signature(r_obj)}"
                )
    return problems
