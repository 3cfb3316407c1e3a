"""The course site: the READMEs, the figures and the executed phase notebooks, built with MkDocs.

    python -m course.site build [--repo-url URL] [--site-url URL]   build/site/, strictly
    python -m course.site serve                                     build, then preview locally
    python -m course.site check [--screenshots DIR]                 the built site in Chromium

``build`` stages the pages in ``build/site-src/`` (nothing is written into the repository's own
folders): the root README is the home page; each ``phase-*/README.md`` a section's index, with
the phase's ``figures/`` and its ``notebook.ipynb`` executed top to bottom (as
tests/test_notebooks.py runs it); each lab's README a page of its phase. Phases and labs are
discovered, so a new lab folder or phase appears without touching this file. While staging,
links are rewritten for the site:

* a link to a README or a folder that has one goes to that page;
* ``path:line @ vX.Y.Z`` upstream references become links to that file and line of the pinned
  vLLM release on GitHub;
* a link to another file of the repository goes to the file in the course's repository
  (``--repo-url``, e.g. the fork's GitHub address) and is plain text without one; a link to a
  lab's ``solution.py`` is always plain text: the site teaches, the labs are done in the
  repository, and no starter or solution file is copied to the site (checked after staging).

Then ``mkdocs build --strict`` (site/mkdocs.yml, with the navigation added) fails on a broken
link, a missing page or a missing image.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.labs.catalog import REPO_ROOT, discover
from course.upstream.refs import REF_RE

BUILD = REPO_ROOT / "build"
STAGE = BUILD / "site-src"
SITE = BUILD / "site"
TEMPLATE = REPO_ROOT / "site"
UPSTREAM_BLOB = "https://github.com/vllm-project/vllm/blob/v{version}/{file}#L{line}"
# Files students write or peek at: never copied to the site, never linked from it.
NOT_PUBLISHED = ("solution.py",)
LAB_CODE = ("starter.py", "solution.py", "starter.cu")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(\s+\"[^\"]*\")?\)")


@dataclass
class Page:
    source: Path  # in the repository
    target: str  # path in the staged docs folder
    title: str


@dataclass
class SitePlan:
    """Every page of the site, and the navigation."""

    pages: dict[Path, Page] = field(default_factory=dict)  # repository file -> page
    nav: list = field(default_factory=list)
    notebooks: list[tuple[Path, str]] = field(default_factory=list)  # (source, target)
    assets: list[tuple[Path, str]] = field(default_factory=list)


def _title(readme: Path, fallback: str) -> str:
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return fallback


def plan(root: Path = REPO_ROOT) -> SitePlan:
    """The pages: home, contributing, and per phase its README, notebook, figures and labs."""
    sp = SitePlan()
    home = Page(root / "README.md", "index.md", "Home")
    sp.pages[home.source] = home
    sp.nav.append({"Home": home.target})
    labs = discover(root)
    for phase_dir in sorted(p for p in root.glob("phase-*") if (p / "README.md").is_file()):
        rel = phase_dir.name
        readme = phase_dir / "README.md"
        title = _title(readme, rel)
        page = Page(readme, f"{rel}/index.md", title)
        sp.pages[readme] = page
        section: list = [page.target]
        notebook = phase_dir / "notebook.ipynb"
        if notebook.is_file():
            sp.notebooks.append((notebook, f"{rel}/notebook.ipynb"))
            # Named with its phase: search results show the page title alone.
            number = rel.split("-")[1] if rel.count("-") else rel
            section.append({f"Phase {number} notebook": f"{rel}/notebook.ipynb"})
        for fig in sorted((phase_dir / "figures").glob("*")):
            sp.assets.append((fig, f"{rel}/figures/{fig.name}"))
        for lab in labs:
            if lab.path.parent.parent != phase_dir:
                continue
            lab_readme = lab.path / "README.md"
            lab_rel = lab_readme.parent.relative_to(root).as_posix()
            page = Page(lab_readme, f"{lab_rel}/index.md", lab.title)
            sp.pages[lab_readme] = page
            section.append({f"{lab.id} {_short(lab.title)}": page.target})
        sp.nav.append({_short(title): section})
    contributing = root / "CONTRIBUTING.md"
    if contributing.is_file():
        page = Page(contributing, "contributing.md", "Writing a lab")
        sp.pages[contributing] = page
        sp.nav.append({"For course authors": page.target})
    return sp


def _short(title: str) -> str:
    """'Lab 02-01: The paged block allocator' -> 'The paged block allocator'."""
    return title.split(": ", 1)[1] if ": " in title else title


def upstream_url(m: re.Match) -> str:
    return UPSTREAM_BLOB.format(version=m["version"], file=m["file"], line=m["line"])


class Rewriter:
    """Rewrites one README's links for the site (see the module docstring)."""

    def __init__(self, sp: SitePlan, root: Path, repo_url: str | None) -> None:
        self.sp, self.root, self.repo_url = sp, root.resolve(), repo_url
        self.assets = {(root / t).resolve() for _, t in sp.assets} | {
            src.resolve() for src, _ in sp.assets
        }
        self.notebooks = {src.resolve(): t for src, t in sp.notebooks}

    def page_of(self, target: Path) -> str | None:
        """The staged page for a repository path (a README, a folder with one, a notebook)."""
        if target.is_dir():
            target = target / "README.md"
        page = self.sp.pages.get(target)
        if page is not None:
            return page.target
        return self.notebooks.get(target)

    def link(self, page: Page, m: re.Match) -> str:
        bang, text, href, title = m[1], m[2], m[3], m[4] or ""
        if re.match(r"^[a-z]+:|^#|^/", href):
            return m[0]
        path, _, anchor = href.partition("#")
        target = (page.source.parent / path).resolve()
        here = Path(page.target).parent
        staged = self.page_of(target)
        if staged is not None:
            new = os.path.relpath(staged, here).replace(os.sep, "/")
            return f"{bang}[{text}]({new}{'#' + anchor if anchor else ''}{title})"
        if bang and target.is_file():
            return m[0]  # an image staged beside the page (phase figures)
        try:
            rel = target.relative_to(self.root).as_posix()
        except ValueError:
            return m[0]
        if target.name in NOT_PUBLISHED or not target.exists() or not self.repo_url:
            return text  # not on the site
        kind = "tree" if target.is_dir() else "blob"
        return f"{bang}[{text}]({self.repo_url.rstrip('/')}/{kind}/HEAD/{rel}{title})"

    def text(self, page: Page, text: str) -> str:
        """Rewrite a Markdown text: links and upstream references outside fenced code."""
        out, fenced = [], False
        for line in text.splitlines(keepends=True):
            if _FENCE.match(line):
                fenced = not fenced
                out.append(line)
                continue
            out.append(line if fenced else self.line(page, line))
        return "".join(out)

    def line(self, page: Page, line: str) -> str:
        spans = [m.span() for m in _CODE_SPAN.finditer(line)]

        def in_code(i: int) -> bool:
            return any(a <= i < b for a, b in spans)

        out, pos = [], 0
        for m in _LINK.finditer(line):
            if in_code(m.start()):
                continue
            out.append(self.unlinked(line[pos:m.start()]))
            out.append(self.link(page, m))
            pos = m.end()
        out.append(self.unlinked(line[pos:]))
        return "".join(out)

    def unlinked(self, text: str) -> str:
        """Text with no link in it: a code span or prose holding an upstream reference becomes
        a link to that line of the pinned release."""
        out, pos = [], 0
        for m in _CODE_SPAN.finditer(text):
            out.append(self.prose(text[pos:m.start()]))
            ref = REF_RE.search(m[2])
            out.append(f"[{m[0]}]({upstream_url(ref)})" if ref else m[0])
            pos = m.end()
        out.append(self.prose(text[pos:]))
        return "".join(out)

    @staticmethod
    def prose(text: str) -> str:
        out, pos = [], 0
        for m in REF_RE.finditer(text):
            out.append(text[pos:m.start()])
            out.append(f"[{m[0]}]({upstream_url(m)})")
            pos = m.end()
        out.append(text[pos:])
        return "".join(out)


