"""Open the built site in headless Chromium with no network beyond localhost, check it, screenshot it.

``nox -s docs_screenshots`` runs this after ``mkdocs build``. The site is served on
127.0.0.1; every request to another host is blocked and counts as a failure, so a page that
still needs a CDN (mermaid's, a web font) fails here as it would on an air-gapped cluster.
On each page it checks:

- no request left localhost, no local file was missing (HTTP status >= 400), no script error;
- every Mermaid block became an SVG (material renders each into a closed shadow root, which
  only the DevTools protocol can read), none shows mermaid's syntax-error picture, and no
  diagram source is left as visible text;
- the page does not scroll sideways, at a desktop and at a phone width (wide tables scroll
  inside their own box instead);
- at the desktop width (1280 px), no code block (API signatures included) needs a horizontal
  scroll, and every diagram's labels are drawn at 12 px or more (not scaled down to fit).

It writes PNG screenshots (the top of each page and each diagram, at the desktop width; the
top of the home page at the phone width) and exits with status 1 listing every failure.
Playwright drives the system's Chromium (``apt-get install chromium``): Playwright's own
browser download needs network access this check must not rely on.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from playwright.sync_api import Page, Response, Route, sync_playwright

# The pages a reader judges the site by: home, the diagrams, an API page, the widest
# tables, the migration guides.
DEFAULT_PAGES = (
    "index.html",
    "concepts/index.html",
    "api/core/index.html",
    "benchmarks/index.html",
    "migration/deepspeed/index.html",
    "migration/fsdp2/index.html",
    "migration/colossalai/index.html",
    "architecture/index.html",
    "404.html",
)
# A laptop's width: both sidebars shown, about 85 columns of code between them (docs/assets/stylesheets/extra.css).
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
MERMAID_TIMEOUT_MS = 20_000
# Labels smaller than this are hard to read at the default zoom (material's body text is 16 px, its code 13.6).
MIN_DIAGRAM_TEXT_PX = 12.0
# Words that open a diagram's source: visible on the page only when mermaid did not run.
DIAGRAM_KEYWORDS = ("flowchart LR", "flowchart TB", "sequenceDiagram", "stateDiagram-v2")


@dataclass
class PageReport:
    """What one page showed: failures, and the screenshots written."""

    path: str
    failures: list[str] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)
    diagrams: int = 0


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """Serve ``site`` on a free port of 127.0.0.1 from a daemon thread."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def find_chromium(explicit: str | None) -> str:
    """The Chromium executable: ``--chromium``, else the first of the usual names on PATH."""
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    sys.exit(
        "site_check: no Chromium found on PATH (tried chromium, chromium-browser, google-chrome); "
        "install it with `apt-get install -y chromium` (Debian/Ubuntu) or pass --chromium /path/to/chrome "
        "(without apt: `npm install @sparticuz/chromium@143`, whose executablePath() unpacks /tmp/chromium; see noxfile.py)"
    )


@dataclass
class Diagram:
    """One drawn Mermaid block: its SVG markup and the width it is drawn at on the page."""

    svg: str
    drawn_width: float

    def text_px(self) -> float | None:
        """The node labels' size as a reader sees it: their font size times the drawing's scale.

        Mermaid draws at its own size (the ``viewBox``) and, by default, scales the drawing down
        to the column; a wide diagram's 16 px labels end up at 8 px. ``None`` without a viewBox.
        """
        box = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+) [\d.]+"', self.svg)
        if not box or float(box.group(1)) == 0:
            return None
        # the first size in mermaid's stylesheet is the diagram's own (its root element's), the labels' size
        size = re.search(r"font-size:\s*([\d.]+)px", self.svg)
        return (float(size.group(1)) if size else 16.0) * self.drawn_width / float(box.group(1))


