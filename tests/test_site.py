"""The course site's staging: pages are discovered, links and upstream references are rewritten
for the site, and no lab starter or solution is published. (The strict MkDocs build and the
browser check run in .ci/run: `python -m course.site build` and `python -m course.site check`.)"""

from __future__ import annotations

from course.labs.catalog import REPO_ROOT, discover
from course.site.build import Rewriter, lab_code_leaks, plan, stage


def test_every_phase_notebook_and_lab_is_a_page():
    sp = plan()
    targets = {p.target for p in sp.pages.values()}
    for lab in discover():
        assert f"{lab.rel}/index.md" in targets, lab.rel
    phases = sorted(p.name for p in REPO_ROOT.glob("phase-*") if (p / "README.md").is_file())
    sections = [next(iter(entry.values())) for entry in sp.nav[1:1 + len(phases)]]
    for phase, section in zip(phases, sections):
        assert section[0] == f"{phase}/index.md"
        number = phase.split("-")[1]
        assert {f"Phase {number} notebook": f"{phase}/notebook.ipynb"} in section
    assert {t for _, t in sp.assets} == {
        str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("phase-*/figures/*.svg")
    }


def _rewrite(text: str, repo_url: str | None = None, source: str = "phase-02-paged-attention/"
             "labs/lab-01-block-allocator/README.md") -> str:
    sp = plan()
    page = sp.pages[REPO_ROOT / source]
    return Rewriter(sp, REPO_ROOT, repo_url).text(page, text)


def test_upstream_references_become_links_to_the_pinned_release():
    out = _rewrite("| `BlockPool` | `vllm/v1/core/block_pool.py:118 @ v0.11.0` |\n")
    assert ("[`vllm/v1/core/block_pool.py:118 @ v0.11.0`](https://github.com/vllm-project/vllm/"
            "blob/v0.11.0/vllm/v1/core/block_pool.py#L118)") in out
    prose = _rewrite("see vllm/core/block_manager.py:40 @ v0.10.2 for V0\n")
    assert ("(https://github.com/vllm-project/vllm/blob/v0.10.2/vllm/core/block_manager.py#L40)"
            in prose)
    fenced = "```\nupstream: vllm/v1/core/block_pool.py:118 @ v0.11.0\n```\n"
    assert _rewrite(fenced) == fenced


def test_links_go_to_pages_or_the_repository_and_never_to_a_solution():
    text = ("[next lab](../lab-03-kv-cache-manager/README.md), [phase](../../), "
            "[starter](starter.py), [the answer](solution.py), "
            "[`grade.yml`](../../../.github/workflows/grade.yml), [web](https://example.org)\n")
    out = _rewrite(text)
    assert "[next lab](../lab-03-kv-cache-manager/index.md)" in out
    assert "[phase](../../index.md)" in out
    assert "the answer" in out and "solution.py)" not in out
    assert "(starter.py)" not in out and "starter" in out  # no repository: plain text
    assert "[web](https://example.org)" in out
    linked = _rewrite(text, repo_url="https://github.com/me/mini_vllm")
    assert ("[starter](https://github.com/me/mini_vllm/blob/HEAD/phase-02-paged-attention/labs/"
            "lab-01-block-allocator/starter.py)") in linked
    assert "solution.py)" not in linked
    assert "[`grade.yml`](https://github.com/me/mini_vllm/blob/HEAD/.github/workflows/grade.yml)" \
        in linked


def test_staged_site_carries_no_lab_code(tmp_path):
    out = tmp_path / "stage"
    sp, _ = stage(None, execute=False, out=out)
    assert (out / "index.md").is_file()
    assert not lab_code_leaks(out)
    # A page that pastes a solution is caught.
    solution = REPO_ROOT / "phase-02-paged-attention/labs/lab-02-fragmentation/solution.py"
    code = "\n".join(solution.read_text().splitlines()[100:160])
    (out / "index.md").write_text("```python\n" + code + "\n```\n")
    assert any("solution.py" in p for p in lab_code_leaks(out))


def test_navigation_names_each_lab_by_id_and_title():
    sp = plan()
    phase02 = next(entry for entry in sp.nav if "Paged attention" in entry)["Paged attention"]
    assert {"02-01 The paged block allocator":
            "phase-02-paged-attention/labs/lab-01-block-allocator/index.md"} in phase02