def execute_notebook(source: Path, target: Path, timeout: int = 600) -> float:
    """Execute ``source`` top to bottom in its own folder (as tests/test_notebooks.py does) and
    write the executed copy to ``target``; the repository's notebook is not touched."""
    import nbclient
    import nbformat

    start = time.perf_counter()
    nb = nbformat.read(source, as_version=4)
    env_backend = os.environ.pop("MPLBACKEND", None)  # let the kernel's inline backend render
    try:
        nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3",
            resources={"metadata": {"path": str(source.parent)}},
        ).execute()
    finally:
        if env_backend is not None:
            os.environ["MPLBACKEND"] = env_backend
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return time.perf_counter() - start


def lab_code_leaks(stage: Path, root: Path = REPO_ROOT, run: int = 4) -> list[str]:
    """Staged pages that contain a lab's starter or solution code: a file of that name, or
    ``run`` consecutive substantial lines of one."""
    problems = [f"{p.relative_to(stage)} is a lab code file" for p in stage.rglob("*")
                if p.name in LAB_CODE]
    pages = {p: _norm_lines(p.read_text(encoding="utf-8", errors="replace"))
             for p in stage.rglob("*") if p.suffix in (".md", ".ipynb", ".html")}
    for code in sorted(root.glob("phase-*/labs/*/*")):
        if code.name not in LAB_CODE:
            continue
        lines = [ln for ln in _norm_lines(code.read_text(encoding="utf-8")) if len(ln) >= 20]
        windows = {tuple(lines[i:i + run]) for i in range(len(lines) - run + 1)}
        for page, text in pages.items():
            joined = [ln for ln in text if len(ln) >= 20]
            found = any(tuple(joined[i:i + run]) in windows for i in range(len(joined) - run + 1))
            if found:
                problems.append(f"{page.relative_to(stage)} contains code of "
                                f"{code.relative_to(root)}")
    return problems


