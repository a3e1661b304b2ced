"""Open the built documentation site in headless Chromium and check what a reader gets.

    python tools/docs/browser_check.py --screenshots DIR [--site site] [--mkdocs-yml mkdocs.yml]
                                       [--chromium /usr/bin/chromium] [--query TEXT]

Serves the built site folder (``mkdocs build`` output, default ``site/``) on 127.0.0.1 at a free
port from a thread of this process, and opens it with Playwright driving the system's Chromium
(Debian's ``chromium`` package; Playwright's own browser download is never used), headless, with
a fresh profile. Checks:

1. home: the page loads, its title names accel, and the primary navigation lists every page
   and section title of ``nav`` in mkdocs.yml (every top-level one visible);
2. API: the page that renders ``accel.Accelerator`` (found in the built site by the anchor
   mkdocstrings gives it) shows the class heading and the first line of its docstring (read
   from the installed accel);
3. search: ``--query`` (default ``load_checkpoint_and_dispatch``) typed into Material's search
   box lists results, one of them linking to a page that documents the function;
4. benchmarks: every plot image on the Benchmarks page loads;

and, on every page: no console error, no uncaught exception, no failed request, no HTTP error,
and no request to anything but the local server (such requests are blocked and reported: the
site must work offline). Screenshots home.png, api.png, search.png and benchmarks.png go to
``--screenshots``. Exit status 0 when every check passed, else 1 with one line per failure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import inspect
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_SYMBOL = "accel.Accelerator"
QUERY = "load_checkpoint_and_dispatch"
TIMEOUT_MS = 30_000
SETTLE_MS = 600


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve ``folder`` on 127.0.0.1 (a free port) from a thread; yield the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# ---------------------------------------------------------------------------------------------
# What the built site should show
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Nav:
    """What mkdocs.yml's ``nav`` promises the reader."""

    top: list[str]  # titles of the top-level entries that have one
    titles: list[str]  # every title given in the nav
    pages: list[str]  # URL path of every page in the nav, relative to the site root


def read_nav(mkdocs_yml: Path) -> Nav:
    """The titles and pages of ``nav`` in mkdocs.yml (untitled pages: their URL only)."""
    import yaml

    class Loader(yaml.SafeLoader):
        """Reads Material's python tags (``!!python/name:...``) as plain values."""

    def any_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> None:
        return None

    Loader.add_multi_constructor("", any_tag)
    config = yaml.load(mkdocs_yml.read_text(encoding="utf-8"), Loader=Loader)  # a SafeLoader
    nav = (config or {}).get("nav")
    if not isinstance(nav, list):
        raise SystemExit(f"{mkdocs_yml}: no nav list to check the site's navigation against")
    directory_urls = bool(config.get("use_directory_urls", True))

    def url(source: str) -> str:
        stem = source[: -len(".md")] if source.endswith(".md") else source
        if not directory_urls:
            return f"{stem}.html"
        if stem == "index" or stem.endswith("/index"):
            return stem[: -len("index")]
        return f"{stem}/"

    top: list[str] = []
    titles: list[str] = []
    pages: list[str] = []

    def walk(entries: list[Any], level: int) -> None:
        for entry in entries:
            items = entry.items() if isinstance(entry, dict) else [(None, entry)]
            for title, value in items:
                if title is not None:
                    titles.append(str(title))
                    if level == 0:
                        top.append(str(title))
                if isinstance(value, list):
                    walk(value, level + 1)
                elif isinstance(value, str) and "://" not in value:
                    pages.append(url(value))

    walk(nav, 0)
    return Nav(top, list(dict.fromkeys(titles)), list(dict.fromkeys(pages)))


def page_url(site: Path, html: Path) -> str:
    """The URL path of a built page relative to the site root ("api/accel/" or "x.html")."""
    relative = html.relative_to(site).as_posix()
    return relative[: -len("index.html")] if relative.endswith("index.html") else relative


def pages_with_anchor(site: Path, pattern: str) -> list[str]:
    """URL paths of the built pages with an element id matching ``pattern`` (a regex)."""
    found = re.compile(rf'id="{pattern}"')
    return sorted(
        page_url(site, html)
        for html in site.rglob("*.html")
        if found.search(html.read_text(encoding="utf-8", errors="replace"))
    )


def api_object(symbol: str) -> tuple[str, str]:
    """(the path where ``symbol`` is defined, its docstring's first line), from the installed
    package: the API pages document a re-exported name where it is defined."""
    import importlib

    module_name, _, name = symbol.rpartition(".")
    target = getattr(importlib.import_module(module_name), name)
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    defined = f"{module}.{qualname}" if module and qualname else symbol
    doc = (inspect.getdoc(target) or "").strip()
    return defined, doc.splitlines()[0] if doc else ""


def _flat(text: str) -> str:
    return " ".join(text.replace("`", "").split())


# ---------------------------------------------------------------------------------------------
# The browser
# ---------------------------------------------------------------------------------------------