def shadow_svgs(page: Page) -> list[Diagram | None]:
    """The SVG inside each ``div.mermaid``'s shadow root, in page order, with its drawn width.

    Material attaches each diagram as a *closed* shadow root, invisible to page scripts and
    to Playwright's selectors; the DevTools protocol's pierced DOM tree still holds it.
    """
    cdp = page.context.new_cdp_session(page)
    root = cdp.send("DOM.getDocument", {"depth": -1, "pierce": True})["root"]
    svgs: list[Diagram | None] = []

    def walk(node: dict) -> None:
        attributes = node.get("attributes", [])
        classes = dict(zip(attributes[::2], attributes[1::2])).get("class", "").split()
        if node.get("nodeName") == "DIV" and "mermaid" in classes:
            found = [c for shadow in node.get("shadowRoots", []) for c in shadow.get("children", [])
                     if c.get("nodeName", "").lower() == "svg"]
            if found:
                node_id = found[0]["nodeId"]
                quad = cdp.send("DOM.getBoxModel", {"nodeId": node_id})["model"]["content"]
                svgs.append(Diagram(cdp.send("DOM.getOuterHTML", {"nodeId": node_id})["outerHTML"], quad[2] - quad[0]))
            else:
                svgs.append(None)
        for child in node.get("children", []) + node.get("shadowRoots", []):
            walk(child)

    walk(root)
    cdp.detach()
    return svgs


def check_page(page: Page, base: str, path: str, site: Path, out: Path, report: PageReport) -> None:
    """Load ``path`` at the desktop width and run every check; screenshots go to ``out``."""
    page.set_viewport_size(DESKTOP)
    page.goto(f"{base}/{path}", wait_until="load")
    stem = path.removesuffix("index.html").strip("/").replace("/", "-") or "home"
    expected = (site / path).read_text(encoding="utf-8").count('<pre class="mermaid">')
    if expected:
        # Material takes the class off each <pre> as it starts, and puts a <div class="mermaid">
        # holding the drawing in its place once Mermaid has rendered it.
        try:
            page.wait_for_function(f"document.querySelectorAll('div.mermaid').length >= {expected}",
                                   timeout=MERMAID_TIMEOUT_MS)
        except Exception:  # noqa: BLE001 - Playwright's TimeoutError; the failure below says what it means
            report.failures.append(f"{expected} Mermaid block(s) were not drawn within {MERMAID_TIMEOUT_MS} ms")
    screenshot(page, out / f"{stem}.png", report)
    if expected:
        check_diagrams(page, expected, out, stem, report)
    text = page.inner_text("body")
    report.failures += [f"diagram source visible as text: {word!r}" for word in DIAGRAM_KEYWORDS if word in text]
    report.failures += overflow(page, "desktop")
    wide_code = page.evaluate(
        """() => [...document.querySelectorAll('article pre > code')]
               .filter(c => c.scrollWidth > c.clientWidth + 1)
               .map(c => c.innerText.split('\\n').reduce((a, b) => a.length >= b.length ? a : b).slice(0, 60))"""
    )
    report.failures += [f"a code block scrolls sideways at {DESKTOP['width']} px; its longest line: {line!r}..."
                        for line in wide_code]
    page.set_viewport_size(PHONE)
    report.failures += overflow(page, "phone")
    if stem == "home":
        screenshot(page, out / "home-phone.png", report)


