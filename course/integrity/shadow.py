"""Stand-in students: every engine lab "finished" with a private copy of the reference's code.

:func:`shadow_tree` copies the course to a folder and writes each engine lab's ``starter.py`` the
way a student's finished starter looks to :func:`course.engine.compose.compose`: the lab's pieces
are its own objects, defined in a private copy (the package ``mini_vllm_shadow_PP_LL``) of the
reference modules that define them, while every piece of *another* lab is imported from
``mini_vllm``, as a real starter does. Composed with every engine lab "yours", such an engine must
pass the exam, although none of its pieces is a reference object.

With a planted bug (an edit of a ``mini_vllm`` file, from a lab's planted bugs), the edit goes into
that lab's private copy only: the lab's pieces are wrong, everything else is right. The exam must
then fail, and running one lab at a time must blame that lab. ``python -m course check`` does this
for every planted bug of the engine labs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from course.engine.compose import engine_labs
from course.integrity.bugs import PlantedBug
from course.labs.catalog import REPO_ROOT, Lab, copy_ignore
from course.labs.loader import load_module


class NotAnEnginePiece(ValueError):
    """The planted bug edits a file that defines none of its lab's engine pieces."""


def shadow_package(lab: Lab) -> str:
    return "mini_vllm_shadow_" + lab.id.replace("-", "_")


def _piece_modules(labs: list[Lab]) -> dict[str, dict[str, str]]:
    """{lab id: {engine name: the mini_vllm module that defines its reference object}}."""
    out = {}
    for lab in labs:
        solution = load_module(lab.path, "solution", lab.id)
        out[lab.id] = {n: _defined_in(getattr(solution, n)) for n in lab.engine_parts}
    return out


def _defined_in(obj: object) -> str:
    # A Triton kernel's own __module__ is Triton's; the function it was made from knows.
    return getattr(obj, "fn", obj).__module__


def _module_file(root: Path, module: str) -> Path:
    return root / (module.replace(".", "/") + ".py")


def shadow_tree(dest: Path, bug: tuple[str, PlantedBug] | None = None,
                root: Path = REPO_ROOT) -> Path:
    """Build the tree at ``dest`` (which must not exist) and return it.

    ``bug`` is ``(lab id, planted bug)``; it must edit a module that defines one of that lab's
    engine pieces (:class:`NotAnEnginePiece` otherwise).
    """
    labs = [lab for lab in engine_labs() if lab.id != "02-06"]
    modules = _piece_modules(labs)
    owner = {}  # (module, name) -> lab id, for every engine piece
    for lab_id, names in modules.items():
        for name, module in names.items():
            owner.setdefault((module, name), lab_id)
    shutil.copytree(root, dest, ignore=copy_ignore)
    if bug is not None:
        bug_lab, planted = bug
        bug_module = planted.file[:-3].replace("/", ".")
        if bug_lab not in modules or bug_module not in modules[bug_lab].values():
            raise NotAnEnginePiece(
                f"{planted.file} defines no engine piece of lab {bug_lab}"
            )
    bug_module = bug[1].file[:-3].replace("/", ".") if bug else None
    for lab in labs:
        package = shadow_package(lab)
        own = sorted(set(modules[lab.id].values()))
        pattern = re.compile(r"\b(" + "|".join(re.escape(m) for m in own) + r")\b")

        def rename(text: str, package: str = package, pattern: re.Pattern = pattern) -> str:
            return pattern.sub(lambda hit: package + hit.group(1)[len("mini_vllm"):], text)
        for module in own:
            target = _module_file(dest / package, module[len("mini_vllm."):])
            target.parent.mkdir(parents=True, exist_ok=True)
            for parent in [target.parent, *target.parent.parents]:
                if parent == dest:
                    break
                (parent / "__init__.py").touch()
            text = _module_file(root, module).read_text(encoding="utf-8")
            if bug is not None and bug[0] == lab.id and bug_module == module:
                if text.count(planted.find) != 1:
                    raise ValueError(f"planted bug {planted.name}: `find` must occur once")
                text = text.replace(planted.find, planted.replace, 1)
            text = rename(text)
            # Another lab's pieces defined in this module: taken from mini_vllm, as a starter does.
            others = sorted(n for (mod, n), lab_id in owner.items()
                            if mod == module and lab_id != lab.id and n not in lab.engine_parts)
            if others:
                text += (f"\n\n# Other labs' pieces come from mini_vllm, as in a real starter.\n"
                         f"from {module} import {', '.join(others)}  # noqa: E402,F401\n")
            target.write_text(text, encoding="utf-8")
        starter = rename((lab.path / "solution.py").read_text(encoding="utf-8"))
        for name, members in lab.meta.get("extends", {}).items():
            module = package + modules[lab.id][name][len("mini_vllm"):]
            base_module = modules[lab.id][name]
            body = "\n".join(f"    {m} = _Copy.__dict__[{m!r}]" for m in members)
            starter += (
                f"\n\n# Like the real starter: {name} extends the {name} mini_vllm has now.\n"
                f"from {base_module} import {name} as _Base  # noqa: E402\n"
                f"from {module} import {name} as _Copy  # noqa: E402\n\n\n"
                f"class {name}(_Base):\n{body}\n"
            )
        (dest / lab.rel / "starter.py").write_text(starter, encoding="utf-8")
    return dest