def _norm_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def executed_copy(source: Path, executed: Path | None):
    """The executed copy of ``source`` in ``executed`` (``<phase folder>.ipynb``, written by
    tests/test_notebooks.py), if it exists and its cells are the repository's cells."""
    import nbformat

    if executed is None:
        return None
    path = executed / f"{source.parent.name}.ipynb"
    if not path.is_file():
        return None
    run = nbformat.read(path, as_version=4)
    repo = nbformat.read(source, as_version=4)
    same = [(c.cell_type, c.source) for c in run.cells] == [
        (c.cell_type, c.source) for c in repo.cells
    ]
    has_outputs = any(c.get("outputs") for c in run.cells if c.cell_type == "code")
    return path if same and has_outputs else None


def stage(repo_url: str | None, execute: bool = True, root: Path = REPO_ROOT,
          out: Path = STAGE, executed: Path | None = None) -> tuple[SitePlan, dict[str, float]]:
    """Write the site's sources into ``out``; returns the plan and the notebooks' run times.
    ``executed``: a folder of notebooks already executed from this checkout (reused when their
    cells are the repository's)."""
    sp = plan(root)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rewriter = Rewriter(sp, root, repo_url)
    for page in sp.pages.values():
        dest = out / page.target
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(rewriter.text(page, page.source.read_text(encoding="utf-8")),
                        encoding="utf-8")
    for src, target in sp.assets:
        (out / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / target)
    shutil.copytree(TEMPLATE / "assets", out / "assets")
    times = {}
    for src, target in sp.notebooks:
        ready = executed_copy(src, executed)
        if ready is not None:
            print(f"  {src.relative_to(root)}: the run in {ready}", file=sys.stderr)
            shutil.copyfile(ready, out / target)
        elif execute:
            print(f"  executing {src.relative_to(root)} ...", file=sys.stderr, flush=True)
            times[target] = execute_notebook(src, out / target)
        else:
            shutil.copyfile(src, out / target)
    return sp, times