def check_diagrams(page: Page, expected: int, out: Path, stem: str, report: PageReport) -> None:
    """Every Mermaid block is an SVG that is not mermaid's error picture; one screenshot each."""
    svgs = shadow_svgs(page)
    report.diagrams = sum(1 for svg in svgs if svg)
    if len(svgs) != expected or not all(svgs):
        report.failures.append(f"{expected} Mermaid block(s) in the HTML, {report.diagrams} rendered as SVG")
    report.failures += [f"diagram {i} is mermaid's syntax-error picture"
                        for i, svg in enumerate(svgs, 1) if svg and "Syntax error" in svg.svg]
    for i, svg in enumerate(svgs, 1):
        size = svg.text_px() if svg else None
        if size is not None and size < MIN_DIAGRAM_TEXT_PX:
            report.failures.append(
                f"diagram {i}'s labels are drawn at {size:.1f} px at {DESKTOP['width']} px (under {MIN_DIAGRAM_TEXT_PX}): "
                "it is scaled down to fit the column; make it narrower or start it with "
                "%%{init: {\"flowchart\": {\"useMaxWidth\": false}}}%% to draw it full size in a scrolling box")
    for i, element in enumerate(page.locator("div.mermaid").all(), 1):
        # The sticky header would cover the top of a diagram scrolled under it.
        element.screenshot(path=out / f"{stem}-diagram-{i}.png", style=".md-header { visibility: hidden; }")
        report.screenshots.append(out / f"{stem}-diagram-{i}.png")


def screenshot(page: Page, path: Path, report: PageReport) -> None:
    """The top of the page, as a reader first sees it."""
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=path)
    report.screenshots.append(path)


def overflow(page: Page, label: str) -> list[str]:
    """A failure if the page itself is wider than the window (something escaped its box)."""
    widths = page.evaluate("() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    return [f"the page scrolls sideways at the {label} width: {widths[0]} px of content in {widths[1]} px"] \
        if widths[0] > widths[1] else []


def localhost_only(report: PageReport) -> Callable[[Route], None]:
    """A route handler that lets requests to 127.0.0.1 through and blocks, and records, the rest."""

    def route(r: Route) -> None:
        if urlsplit(r.request.url).hostname == "127.0.0.1":
            r.continue_()
        else:
            report.failures.append(f"blocked a request off localhost: {r.request.url}")
            r.abort()

    return route


def watch(page: Page, report: PageReport) -> None:
    """Record script errors and missing files (HTTP status >= 400) as failures."""

    def on_response(response: Response) -> None:
        if response.status >= 400:
            report.failures.append(f"HTTP {response.status} for {response.url}")

    page.on("pageerror", lambda error: report.failures.append(f"script error: {error}"))
    page.on("response", on_response)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--site", type=Path, default=Path("site"), help="the built site (mkdocs build's --site-dir)")
    parser.add_argument("--out", type=Path, default=Path("site-screenshots"), help="where the PNGs go")
    parser.add_argument("--chromium", default=None, help="the Chromium executable (default: found on PATH)")
    parser.add_argument("--pages", nargs="+", default=list(DEFAULT_PAGES), help="site-relative HTML files to check")
    args = parser.parse_args(argv)
    missing = [p for p in args.pages if not (args.site / p).is_file()]
    if missing:
        sys.exit(f"site_check: {missing} not found under {args.site}; build the site first (mkdocs build --site-dir {args.site})")
    args.out.mkdir(parents=True, exist_ok=True)
    server = serve(args.site)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    reports = []
    with sync_playwright() as pw:
        # --no-sandbox: Chromium refuses to start as root (containers, CI) with its sandbox on.
        browser = pw.chromium.launch(executable_path=find_chromium(args.chromium), args=["--no-sandbox"])
        for path in args.pages:
            report = PageReport(path)
            context = browser.new_context(viewport=DESKTOP)
            context.route("**/*", localhost_only(report))
            page = context.new_page()
            watch(page, report)
            check_page(page, base, path, args.site, args.out, report)
            context.close()
            reports.append(report)
        browser.close()
    server.shutdown()
    for report in reports:
        status = "FAIL" if report.failures else "ok"
        names = ", ".join(s.name for s in report.screenshots)
        print(f"{status:4} {report.path}: {report.diagrams} diagram(s) rendered; screenshots: {names}")
        for failure in report.failures:
            print(f"     - {failure}")
    failed = sum(bool(r.failures) for r in reports)
    print(f"site_check: {len(reports) - failed} page(s) ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
