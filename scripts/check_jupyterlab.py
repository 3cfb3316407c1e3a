"""Open the phase notebooks in a real JupyterLab, as a student would, and run them.

    python scripts/check_jupyterlab.py [--screenshots DIR] [--browser PATH]

Takes the committed tree (``git archive HEAD``) into a temporary folder, starts
``jupyter lab`` from its root on the loopback interface (this environment's JupyterLab, from
requirements.txt), opens each ``phase-*/notebook.ipynb`` in headless Chromium, clicks
*Run > Run All Cells*, and waits until every cell has run. It fails when a cell writes to stderr
or raises, when a notebook draws fewer than 3 plots, or when the kernel is not this
environment's Python. One screenshot per notebook. Not part of CI (it takes a few minutes and
tests/test_notebooks.py runs the same notebooks with the same kernel); run it after changing the
notebooks or the requirements. Needs requirements-site.txt (Playwright) and Chromium.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course.site.check import CHROMIUM_ARGS, find_browser  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url: str, timeout: float = 180) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"JupyterLab did not answer at {url} within {timeout:.0f} s")


def run_notebook(page, base: str, token: str, rel: str, shot: Path) -> list[str]:
    problems = []
    panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
    page.goto(f"{base}lab/workspaces/check-{shot.stem}/tree/{rel}?reset&token={token}",
              timeout=180_000)
    page.locator(f"{panel} .jp-Cell").first.wait_for(timeout=180_000)
    time.sleep(3)  # cells run once the kernel is up; Run All queues them until then
    page.get_by_role("menuitem", name="Run").click()
    page.get_by_text("Run All Cells", exact=True).click()
    start = time.time()
    time.sleep(2)
    while time.time() - start < 300:
        if not page.locator(f"{panel} .jp-InputPrompt:has-text('[*]')").count():
            break
        time.sleep(1)
    else:
        problems.append(f"{rel}: still running after 300 s")
    plots = page.locator(f"{panel} .jp-OutputArea-output img").count()
    errors = page.locator(f"{panel} [data-mime-type='application/vnd.jupyter.stderr'], "
                          f"{panel} .jp-OutputArea-output[data-mime-type="
                          "'application/vnd.jupyter.error']").all_inner_texts()
    kernel = page.locator(".jp-Toolbar-kernelName").first.inner_text()
    if plots < 3:
        problems.append(f"{rel}: {plots} plots")
    if errors:
        problems.append(f"{rel}: errors: {[e[:300] for e in errors]}")
    if "Python 3" not in kernel:
        problems.append(f"{rel}: kernel {kernel!r}")
    page.screenshot(path=str(shot))
    print(f"  {rel}: {plots} plots, kernel {kernel}, {time.time() - start:.0f} s"
          f"{'' if not problems else ' -- ' + '; '.join(problems)}")
    return problems


def main() -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshots", default=str(ROOT / "build" / "jupyterlab-screenshots"))
    parser.add_argument("--browser")
    args = parser.parse_args()
    shots = Path(args.screenshots)
    shots.mkdir(parents=True, exist_ok=True)
    browser = find_browser(args.browser)
    jupyter = Path(sys.executable).with_name("jupyter")
    token, port = secrets.token_hex(8), free_port()
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mini-vllm-jlab-") as tmp:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        cmd = [str(jupyter), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               f"--ServerApp.token={token}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        server = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}/"
        try:
            wait_for_server(f"{base}api/status?token={token}")
            notebooks = sorted(p.relative_to(tmp).as_posix()
                               for p in Path(tmp).glob("phase-*/notebook.ipynb"))
            print(f"JupyterLab from the root of a copy of HEAD; {len(notebooks)} notebooks:")
            with sync_playwright() as pw:
                b = pw.chromium.launch(executable_path=browser, args=CHROMIUM_ARGS)
                page = b.new_page(viewport={"width": 1400, "height": 1000})
                for rel in notebooks:
                    shot = shots / f"{rel.split('/')[0]}.png"
                    problems += run_notebook(page, base, token, rel, shot)
                b.close()
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    print(f"screenshots in {shots}/")
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    print("Every phase notebook runs in JupyterLab.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