@dataclass
class Watch:
    """What went wrong in the browser, whatever page caused it."""

    local: str
    problems: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)

    def attach(self, context: Any) -> None:
        context.route("**/*", self._route)
        context.on("page", self._page)
        for page in context.pages:
            self._page(page)

    def _route(self, route: Any) -> None:
        url = route.request.url
        if url.startswith(self.local) or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort("blockedbyclient")

    def _page(self, page: Any) -> None:
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.problems.append(f"uncaught exception: {error}"))
        page.on("requestfailed", self._failed)
        page.on("response", self._response)

    def _console(self, message: Any) -> None:
        if message.type == "error" and "net::ERR_BLOCKED_BY_CLIENT" not in message.text:
            self.problems.append(f"console error on {message.location.get('url')}: {message.text}")

    def _failed(self, request: Any) -> None:
        if request.url.startswith(self.local):  # blocked outside requests are reported apart
            self.problems.append(f"request failed: {request.url} ({request.failure})")

    def _response(self, response: Any) -> None:
        if response.status >= 400:
            self.problems.append(f"HTTP {response.status}: {response.url}")


def _goto(page: Any, url: str) -> None:
    response = page.goto(url, wait_until="networkidle", timeout=TIMEOUT_MS)
    if response is None or not response.ok:
        status = None if response is None else response.status
        raise CheckFailed(f"{url} did not load (HTTP {status})")


class CheckFailed(Exception):
    """One check's failure, with what the reader would see."""


def check_home(page: Any, base: str, nav: Nav, shots: Path) -> str:
    _goto(page, base)
    page.screenshot(path=str(shots / "home.png"))
    title = page.title()
    if "accel" not in title.lower():
        raise CheckFailed(f"home page title is {title!r}, which does not name accel")
    primary = page.locator("nav.md-nav--primary").first
    if primary.count() == 0:
        raise CheckFailed("home page has no Material primary navigation (nav.md-nav--primary)")
    text = _flat(primary.text_content() or "")
    missing = [t for t in nav.titles if _flat(t) not in text]
    if missing:
        raise CheckFailed(f"the navigation lacks the titles {missing} (mkdocs.yml nav)")
    hrefs = primary.locator("a[href]").evaluate_all(
        "links => links.map(link => link.getAttribute('href'))"
    )
    linked = {urlsplit(urljoin(page.url, h)).path for h in hrefs}
    root = urlsplit(base).path
    unlinked = [p for p in nav.pages if root + p not in linked]
    if unlinked:
        raise CheckFailed(f"the navigation has no link to {unlinked} (mkdocs.yml nav)")
    # top level: header tabs (navigation.tabs) or the sidebar, whichever the theme shows
    shown = page.locator(".md-tabs, .md-sidebar--primary")
    hidden = [
        t for t in nav.top if shown.get_by_text(t, exact=True).filter(visible=True).count() == 0
    ]
    if hidden:
        raise CheckFailed(f"top-level navigation entries not visible: {hidden}")
    return (
        f"home: title {title!r}; the navigation links all {len(nav.pages)} pages of the nav, "
        f"shows its {len(nav.titles)} titles, the {len(nav.top)} top-level ones visible"
    )


def check_api(page: Any, base: str, site: Path, symbol: str, shots: Path) -> str:
    defined, summary = api_object(symbol)
    ids = list(dict.fromkeys([symbol, defined]))
    pages = pages_with_anchor(site, "(?:" + "|".join(re.escape(i) for i in ids) + ")")
    if not pages:
        raise CheckFailed(f"no built page has an element id in {ids} (mkdocstrings' heading)")
    url = urljoin(base, pages[0])
    _goto(page, url)
    anchor = next(
        (page.locator(f'[id="{i}"]').first for i in ids if page.locator(f'[id="{i}"]').count()),
        None,
    )
    if anchor is None:
        raise CheckFailed(f"{url}: no element id in {ids}")
    # With show_root_heading the id is on a visible heading, else on an empty anchor before the
    # rendered docstring: show whichever is there.
    shown = anchor if anchor.is_visible() else anchor.locator("xpath=following-sibling::*[1]")
    if not shown.is_visible():
        raise CheckFailed(f"{url}: nothing visible at the anchor of {symbol}")
    name = symbol.rpartition(".")[2]
    if name not in (page.locator("article").first.inner_text() or ""):
        raise CheckFailed(f"{url}: the page does not show the name {name!r}")
    article = _flat(page.locator("article").first.text_content() or "")
    if not summary or _flat(summary) not in article:
        raise CheckFailed(f"{url}: the docstring's first line {summary!r} is not rendered")
    shown.scroll_into_view_if_needed()
    page.wait_for_timeout(SETTLE_MS)  # the header's title fades to the page's on scrolling
    page.screenshot(path=str(shots / "api.png"))
    return f"API: {url} renders {symbol} ({defined}) and its docstring ({summary!r})"


