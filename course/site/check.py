"""The built course site, opened in a real headless Chromium (``python -m course.site check``).

It serves ``build/site`` on the loopback interface and, with Playwright driving the machine's own
Chromium (Playwright's browser download is never used), checks what a reader would notice:

* every page of the navigation loads without a failed request or a script error, and its
  ``<h1>`` is there;
* each phase page and each lab page that embeds figures shows them: every ``<img>`` loaded and
  has a width (an SVG that did not render has none);
* each phase notebook page shows its executed plots (PNG outputs, loaded);
* navigation works: from the home page, the phase tab, then a lab in the phase's menu, by clicks;
* the upstream references are links to the pinned vLLM release;
* search finds a page (type into the search box, a result appears, following it opens the page);
* nothing is fetched from another host (the site works offline).

Screenshots of the home page, every phase page and notebook, one figure of each lab that has
one, the navigation and the search land in the screenshots folder.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
UPSTREAM_PREFIX = "https://github.com/vllm-project/vllm/blob/v"


def find_browser(explicit: str | None) -> str:
    for name in ([explicit] if explicit else ["chromium", "chromium-browser", "google-chrome"]):
        path = shutil.which(name) if name and "/" not in name else name
        if path and Path(path).exists():
            return path
    raise SystemExit(
        "No Chromium found. Install Debian's `chromium` package (apt-get install chromium) or "
        "pass --browser PATH."
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the check reports failures itself
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/"


def nav_pages(site: Path) -> list[str]:
    """Every page of the site: the folders holding an index.html (directory URLs)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if rel.startswith(("assets", "search")) or rel == "404":
            continue
        pages.append("" if rel == "." else rel + "/")
    return pages


class Checker:
    def __init__(self, page, base: str, shots: Path) -> None:
        self.page, self.base, self.shots = page, base, shots
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.external: set[str] = set()
        self.failed: list[str] = []
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("requestfailed", lambda req: self.failed.append(req.url))
        page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.status} {r.url}"))
        # The site must work offline: every request for another host is refused and reported.
        page.route("**/*", self._route)

    def _route(self, route) -> None:
        url = route.request.url
        host = urlparse(url).hostname
        if url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            self.external.add(url)
            route.abort()

    def problem(self, text: str) -> None:
        self.problems.append(text)
        print(f"  FAIL  {text}", file=sys.stderr)

    def ok(self, text: str) -> None:
        self.notes.append(text)
        print(f"  ok    {text}", file=sys.stderr)

    def open(self, rel: str) -> bool:
        self.failed.clear()
        self.errors.clear()
        response = self.page.goto(self.base + rel, wait_until="load")
        if response is None or response.status != 200:
            self.problem(f"/{rel}: HTTP {response.status if response else 'no response'}")
            return False
        self.page.wait_for_load_state("networkidle")
        if self.failed:
            self.problem(f"/{rel}: failed requests {self.failed[:3]}")
        if self.errors:
            self.problem(f"/{rel}: script errors {self.errors[:3]}")
        if not self.page.locator("article h1").count():
            self.problem(f"/{rel}: no <h1> in the page")
        return True

    def images(self, rel: str, selector: str) -> list[dict]:
        """The images matching ``selector``, each scrolled into view so lazy ones load."""
        imgs = self.page.locator(selector)
        out = []
        for i in range(imgs.count()):
            img = imgs.nth(i)
            img.scroll_into_view_if_needed()
            img.evaluate("el => el.decode ? el.decode().catch(() => null) : null")
            info = img.evaluate(
                "el => ({src: el.getAttribute('src').slice(0, 80), complete: el.complete, "
                "w: el.naturalWidth, h: el.naturalHeight, shown: el.getBoundingClientRect().width})"
            )
            if not (info["complete"] and info["w"] > 0 and info["shown"] > 0):
                self.problem(f"/{rel}: image {info['src']} did not render ({info})")
            out.append(info)
        return out

    def shot(self, name: str, full_page: bool = True, element=None) -> None:
        path = self.shots / f"{name}.png"
        self.page.evaluate("window.scrollTo(0, 0)")
        self.page.wait_for_timeout(400)  # Material shows the tabs again once back at the top
        if element is not None:
            element.screenshot(path=str(path))
        else:
            self.page.screenshot(path=str(path), full_page=full_page)


