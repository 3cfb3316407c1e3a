"""Load a lab's `starter.py` or `solution.py`, as chosen by the `LAB_IMPL` environment variable.

Tests never import an implementation directly: `lab = load_lab(__file__)` returns a lazy handle
that loads the chosen file from the test's own lab folder the first time an attribute is read.
Loading lazily means a starter that does not import fails each test with one clear message,
instead of breaking test collection for the whole lab.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from course.labs.catalog import lab_for_path

ENV_VAR = "LAB_IMPL"
IMPLS = ("solution", "starter")
DEFAULT_IMPL = "solution"


class LabImplError(Exception):
    """LAB_IMPL names no implementation, or the chosen file does not import."""


def chosen_impl() -> str:
    """The implementation that LAB_IMPL selects; anything but the allowed values is an error."""
    value = os.environ.get(ENV_VAR, DEFAULT_IMPL).strip() or DEFAULT_IMPL
    if value not in IMPLS:
        raise LabImplError(
            f"{ENV_VAR}={value!r} is not a lab implementation; use one of: {', '.join(IMPLS)}"
        )
    return value


def load_script(name: str, path: Path) -> ModuleType:
    """The Python file `path`, which belongs to no package (a benchmark script, a lab's starter
    loaded by a tool), as module `name`; loaded once per process, then taken from sys.modules."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def module_name(lab_id: str, impl: str) -> str:
    """Unique per lab and implementation, so that many labs' files coexist in one process."""
    return f"course_labs.lab_{lab_id.replace('-', '_')}.{impl}"


# Tools load lab files from several threads at once; a module is in sys.modules before it has
# finished executing, so an unlocked second caller could get a half-loaded module.
_LOAD_LOCK = threading.RLock()


def load_module(lab_dir: Path, impl: str, lab_id: str) -> ModuleType:
    with _LOAD_LOCK:
        return _load_module(lab_dir, impl, lab_id)


# mutmut names a mutant after its file's path (`phase-02-....solution.x_func__mutmut_1`) and
# switches it on only in a module of that name: scripts/mutation_test.py sets this variable so
# that a lab-only solution.py is loaded under its path's dotted name.
PATH_NAMES_ENV = "COURSE_MODULE_NAMES_FROM_PATHS"


def _module_name_for(lab_dir: Path, impl: str, lab_id: str) -> str:
    if os.environ.get(PATH_NAMES_ENV):
        from course.labs.catalog import REPO_ROOT

        try:
            rel = (lab_dir / f"{impl}.py").resolve().relative_to(REPO_ROOT.resolve())
            return ".".join(rel.with_suffix("").parts)
        except ValueError:
            pass
    return module_name(lab_id, impl)


def _load_module(lab_dir: Path, impl: str, lab_id: str) -> ModuleType:
    name = _module_name_for(lab_dir, impl, lab_id)
    if name in sys.modules:
        return sys.modules[name]
    path = lab_dir / f"{impl}.py"
    if not path.is_file() and (lab_dir / f"{impl}.pyc").is_file():
        path = lab_dir / f"{impl}.pyc"  # a grading copy keeps the reference as bytecode only
    if not path.is_file():
        raise LabImplError(f"lab {lab_id}: {path} does not exist")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise LabImplError(
            f"lab {lab_id}: {path.name} does not import ({type(exc).__name__}: {exc}, "
            f"at {Path(where.filename).name}:{where.lineno}). Fix that first; every test of "
            f"this lab needs it."
        ) from exc
    return module


def runs_in_student_process(lab_id: str) -> bool:
    """Whether lab `lab_id`'s code runs in a process of its own (course.labs.student_process):
    COURSE_STUDENT_PROCESS is set and the lab's table in labs.toml says
    `student_process = true`. Never in the student's process itself."""
    from course.labs import student_process

    if not student_process.enabled() or student_process.IN_STUDENT_PROCESS:
        return False
    from course.labs.catalog import lab_metadata

    return student_process.every_lab() or bool(
        lab_metadata().get(lab_id, {}).get("student_process"))


class LazyLab:
    """Attribute access loads the lab's chosen implementation once and forwards to it."""

    def __init__(self, lab_dir: Path, lab_id: str, impl: str | None = None):
        self._lab_dir = lab_dir
        self._lab_id = lab_id
        self._impl = impl
        self._module: ModuleType | None = None

    @property
    def impl(self) -> str:
        return self._impl or chosen_impl()

    @property
    def lab_id(self) -> str:
        return self._lab_id

    @property
    def lab_dir(self) -> Path:
        return self._lab_dir

    @property
    def source_path(self) -> Path:
        return self._lab_dir / f"{self.impl}.py"

    def module_loader(self) -> Callable[[], ModuleType]:
        """A picklable callable that loads this implementation, for another process (the
        isolated GPU worker of ``mini_vllm.csrc.isolation``, which takes it as ``where``)."""
        return functools.partial(load_module, self._lab_dir, self.impl, self._lab_id)

    @property
    def in_student_process(self) -> bool:
        return runs_in_student_process(self._lab_id)

    @property
    def module(self) -> ModuleType:
        if self.in_student_process:
            from course.labs import student_process

            # A proxy of the module in this test's student process (started on first use).
            return student_process.current(self._lab_dir, self.impl, self._lab_id,
                                           _load_module).module
        if self._module is None:
            self._module = load_module(self._lab_dir, self.impl, self._lab_id)
        return self._module

    def module_of(self, function) -> ModuleType:
        """The module a function of the lab's implementation lives in (the starter, or the
        mini_vllm module the solution takes it from), for a test that patches a name there."""
        if self.in_student_process:
            from course.labs import student_process

            return student_process.current(self._lab_dir, self.impl, self._lab_id,
                                           _load_module).module_of(
                function)
        return sys.modules[function.__module__]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        module = self.module
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"lab {self._lab_id}: {self.impl}.py has no {name!r}; keep the names the "
                f"lab's starter.py declares"
            ) from None

    def __repr__(self) -> str:
        return f"<lab {self._lab_id} ({self.impl}) from {self._lab_dir}>"


def load_lab(test_file: str | Path, impl: str | None = None) -> LazyLab:
    """The lab implementation for the test file `test_file` (pass `__file__`).

    `impl` overrides LAB_IMPL; by default the choice is read when the module first loads.
    """
    lab = lab_for_path(test_file)
    if impl is not None and impl not in IMPLS:
        raise LabImplError(f"impl={impl!r} is not a lab implementation; use one of: {IMPLS}")
    return LazyLab(lab.path, lab.id, impl)