def check_search(page: Any, base: str, site: Path, query: str, shots: Path) -> str:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    documented = pages_with_anchor(site, r"[\w.]+\." + re.escape(query))
    if not documented:
        raise CheckFailed(f"no built page documents {query} (an id ending in .{query})")
    _goto(page, base)
    box = page.locator("input.md-search__input").first
    if box.count() == 0:
        raise CheckFailed("no Material search box (input.md-search__input) on the home page")
    box.click()
    box.press_sequentially(query, delay=25)
    links = page.locator("a.md-search-result__link")
    try:
        links.first.wait_for(state="visible", timeout=TIMEOUT_MS)
    except PlaywrightTimeout as error:
        meta = page.locator(".md-search-result__meta").first
        said = meta.text_content() if meta.count() else "no result list"
        raise CheckFailed(f"search for {query!r} showed no result ({said}): {error}") from error
    page.screenshot(path=str(shots / "search.png"))
    hrefs = [
        urlsplit(urljoin(page.url, h or "")).path
        for h in links.evaluate_all("links => links.map(link => link.getAttribute('href'))")
    ]
    wanted = {urlsplit(urljoin(base, p)).path for p in documented}
    hits = [h for h in hrefs if h in wanted]
    if not hits:
        raise CheckFailed(f"search for {query!r}: no result links to {sorted(wanted)} ({hrefs})")
    return f"search: {query!r} gives {len(hrefs)} result links, {len(hits)} to {sorted(wanted)}"


def check_benchmarks(page: Any, base: str, site: Path, shots: Path) -> str:
    built = [p for p in ("benchmarks/index.html", "benchmarks.html") if (site / p).is_file()]
    if not built:
        raise CheckFailed("the site has no Benchmarks page (benchmarks/index.html)")
    url = urljoin(base, page_url(site, site / built[0]))
    _goto(page, url)
    images = page.locator("article img[src*='assets/plots/']")
    count = images.count()
    if count == 0:
        raise CheckFailed(f"{url}: no plot (an image from assets/plots/)")
    widths = images.evaluate_all("images => images.map(image => image.naturalWidth)")
    broken = [i for i, width in enumerate(widths) if not width]
    if broken:
        raise CheckFailed(f"{url}: plot images {broken} (0-based) did not load")
    images.first.scroll_into_view_if_needed()
    page.wait_for_timeout(SETTLE_MS)  # the header's title fades to the page's on scrolling
    page.screenshot(path=str(shots / "benchmarks.png"))
    return f"benchmarks: {url} shows {count} plots, all loaded"


def run(args: argparse.Namespace) -> list[str]:
    """Run every check; return the failures (empty: all passed)."""
    from playwright.sync_api import sync_playwright

    site = args.site.resolve()
    nav = read_nav(args.mkdocs_yml)
    args.screenshots.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    profile = Path(tempfile.mkdtemp(prefix="accel-docs-chromium-"))
    watch = Watch(local="")
    try:
        with serve(site) as base, sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                str(profile),
                executable_path=str(args.chromium),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 900},  # Material's sidebars shown
                service_workers="block",
            )
            watch.local = base
            watch.attach(context)
            page = context.new_page()
            checks = [
                ("home", lambda: check_home(page, base, nav, args.screenshots)),
                ("API", lambda: check_api(page, base, site, args.api, args.screenshots)),
                ("search", lambda: check_search(page, base, site, args.query, args.screenshots)),
                ("benchmarks", lambda: check_benchmarks(page, base, site, args.screenshots)),
            ]
            for name, check in checks:
                try:
                    print(f"ok   {check()}", flush=True)
                except CheckFailed as error:
                    failures.append(f"{name}: {error}")
                    print(f"FAIL {name}: {error}", flush=True)
            context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    failures += watch.problems
    failures += [
        f"request to outside the site (blocked; must work offline): {u}"
        for u in dict.fromkeys(watch.blocked)
    ]
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--screenshots", type=Path, required=True, help="folder for the PNGs")
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site")
    parser.add_argument("--mkdocs-yml", type=Path, default=ROOT / "mkdocs.yml")
    parser.add_argument("--chromium", type=Path, default=CHROMIUM)
    parser.add_argument("--api", default=API_SYMBOL, help="the class the API page must render")
    parser.add_argument("--query", default=QUERY, help="what to search for")
    args = parser.parse_args(argv)
    if not args.chromium.is_file():
        print(
            f"browser_check: {args.chromium} not found (apt-get install chromium)", file=sys.stderr
        )
        return 1
    if not (args.site / "index.html").is_file():
        print(
            f"browser_check: {args.site}/index.html not found: build the site first (mkdocs build)",
            file=sys.stderr,
        )
        return 1
    failures = run(args)
    if failures:
        print(f"browser check failed ({len(failures)}):", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    print(f"browser check passed; screenshots in {args.screenshots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