def check(site: Path, shots: Path, browser: str | None = None) -> int:
    from playwright.sync_api import sync_playwright

    if not (site / "index.html").is_file():
        print(f"No built site at {site}; run `python -m course.site build` first.",
              file=sys.stderr)
        return 2
    executable = find_browser(browser)
    if shots.exists():
        shutil.rmtree(shots)
    shots.mkdir(parents=True)
    httpd, base = serve(site)
    start = time.perf_counter()
    pages = nav_pages(site)
    phases = [p for p in pages if p.count("/") == 1 and p.startswith("phase-")]
    print(f"Checking {len(pages)} pages of {site} in {executable} ...", file=sys.stderr)
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            page = b.new_page(viewport={"width": 1280, "height": 900})
            c = Checker(page, base, shots)
            for step in (lambda: _check_pages(c, pages, phases),
                         lambda: _check_navigation(c, phases),
                         lambda: _check_search(c)):
                try:
                    step()
                except Exception as exc:  # a timeout or a missing element: a finding
                    c.problem(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            b.close()
    finally:
        httpd.shutdown()
    if c.external:
        c.problem(f"the site asked other hosts for {len(c.external)} resource(s): "
                  f"{sorted(c.external)[:3]}")
    seconds = time.perf_counter() - start
    print(f"\n{len(pages)} pages checked in {seconds:.1f} s; screenshots in {shots}/ "
          f"({len(list(shots.glob('*.png')))} files).", file=sys.stderr)
    if c.problems:
        print(f"{len(c.problems)} problem(s).", file=sys.stderr)
        return 1
    print("The site renders: pages, figures, notebooks, navigation, search.", file=sys.stderr)
    return 0


def _slug(rel: str) -> str:
    return rel.strip("/").replace("/labs/", "--").replace("/", "--") or "home"


def _check_pages(c: Checker, pages: list[str], phases: list[str]) -> None:
    upstream_links = 0
    for rel in pages:
        if not c.open(rel):
            continue
        figures = c.images(rel, "article img[src$='.svg']")
        upstream_links += c.page.locator(f"article a[href^='{UPSTREAM_PREFIX}']").count()
        if rel in phases:
            if not figures:
                c.problem(f"/{rel}: a phase page without figures")
            c.shot(f"phase--{_slug(rel)}")
            c.ok(f"/{rel}: {len(figures)} figures rendered")
        elif rel.endswith("notebook/"):
            plots = c.images(rel, "article img[src^='data:image/png']")
            if len(plots) < 3:
                c.problem(f"/{rel}: {len(plots)} plots; the executed notebook draws at least 3")
            c.shot(f"notebook--{_slug(rel)}")
            c.ok(f"/{rel}: {len(plots)} notebook plots rendered")
        elif "/labs/" in rel and figures:
            first = c.page.locator("article img[src$='.svg']").first
            c.shot(f"lab--{_slug(rel)}--figure", element=first)
            c.ok(f"/{rel}: {len(figures)} figures rendered")
        elif rel == "":
            c.shot("home", full_page=False)
            c.ok("/: home page")
    if upstream_links == 0:
        c.problem("no upstream reference is a link to the pinned vLLM release")
    else:
        c.ok(f"{upstream_links} links to files and lines of the pinned vLLM release")


def _check_navigation(c: Checker, phases: list[str]) -> None:
    """Home -> a phase tab -> a lab in that phase's menu, by clicking."""
    if len(phases) < 2:
        return
    c.open("")
    target = phases[1]
    tab = c.page.locator(f"nav.md-tabs a[href$='{target}']").first
    if not tab.count():
        c.problem(f"no navigation tab for /{target}")
        return
    tab.click()
    c.page.wait_for_url(f"**/{target}")
    c.page.wait_for_load_state("networkidle")
    lab_link = c.page.locator(
        "nav.md-nav--primary a.md-nav__link[href*='labs/'] >> visible=true"
    ).first
    if not lab_link.count():
        c.problem(f"/{target}: the menu lists no lab")
        return
    href = lab_link.get_attribute("href")
    lab_link.click()
    c.page.wait_for_load_state("networkidle")
    h1 = c.page.locator("article h1").first.inner_text().rstrip("¶")
    if "/labs/" not in c.page.url or not h1.startswith("Lab"):
        c.problem(f"clicking {href} from /{target} opened {c.page.url} ({h1!r})")
        return
    c.shot("navigation--phase-tab-then-lab", full_page=False)
    c.ok(f"navigation: home -> tab /{target} -> {c.page.url[len(c.base) - 1:]} ({h1})")


def _check_search(c: Checker, query: str = "free queue") -> None:
    c.open("")
    box = c.page.locator("input.md-search__input")
    box.click()
    box.press_sequentially(query, delay=30)  # Material's search listens to key events
    results = c.page.locator(".md-search-result__item")
    try:
        results.first.wait_for(timeout=15000)
    except Exception:
        c.problem(f"search for {query!r} found nothing")
        return
    n = results.count()
    meta = c.page.locator(".md-search-result__meta").first.inner_text()
    c.shot("search--free-queue", full_page=False)
    first = c.page.locator(".md-search-result__link").first
    first.click()
    c.page.wait_for_load_state("networkidle")
    h1 = c.page.locator("article h1").first.inner_text().rstrip("¶")
    c.ok(f"search {query!r}: {meta}, {n} shown; the first opens {c.page.url[len(c.base) - 1:]} "
         f"({h1})")