def write_config(sp: SitePlan, site_url: str | None, repo_url: str | None,
                 site_dir: Path = SITE, stage_dir: Path = STAGE) -> Path:
    import yaml

    config = yaml.safe_load((TEMPLATE / "mkdocs.yml").read_text(encoding="utf-8"))
    config["docs_dir"] = str(stage_dir)
    config["site_dir"] = str(site_dir)
    config["nav"] = sp.nav
    if site_url:
        config["site_url"] = site_url
    if repo_url:
        config["repo_url"] = repo_url
    path = stage_dir.parent / "mkdocs.site.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def build(args) -> int:
    start = time.perf_counter()
    executed = Path(args.executed) if args.executed else None
    sp, times = stage(args.repo_url, execute=not args.no_execute, executed=executed)
    staged = time.perf_counter()
    leaks = lab_code_leaks(STAGE)
    if leaks:
        for leak in leaks:
            print(f"  - {leak}", file=sys.stderr)
        print("The site must not carry lab starters or solutions.", file=sys.stderr)
        return 1
    config = write_config(sp, args.site_url, args.repo_url)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f", str(config)]
    if args.quiet:
        cmd.append("--quiet")
    # Material 9.7+ prints a banner about MkDocs 2.0 on every build; it is not a warning.
    # Run in build/: mkdocs-jupyter keeps a conversion cache in ./.cache.
    proc = subprocess.run(cmd, cwd=BUILD, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    end = time.perf_counter()
    nb = ", ".join(f"{t} {s:.1f} s" for t, s in times.items())
    print(f"site: {len(sp.pages)} pages, {len(sp.notebooks)} notebooks, {len(sp.assets)} figures; "
          f"staging {staged - start:.1f} s (notebooks: {nb or 'not executed'}), "
          f"mkdocs {end - staged:.1f} s, total {end - start:.1f} s -> "
          f"{SITE.relative_to(REPO_ROOT)}/", file=sys.stderr)
    if proc.returncode:
        print("mkdocs build --strict failed (see above): a broken link, a missing page or "
              "image.", file=sys.stderr)
    timing = {"staging_s": round(staged - start, 1), "mkdocs_s": round(end - staged, 1),
              "total_s": round(end - start, 1),
              "notebooks_s": {k: round(v, 1) for k, v in times.items()}}
    (BUILD / "site-build-time.json").write_text(json.dumps(timing, indent=1), encoding="utf-8")
    return proc.returncode


def serve(args) -> int:
    code = build(args)
    if code:
        return code
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(SITE))
    with http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler) as httpd:
        print(f"Serving the site at http://127.0.0.1:{httpd.server_address[1]}/ (Ctrl-C stops)")
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.site", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "serve"):
        p = sub.add_parser(name, help=f"{name} the site (build/site/)")
        p.add_argument("--repo-url", default=os.environ.get("COURSE_REPO_URL"),
                       help="the course repository on GitHub (links to its files); default: "
                       "$COURSE_REPO_URL, else files are not linked")
        p.add_argument("--site-url", help="the site's public address (canonical links)")
        p.add_argument("--no-execute", action="store_true",
                       help="stage the notebooks without running them (no plots)")
        p.add_argument("--executed", metavar="DIR",
                       help="notebooks already executed from this checkout (tests/test_notebooks"
                       ".py writes them there with COURSE_EXECUTED_NOTEBOOKS=DIR); used when "
                       "their cells are the repository's, else the notebook is executed")
        p.add_argument("--quiet", action="store_true", help="only mkdocs's warnings")
        if name == "serve":
            p.add_argument("--port", type=int, default=8000)
    p = sub.add_parser("check", help="open the built site in headless Chromium")
    p.add_argument("--site", default=str(SITE), help="the built site (default build/site)")
    p.add_argument("--screenshots", default=str(BUILD / "site-screenshots"),
                   help="folder for the screenshots")
    p.add_argument("--browser", help="Chromium executable (default: chromium, chromium-browser, "
                   "google-chrome on PATH)")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args)
    if args.command == "serve":
        return serve(args)
    from course.site.check import check

    return check(Path(args.site), Path(args.screenshots), args.browser)
