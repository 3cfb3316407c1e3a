"""Your own mini_vllm: the reference engine with the student's finished pieces put in its place.

Each lab that builds part of the engine names, in ``course/labs/labs.toml`` (``engine = [...]``),
the objects of its ``starter.py`` that the engine uses; ``solution.py`` exposes the reference
objects under the same names. :func:`compose` makes a running process use the student's objects
instead:

1. every ``mini_vllm`` module of the engine is imported, and every lab's ``solution.py`` is loaded
   to learn which objects are the reference ones;
2. labs are taken in course order. For a lab that is the student's, its ``starter.py`` is loaded
   and, for each engine name, every module-level binding in ``mini_vllm`` that holds the current
   object (a module's own definition, and every ``from ... import`` of it) is rebound to the
   student's object. A later starter that imports an earlier piece from ``mini_vllm`` therefore
   gets the student's piece: lab 02-03's manager builds the student's ``BlockPool``, lab 03-03's
   scheduler subclasses the student's lab 03-01 scheduler;
3. a lab that is not the student's keeps the reference, except where it *extends* an earlier
   lab's class that is the student's (``extends`` in labs.toml): then the engine gets the
   student's class with the reference's versions of the members that lab adds. A reference
   class that *subclasses* an earlier piece the student replaced (lab 04-02's
   ``AsyncScheduler`` of lab 03-01's ``Scheduler``) is rebuilt on the student's class.

The reference modules stay as they are: mini_vllm looks its pieces up through module-level names
at call time (``Scheduler(...)``, ``paged_attn.forward_decode(...)``), and rebinding those names is
all it takes. Composition patches the process it runs in, so it runs in a fresh one (``python -m
course engine`` starts one per engine it runs) and changes no file.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field

from course.labs.catalog import Lab, discover
from course.labs.loader import load_module

# Every module the engine runs; importing mini_vllm.entrypoints.llm pulls in the rest, the others
# are listed so that a piece they bind is rebound too.
ENGINE_MODULES = (
    "mini_vllm.entrypoints.llm",
    "mini_vllm.core.swap",
    "mini_vllm.core.block_sharing",
    "mini_vllm.worker.toy_runner",
    # lab 03-05's pieces, looked up where the server makes them
    "mini_vllm.engine.output_processor",
    "mini_vllm.engine.async_llm",
    "mini_vllm.entrypoints.openai.api_server",
    # lab 04-01's: the core's busy loop and its codec, the client's verdict
    "mini_vllm.engine.serial_utils",
    "mini_vllm.engine.core_proc",
    "mini_vllm.engine.core_client",
    # lab 04-05's: the size check and the cut, where the executor starts each rank
    "mini_vllm.executor.multiproc_executor",
    # lab 04-06's: the connector, looked up where the engine connects it
    "mini_vllm.distributed.kv_transfer",
    "mini_vllm.worker.kv_connector_model_runner_mixin",
    # lab 04-07's: the router, where RoutedEngines and the exam's engines route
    "mini_vllm.entrypoints.router",
)
GPU_ONLY_LABS = ("02-06",)
# Lab 02-07's pieces: the engine calls them only with its Triton attention backend, and only
# where Triton installs (Linux).
TRITON_MODULE = "mini_vllm.attention.triton_unified"
BACKEND_NOTES = {"02-07": "run by --attention-backend triton"}


class CompositionError(Exception):
    """The requested composition cannot be built (a lab name, a starter that does not load)."""


def _parts(lab: Lab, notebook: bool) -> tuple[str, ...]:
    extra = tuple(lab.meta.get("notebook", ())) if notebook else ()
    return tuple(dict.fromkeys(lab.engine_parts + extra))


def engine_labs(labs: list[Lab] | None = None) -> list[Lab]:
    """The labs that contribute to the engine, in course order."""
    return [lab for lab in (labs if labs is not None else discover()) if lab.engine_parts]


@dataclass
class Part:
    """One engine piece: which lab builds it, and whether the composed engine runs the student's."""

    lab_id: str
    name: str
    yours: bool
    note: str = ""


