"""Build the documentation site, serve it on localhost and check it in headless Chromium.

Run by ``make docs-check`` (not part of CI). Checks, with Playwright driving Debian's
``/usr/bin/chromium``:

- every page of the nav loads (HTTP 200) with no console error, no uncaught page error,
  no failed request and no request that leaves localhost (the site works offline);
- the search box returns results for ``fixed_point``;
- the API reference shows a heading for every name in ``implicit.__all__`` and
  ``solvers.__all__``;
- every notebook page shows its figures (``img`` elements, loaded) and, where its
  markdown has formulas, typesets them with the site's own MathJax (no ``$`` left).

A full-page screenshot of every page at a desktop width (1280 px) and at a phone's
(390 px, under ``site_check/phone/``), and of the search results, is saved under
``site_check/``, with ``report.txt``; a page that scrolls sideways at either width fails.
The notebooks' figures come from the executed copies that ``tests/test_notebooks.py``
saves in ``build/notebooks/``; where one is missing or older than its source, the
notebook tests are run first (``--no-notebooks`` skips that).
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import importlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import execute_notebooks  # noqa: E402

SITE = ROOT / "site"
OUT = ROOT / "site_check"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SEARCH_TERM = "fixed_point"
PACKAGES = ("implicit", "solvers")


def nav_pages():
    """``(title, source path, url path)`` for every page in mkdocs.yml's nav."""

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may hold !!python/name tags (e.g. for extensions): read them as text.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)
    pages = []

    def walk(items):
        for item in items:
            if isinstance(item, str):
                title, src = None, item
            else:
                ((title, src),) = item.items()
            if isinstance(src, list):
                walk(src)
                continue
            stem = src.rsplit(".", 1)[0]
            if stem == "index":
                url = ""
            elif stem.endswith("/index"):
                url = stem[: -len("index")]
            else:
                url = stem + "/"
            pages.append((title or stem, src, url))

    walk(config["nav"])
    return pages


def ensure_executed_notebooks():
    if execute_notebooks.main(["-n", "1"]) != 0:
        raise SystemExit("the notebook tests failed")


def build():
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"],
        cwd=ROOT,
        check=True,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    print(f"mkdocs build --strict: {time.perf_counter() - start:.1f} s")


def serve():
    handler = functools.partial(QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def public_names():
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names += [f"{package}.{name}" for name in module.__all__]
    return names


def _without_mathjax_font_probes(events):
    """``events`` less MathJax 2's font probes: it asks for fonts it may not use (a blank
    font at ``about:blank``, TeX's under ``fonts/HTML-CSS/TeX/``) and, the site shipping
    STIX-Web only, then uses those. Their console lines do not name the URL, so they are
    dropped only where every failed request of the page was such a probe."""
    def probe(e):
        return e.startswith("request failed: ") and (
            "about:blank" in e or "/assets/mathjax/fonts/HTML-CSS/TeX/" in e)

    failed = [e for e in events if e.startswith("request failed: ")]
    if not failed or not all(probe(e) for e in failed):
        return list(events)
    return [e for e in events if not probe(e) and not (
        e.startswith("console error: ")
        and ("Failed to load resource" in e or "font at 'about:blank'" in e))]


#: A phone's screen (an iPhone 12-15's CSS pixels), as the issue's review used.
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2,
         "is_mobile": True, "has_touch": True}


def _overflow(page):
    """The page scrolls sideways: something is wider than the screen (Material keeps
    tables and code blocks in their own scrolling boxes, so the page itself should not)."""
    width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    if width[0] > width[1] + 1:
        return [f"page {width[0]} px wide in a {width[1]} px window (scrolls sideways)"]
    return []