@dataclass
class Composition:
    """What :func:`compose` did: the labs taken from the student and every piece's origin."""

    student_labs: tuple[str, ...]
    parts: list[Part] = field(default_factory=list)
    objects: dict[tuple[str, str], object] = field(default_factory=dict)

    def lab_rows(self) -> list[tuple[str, str, str]]:
        """(lab id, "yours"/"reference", the names) per engine lab."""
        rows: dict[str, list[Part]] = {}
        for p in self.parts:
            rows.setdefault(p.lab_id, []).append(p)
        out = []
        for lab_id, parts in rows.items():
            origin = "yours" if parts[0].yours else "reference"
            note = next((p.note for p in parts if p.note), "")
            names = ", ".join(p.name for p in parts)
            out.append((lab_id, origin + (f" ({note})" if note else ""), names))
        return out


_composed: Composition | None = None


def _mini_vllm_modules() -> list:
    """mini_vllm's modules, and those of the private copies of it (``mini_vllm_<name>``) that
    ``course check``'s stand-in students hold: a stand-in copies whole reference modules (the
    base classes a starter imports, say), so a later lab's piece must reach its names too, as
    it reaches mini_vllm's."""
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and name.split(".")[0].startswith("mini_vllm")
    ]


def _rebind(old: object, new: object) -> int:
    """Point every module-level name in mini_vllm that holds ``old`` at ``new``; returns how
    many bindings changed."""
    changed = 0
    for module in _mini_vllm_modules():
        name = module.__name__
        stand_in = name.split(".")[0] != "mini_vllm"
        if stand_in and getattr(old, "__module__", None) == name:
            continue  # a stand-in's own definition stays its own, as a student's file does
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            if value is old:
                namespace[attr] = new
                changed += 1
    return changed


def _extend(base: type, reference: type, members: list[str]) -> type:
    """``base`` with the reference's versions of ``members`` (a lab that extends ``base``)."""
    namespace = {m: reference.__dict__[m] for m in members}
    namespace["__doc__"] = base.__doc__
    namespace["__module__"] = base.__module__
    return type(base.__name__, (base,), namespace)


def with_super_of(func: object, cls: type) -> object:
    """``func`` (a method written in some class) with its zero-argument ``super()`` meaning
    ``cls``'s: its ``__class__`` cell is the one thing that names the class it was written in.
    Anything that is not such a function comes back as it is."""
    code = getattr(func, "__code__", None)
    if code is None or "__class__" not in code.co_freevars:
        return func
    cell = types.CellType(cls)
    closure = tuple(cell if var == "__class__" else c
                    for var, c in zip(code.co_freevars, func.__closure__, strict=True))
    new = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, closure)
    new.__kwdefaults__, new.__doc__ = func.__kwdefaults__, func.__doc__
    new.__qualname__ = func.__qualname__
    return new


def _rebase(cls: type, bases: tuple[type, ...]) -> type:
    """``cls`` rebuilt on ``bases``: the same members, ``super()`` in them meaning the new class."""
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    new = type(cls.__name__, bases, namespace)
    for name, value in namespace.items():
        rebound = with_super_of(value, new)
        if rebound is not value:
            setattr(new, name, rebound)
    return new


def compose(student_labs: list[str] | tuple[str, ...], *, gpu: bool = False,
            notebook: bool = False) -> Composition:
    """Make this process's mini_vllm run the student's pieces of ``student_labs`` (lab ids).

    Call it once per process, before building an engine. ``gpu``: also take lab 02-06's
    kernels (they serve decode only on a CUDA device). ``notebook``: also the names the phase
    notebooks draw with (``notebook`` in labs.toml). Raises :class:`CompositionError` for an
    unknown lab, a lab that builds no engine piece, or a starter that does not load.
    """
    global _composed
    if _composed is not None:
        raise CompositionError("compose() already ran in this process; start a fresh one")
    labs = [lab for lab in discover() if _parts(lab, notebook)]
    by_id = {lab.id: lab for lab in labs}
    wanted = tuple(dict.fromkeys(student_labs))
    for lab_id in wanted:
        if lab_id not in by_id:
            known = ", ".join(by_id)
            raise CompositionError(
                f"lab {lab_id!r} builds no piece of the engine; engine labs: {known}"
            )
    for name in ENGINE_MODULES:
        importlib.import_module(name)
    if importlib.util.find_spec("triton") is not None:
        importlib.import_module(TRITON_MODULE)
    if gpu:
        importlib.import_module("mini_vllm.csrc.ops")

    # The reference objects, read before anything is rebound (solution.py re-exports them).
    reference = {lab.id: load_module(lab.path, "solution", lab.id) for lab in labs}
    current: dict[int, object] = {}  # id(reference object) -> the object the engine runs now
    result = Composition(student_labs=wanted)

    for lab in labs:
        gpu_only = lab.id in GPU_ONLY_LABS
        yours = lab.id in wanted and (gpu or not gpu_only)
        note = ("used only for decode on a CUDA GPU" if gpu_only and not gpu
                else BACKEND_NOTES.get(lab.id, ""))
        starter = None
        if yours:
            try:
                starter = load_module(lab.path, "starter", lab.id)
            except Exception as exc:  # LabImplError carries the one-line reason
                raise CompositionError(f"lab {lab.id}: {exc}") from exc
        extends = lab.meta.get("extends", {})
        for name in _parts(lab, notebook):
            ref = getattr(reference[lab.id], name)
            now = current.get(id(ref), ref)
            if starter is not None:
                new = getattr(starter, name, None)
                if new is None:
                    raise CompositionError(
                        f"lab {lab.id}: starter.py has no {name!r}; keep the names it declares"
                    )
            elif name in extends and now is not ref:
                new = _extend(now, ref, extends[name])
            elif isinstance(ref, type) and now is ref and any(
                    current.get(id(b), b) is not b for b in ref.__bases__):
                new = _rebase(ref, tuple(current.get(id(b), b) for b in ref.__bases__))
            else:
                new = now
            if new is not now:
                if not _rebind(now, new) and not gpu_only:
                    raise CompositionError(
                        f"lab {lab.id}: no mini_vllm module uses {name!r}; course/labs/labs.toml "
                        "lists a name the engine does not take"
                    )
                current[id(ref)] = new
            result.parts.append(Part(lab.id, name, yours, note))
            result.objects[(lab.id, name)] = new
    _composed = result
    return result


class Pieces:
    """What a notebook draws with: the composition, and each lab's module (yours or the
    reference's) for labs whose pieces are not in mini_vllm (a simulator, an exercise)."""

    def __init__(self, composition: Composition | None, yours: set[str]) -> None:
        self.composition = composition
        self.yours = yours

    def module(self, lab_id: str):
        """The lab's starter.py when it is yours (finished), else its solution.py."""
        lab = next((lab for lab in discover() if lab.id == lab_id), None)
        if lab is None:
            raise CompositionError(f"no lab {lab_id!r}")
        impl = "starter" if lab_id in self.yours else "solution"
        return load_module(lab.path, impl, lab.id)


def use_pieces(yours: bool, phase: str) -> Pieces:
    """The switch at the top of phase ``phase``'s notebook.

    With ``yours`` false, everything drawn is the reference's. With ``yours`` true, the pieces of
    every *finished* lab (every task written, every graded test passing; the same rule and cache
    as ``python -m course engine``) replace the reference's, for the engine labs and this phase's
    labs, and a table says which are yours. Changing the switch needs a fresh kernel.
    """
    if not yours:
        print("Drawing the reference's pieces. Set YOURS = True (and restart the kernel) to draw "
              "your own finished labs' pieces.")
        return Pieces(None, set())
    from course.labs.results import finished_labs

    labs = [lab for lab in discover()
            if (lab.engine_parts or lab.phase == phase) and lab.id not in GPU_ONLY_LABS]
    status = finished_labs(labs)
    mine = sorted(i for i, why in status.items() if not why)
    engine_ids = {lab.id for lab in engine_labs()}
    composition = _composed
    if composition is None:
        composition = compose([i for i in mine if i in engine_ids], notebook=True)
    elif set(composition.student_labs) != {i for i in mine if i in engine_ids}:
        raise CompositionError("this kernel already drew other pieces; restart it")
    for lab in labs:
        why = status.get(lab.id, "")
        print(f"  lab {lab.id}: {'yours' if not why else 'reference (' + why + ')'}")
    return Pieces(composition, set(mine))


def composed() -> Composition | None:
    """The composition this process runs, if :func:`compose` ran."""
    return _composed