def check(base, pages):
    from playwright.sync_api import sync_playwright

    OUT.mkdir(exist_ok=True)
    failures, lines = [], []
    api_headings = set()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        external = []

        def route(route):
            if route.request.url.startswith(base):
                return route.continue_()
            external.append(route.request.url)
            return route.abort()

        context.route("**/*", route)
        page = context.new_page()
        events = []
        page.on(
            "console",
            lambda msg: events.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error"
            else None,
        )
        page.on("pageerror", lambda exc: events.append(f"page error: {exc}"))
        page.on(
            "requestfailed",
            lambda req: events.append(f"request failed: {req.url} ({req.failure})"),
        )

        for title, src, url in pages:
            events.clear()
            external.clear()
            response = page.goto(base + url, wait_until="networkidle")
            page.wait_for_timeout(200)
            status = response.status if response else None
            slug = url.strip("/").replace("/", "_") or "index"
            shot = OUT / f"{slug}.png"
            page.screenshot(path=str(shot), full_page=True)
            problems = [f"HTTP {status}"] if status != 200 else []
            problems += _without_mathjax_font_probes(events)
            problems += [f"external request: {u}" for u in external]
            notes = []
            if src.endswith(".ipynb"):
                images = page.eval_on_selector_all(
                    "article img",
                    "els => els.map(e => e.complete && e.naturalWidth > 0)",
                )
                notes.append(f"{len(images)} figures, {sum(images)} loaded")
                if not images or not all(images):
                    problems.append(f"notebook figures: {len(images)} img, {sum(images)} loaded")
                page.wait_for_function(
                    "!window.MathJax || !MathJax.Hub || MathJax.Hub.queue.pending === 0",
                    timeout=30_000)
                typeset = page.eval_on_selector_all(
                    ".MathJax, .MathJax_CHTML, .MathJax_SVG", "els => els.length")
                raw = page.eval_on_selector_all(
                    "article .jp-MarkdownOutput",
                    r"els => els.filter(e => /\$[^$\s][^$]*\$/.test(e.innerText)).length")
                notes.append(f"{typeset} formulas typeset")
                if raw:
                    problems.append(f"{raw} markdown cells with untypeset $...$ formulas")
            if src.startswith("api/"):
                headings = page.eval_on_selector_all(
                    "article h1, article .doc-heading",
                    "els => els.map(e => e.innerText.replace('¶', '').trim())",
                )
                api_headings |= {h.split()[0] for h in headings if h}
            problems += _overflow(page)
            ok = not problems
            lines.append(
                f"{'ok  ' if ok else 'FAIL'} /{url:<42} {title}"
                + (f" ({'; '.join(notes)})" if notes else "")
                + f" -> {shot.relative_to(ROOT)}"
            )
            lines += [f"       {p}" for p in problems]
            if not ok:
                failures.append(url)

        # Phone width: a screenshot of every page, and no page wider than the screen.
        phone = browser.new_context(**PHONE)
        phone.route("**/*", route)
        small = phone.new_page()
        (OUT / "phone").mkdir(exist_ok=True)
        for title, src, url in pages:
            small.goto(base + url, wait_until="networkidle")
            small.wait_for_timeout(200)
            slug = url.strip("/").replace("/", "_") or "index"
            shot = OUT / "phone" / f"{slug}.png"
            small.screenshot(path=str(shot), full_page=True)
            problems = _overflow(small)
            lines.append(
                f"{'ok  ' if not problems else 'FAIL'} /{url:<42} {title} at "
                f"{PHONE['viewport']['width']} px -> {shot.relative_to(ROOT)}"
            )
            lines += [f"       {p}" for p in problems]
            if problems:
                failures.append(f"{url} (phone)")
        phone.close()

        # Search: type into Material's search box, wait for the results.
        events.clear()
        page.goto(base, wait_until="networkidle")
        box = page.locator("input.md-search__input")
        box.click()
        box.press_sequentially(SEARCH_TERM, delay=20)
        try:
            page.wait_for_selector(".md-search-result__item", timeout=10_000)
        except Exception:
            pass
        results = page.locator(".md-search-result__item").count()
        meta = page.locator(".md-search-result__meta").inner_text()
        page.screenshot(path=str(OUT / "search.png"))
        ok = results > 0 and not events
        lines.append(
            f"{'ok  ' if ok else 'FAIL'} search {SEARCH_TERM!r}: {results} results "
            f"({meta.strip()}) -> site_check/search.png"
        )
        lines += [f"       {e}" for e in events]
        if not ok:
            failures.append("search")
        browser.close()

    names = public_names()
    missing = [name for name in names if name not in api_headings]
    lines.append(
        f"{'ok  ' if not missing else 'FAIL'} API reference: {len(names) - len(missing)} of "
        f"{len(names)} public names have a heading"
        + (f"; missing {missing}" if missing else "")
    )
    if missing:
        failures.append("api")
    return failures, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-notebooks",
        action="store_true",
        help="do not run the notebook tests where executed copies are missing",
    )
    args = parser.parse_args()
    if not args.no_notebooks:
        ensure_executed_notebooks()
    build()
    server, base = serve()
    try:
        failures, lines = check(base, nav_pages())
    finally:
        server.shutdown()
    report = "\n".join(lines)
    (OUT / "report.txt").write_text(report + "\n", encoding="utf-8")
    print(report)
    print(f"\n{len(failures)} failed; screenshots and report.txt in {OUT.relative_to(ROOT)}/")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
