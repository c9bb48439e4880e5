"""The course as a website (``make site``), read in a real browser.

The site is built (incrementally, into ``_build/site/`` as ``make site`` does) and served on a free
loopback port; headless Chromium opens every page once, with every request that is not for
127.0.0.1 aborted and recorded. Then: no console error, no request left the machine, every image
loaded, every internal link (and its #anchor) resolves, the sidebar is the book (13 lessons, each
followed by its exercises, no solutions), each chapter page has its "Run this chapter" note and
previous/next links in book order, MathJax typeset every formula, search finds a term only one
chapter uses, and no page shows ``VBox(``, an escape code or unrendered TeX.

A small course built in a temporary folder checks what the real notebooks do not hold today:
coloured (ANSI) output and tracebacks, a long output that scrolls, a live widget stored unfrozen.

Needs Sphinx and friends (the "site" extra, which ``make test-ui`` installs) and npm, or MathJax
already fetched into ``_build/npm/``; without them these tests skip, saying what is missing.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

pytestmark = [pytest.mark.ui, pytest.mark.timeout(900),
              # the theme and myst-parser use Sphinx APIs that Sphinx 11 will remove: not ours to fix
              pytest.mark.filterwarnings("ignore:.*Check CHANGES for Sphinx API modifications")]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
VIEWPORT = {"width": 1280, "height": 900}
#: a term that one chapter uses and no other: search must find that chapter and no other one
SEARCH_CANDIDATES = ("Ulysses", "Korthikanti", "Gustafson", "rendezvous", "GradScaler", "Megatron")
ESCAPE_TEXT = re.compile(r"\x1b|\[(?:\d{1,3};)*\d{1,3}m\b")


def _site_module():
    spec = importlib.util.spec_from_file_location("gpucourse_site_build_ui", ROOT / "website" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SITE = _site_module()


def _missing() -> str:
    for module, extra in (("sphinx", "site"), ("myst_nb", "site"), ("sphinx_book_theme", "site")):
        if importlib.util.find_spec(module) is None:
            return (f"{module} is not installed (make test-ui installs it: "
                    f"pip install -c constraints.txt -e '.[{extra}]')")
    es5 = SITE.Paths().npm / "node_modules" / "mathjax" / "es5" / "tex-chtml.js"
    if shutil.which("npm") is None and not es5.is_file():
        return "npm is not installed: make site fetches MathJax 3 with it (apt-get install npm)"
    return ""


@pytest.fixture(scope="module")
def site(chromium_path) -> Path:
    """``_build/site/``, built now (incremental after an earlier ``make site``)."""
    if reason := _missing():
        pytest.skip(reason)
    paths = SITE.Paths()
    seconds = SITE.build(paths)
    files, size = SITE.site_size(paths.out)
    print(f"\nsite built in {seconds:.1f} s: {files} files, {size / 2**20:.1f} MiB")
    return paths.out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)   # a page closed mid-transfer is no error


def _serve(folder: Path):
    server = _Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.fixture(scope="module")
def server(site):
    srv, base = _serve(site)
    try:
        yield base
    finally:
        srv.shutdown()
        srv.server_close()


#: run in every page once it has loaded: images, links, math and the text a reader sees
PAGE_REPORT = """async () => {
  for (const img of document.images) img.loading = 'eager';
  await Promise.all([...document.images].map(i => i.complete ? null :
      new Promise(r => { i.addEventListener('load', r); i.addEventListener('error', r); })));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const article = document.querySelector('article') || document.body;
  const prose = article.cloneNode(true);
  prose.querySelectorAll('pre, code, .highlight, mjx-container, script, style').forEach(e => e.remove());
  const maths = [...article.querySelectorAll('.math')];
  return {
    images: document.images.length,
    broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    text: article.innerText,
    prose: prose.textContent,
    maths: maths.length,
    untypeset: maths.filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.slice(0, 80)),
    sidebar: [...document.querySelectorAll('.bd-sidebar-primary nav.bd-docs-nav a.reference')]
        .map(a => a.href),
    next: (document.querySelector('.prev-next-area a.right-next') || {}).href || null,
    prev: (document.querySelector('.prev-next-area a.left-prev') || {}).href || null,
    explorers: [...article.querySelectorAll('.cell_output')]
        .filter(o => o.innerText.includes('Live in the lab'))
        .map(o => o.querySelectorAll('img, table, .output.text_html').length),
    outputs_unbounded: [...article.querySelectorAll('.cell_output pre')].filter(p => {
        const s = getComputedStyle(p);
        return s.maxHeight === 'none' || !['auto', 'scroll'].includes(s.overflowY); }).length,
  };
}"""


def _pages(site: Path) -> list[str]:
    """Every page (the theme's templates in _static/ are not pages)."""
    pages = (p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    return sorted(rel for rel in pages if not rel.startswith("_static/"))


def _screenshot(page, name: str) -> str:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / ("site-" + re.sub(r"[^\w.-]+", "_", name) + ".png")
    try:
        page.screenshot(path=str(shot), full_page=False)
    except Exception as e:  # noqa: BLE001 - the failure itself is what matters
        return f"(no screenshot: {e})"
    return str(shot)


class Visit:
    """One browser context over the whole site: what each page reported, every request."""

    def __init__(self, browser, base: str):
        self.base = base
        self.context = browser.new_context(viewport=VIEWPORT, service_workers="block")
        self.requests: list[str] = []
        self.outside: list[str] = []
        self.context.route("**/*", self._route)
        self.reports: dict[str, dict] = {}
        self.problems: dict[str, list[str]] = {}

    def _route(self, route):
        url = route.request.url
        self.requests.append(url)
        host = urlsplit(url).hostname
        if url.startswith(("data:", "blob:")) or host == "127.0.0.1":
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def open(self, rel: str, wait_for: str | None = None):
        page = self.context.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                if m.type in ("error", "assert") else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
        page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}")
                if r.status >= 400 else None)
        page.goto(self.base + rel, wait_until="load")
        if wait_for:
            page.wait_for_selector(wait_for, timeout=30_000)
        self.problems[rel] = problems
        return page

    def visit(self, rel: str) -> dict:
        page = self.open(rel)
        try:
            report = page.evaluate(PAGE_REPORT)
            report["problems"] = self.problems[rel]
            if report["broken"] or report["untypeset"] or report["problems"]:
                report["screenshot"] = _screenshot(page, rel)
        finally:
            page.close()
        self.reports[rel] = report
        return report


@pytest.fixture(scope="module")
def visited(browser, server, site):
    """Every page of the site opened once (≈ 50 pages)."""
    t0 = time.perf_counter()
    visit = Visit(browser, server)
    for rel in _pages(site):
        visit.visit(rel)
    print(f"\n{len(visit.reports)} pages visited in {time.perf_counter() - t0:.1f} s")
    try:
        yield visit
    finally:
        visit.context.close()


def _book() -> list[str]:
    """The chapter pages in book order: lesson NN, then its exercises."""
    return [rel[:-len(".ipynb")] + ".html" for c in SITE.chapters_from_readme(ROOT)
            for rel in (c.lesson, c.exercises)]


# -- every page ---------------------------------------------------------------------------------------

def test_every_page_loads_with_no_console_error_and_no_failed_request(visited):
    assert len(visited.reports) >= 26 + 15, f"only {len(visited.reports)} pages: {sorted(visited.reports)}"
    bad = {rel: (r["problems"], r.get("screenshot")) for rel, r in visited.reports.items() if r["problems"]}
    assert bad == {}


def test_no_request_leaves_127_0_0_1(visited):
    assert len(visited.requests) > 2 * len(visited.reports), "the route recorded too few requests"
    assert visited.outside == []


def test_every_image_has_loaded(visited):
    broken = {rel: r["broken"] for rel, r in visited.reports.items() if r["broken"]}
    assert broken == {}
    lessons_with_images = [rel for rel, r in visited.reports.items()
                           if rel.startswith("notebooks/") and r["images"]]
    assert len(lessons_with_images) >= 10, f"plots missing? only {lessons_with_images} show images"


def test_every_internal_link_resolves(visited, site):
    checked, bad = 0, []
    html_cache: dict[Path, str] = {}
    for rel, report in visited.reports.items():
        for href in report["links"]:
            url = urlsplit(href)
            if not href.startswith(visited.base):
                assert url.scheme in ("http", "https", "mailto"), f"{rel}: odd link {href}"
                continue
            path = unquote(url.path[len(urlsplit(visited.base).path):]) or "index.html"
            target = site / (path + "index.html" if path.endswith("/") else path)
            checked += 1
            if not target.is_file():
                bad.append(f"{rel}: {href} -> no {target.relative_to(site)}")
                continue
            if url.fragment and target.suffix == ".html":
                html = html_cache.setdefault(target, target.read_text(encoding="utf-8"))
                if f'id="{unquote(url.fragment)}"' not in html:
                    bad.append(f"{rel}: {href} -> no #{url.fragment} in {target.relative_to(site)}")
    assert checked > 500, f"only {checked} internal links found"
    assert bad == []


def test_no_page_shows_a_widget_repr_escape_codes_or_raw_tex(visited):
    bad = []
    for rel, r in visited.reports.items():
        if "VBox(" in r["text"] or "HBox(" in r["text"]:
            bad.append(f"{rel}: a widget's text repr")
        if m := ESCAPE_TEXT.search(r["text"]):
            bad.append(f"{rel}: an escape code {m[0]!r}")
        for tex in ("\\[", "\\(", "$$"):
            if tex in r["prose"]:
                bad.append(f"{rel}: unrendered {tex!r}")
        if r["outputs_unbounded"]:
            bad.append(f"{rel}: {r['outputs_unbounded']} outputs that do not scroll")
    assert bad == []


# -- the book -----------------------------------------------------------------------------------------

def test_sidebar_lists_the_13_lessons_each_followed_by_its_exercises_and_no_solutions(visited):
    base = visited.base
    sidebar = [h[len(base):].split("#")[0] for h in visited.reports["index.html"]["sidebar"]]
    chapters = [h for h in sidebar if h.startswith(("notebooks/", "exercises/"))]
    assert chapters == _book()
    assert sum(h.startswith("notebooks/") for h in chapters) == 13
    assert sum(h.startswith("exercises/") for h in chapters) == 13
    assert not [h for h in sidebar if "solution" in h]
    assert "api/index.html" in sidebar
    # every page shows the same book in its sidebar
    for rel in _book():
        own = [h[len(base):].split("#")[0] for h in visited.reports[rel]["sidebar"]]
        assert [h for h in own if h.startswith(("notebooks/", "exercises/"))] == _book(), rel


def test_each_chapter_page_says_how_to_run_it_and_links_its_neighbours(visited):
    book = _book()
    for k, rel in enumerate(book):
        r = visited.reports[rel]
        notebook = rel[:-len(".html")] + ".ipynb"
        assert "Run this chapter" in r["text"] and "make lab" in r["text"] and notebook in r["text"], rel
        if rel.startswith("exercises/"):
            assert f"make check NB={notebook}" in r["text"], rel
        nxt = book[k + 1] if k + 1 < len(book) else None
        if nxt:
            assert r["next"] == visited.base + nxt, f"{rel}: next is {r['next']}"
        prev = book[k - 1] if k else "index.html"
        assert r["prev"] == visited.base + prev, f"{rel}: previous is {r['prev']}"


def test_explorers_show_their_still_and_say_they_are_live_in_the_lab(visited):
    frozen = {}
    for c in SITE.chapters_from_readme(ROOT):
        text = (ROOT / c.lesson).read_text(encoding="utf-8")
        if n := text.count(SITE.PLACEHOLDER) // 2:         # text/markdown and text/plain
            frozen[c.lesson[:-len(".ipynb")] + ".html"] = n
    assert len(frozen) >= 3, f"expected the explorers of several chapters, found {frozen}"
    for rel, n in frozen.items():
        stills = visited.reports[rel]["explorers"]
        assert len(stills) == n and all(stills), f"{rel}: {n} explorers, stills {stills}"
        assert "run this cell for the interactive explorer" not in visited.reports[rel]["text"]


def test_mathjax_has_rendered_on_the_chapters_with_maths(visited):
    with_math = sorted(rel for rel, r in visited.reports.items() if r["maths"])
    expected = {"notebooks/01_serial_vs_parallel.html", "notebooks/05_multi_node.html"}
    assert expected <= set(with_math), with_math
    bad = {rel: visited.reports[rel]["untypeset"] for rel in with_math if visited.reports[rel]["untypeset"]}
    assert bad == {}


def _main_text(path: Path) -> str:
    html = path.read_text(encoding="utf-8")
    start = html.find("<article")
    article = html[start:html.find("</article>", start)] if start >= 0 else html
    return re.sub(r"<[^>]+>", " ", article).lower()


def test_search_finds_a_term_only_one_chapter_uses(visited, site):
    pages = {rel: _main_text(site / rel) for rel in _book()}
    term, only = next(((t, [rel for rel, text in pages.items() if t.lower() in text])
                       for t in SEARCH_CANDIDATES
                       if sum(t.lower() in text for text in pages.values()) == 1), (None, None))
    assert term, f"none of {SEARCH_CANDIDATES} is used by exactly one chapter page: add a candidate"
    page = visited.open(f"search.html?q={term}", wait_for="#search-results ul.search li")
    try:
        page.wait_for_function(
            "() => /Search finished/.test(document.querySelector('#search-results').innerText)",
            timeout=30_000)
        found = page.eval_on_selector_all("#search-results ul.search li a", "as => as.map(a => a.href)")
        problems = visited.problems[f"search.html?q={term}"]
    finally:
        page.close()
    chapters = {h[len(visited.base):].split("?")[0].split("#")[0] for h in found} & set(pages)
    assert chapters == set(only), f"search for {term!r} found chapter pages {chapters}, expected {only}"
    assert problems == []


# -- what the course's notebooks do not hold today: a small course --------------------------------

ANSI_RED = "\x1b[31mred words\x1b[0m, then \x1b[1;32mbold green\x1b[0m\n"


def _demo_course(folder: Path) -> Path:
    import base64
    import io

    from PIL import Image

    for d in ("notebooks", "exercises"):
        (folder / d).mkdir(parents=True)
    (folder / "README.md").write_text(
        "# Demo\n\n| NN | chapter | lesson | exercises |\n|---|---|---|---|\n"
        "| 00 | demo | [00_demo](notebooks/00_demo.ipynb) | [ex](exercises/00_demo_exercises.ipynb) |\n")
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (30, 90, 200)).save(buf, format="PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    placeholder = SITE.PLACEHOLDER + " (sliders: n = 4) — below, a still picture of it at these values"
    nb = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python", "pygments_lexer": "ipython3"}})
    cells = [nbformat.v4.new_markdown_cell("# 00 · Demo\n\nMaths: $$E = m c^2$$ and inline $a_1$."),
             nbformat.v4.new_code_cell("colours()"), nbformat.v4.new_code_cell("long()"),
             nbformat.v4.new_code_cell("live_widget()"), nbformat.v4.new_code_cell("gc.amdahl_widget()"),
             nbformat.v4.new_code_cell("boom()")]
    cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=ANSI_RED)]
    cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                               text="".join(f"line {i}\n" for i in range(300)))]
    cells[3].outputs = [nbformat.v4.new_output("display_data", data={
        SITE.WIDGET_VIEW: {"model_id": "0123", "version_major": 2, "version_minor": 0},
        "text/plain": "VBox(children=(IntSlider(value=4),))"})]
    cells[4].outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": f"**{placeholder}**",
                                                                      "text/plain": placeholder}),
                        nbformat.v4.new_output("display_data",
                                               data={"image/png": png, "text/plain": "<Figure>"})]
    cells[5].outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="bad",
                                               traceback=["\x1b[0;31mValueError\x1b[0m: bad"])]
    nb.cells = cells
    nbformat.write(nb, folder / "notebooks" / "00_demo.ipynb")
    ex = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 00 · Demo — exercises")])
    nbformat.write(ex, folder / "exercises" / "00_demo_exercises.ipynb")
    return folder


def test_colours_long_outputs_and_live_widgets_render(browser, site, tmp_path):
    """A small course with what the real lessons do not store today, built the same way."""
    paths = SITE.Paths(root=_demo_course(tmp_path / "course"), build=tmp_path / "build",
                       npm_dir=SITE.Paths().npm)
    SITE.build(paths, api=False)
    srv, base = _serve(paths.out)
    visit = Visit(browser, base)
    try:
        page = visit.open("notebooks/00_demo.html")
        report = page.evaluate(PAGE_REPORT)
        colours = page.evaluate("""() => [...document.querySelectorAll('article .cell_output span')]
            .filter(s => s.children.length === 0 && /red words|bold green|ValueError/.test(s.textContent))
            .map(s => [s.textContent, getComputedStyle(s).color, getComputedStyle(s).fontWeight,
                       getComputedStyle(s.closest('pre')).color])""")
        long = page.evaluate("""() => [...document.querySelectorAll('article .cell_output pre')]
            .filter(p => p.innerText.includes('line 299'))
            .map(p => [p.scrollHeight, p.clientHeight, getComputedStyle(p).overflowY])""")
        if visit.problems["notebooks/00_demo.html"] or not colours:
            _screenshot(page, "demo")
    finally:
        visit.context.close()
        srv.shutdown()
        srv.server_close()

    assert visit.problems["notebooks/00_demo.html"] == [] and visit.outside == []
    assert not ESCAPE_TEXT.search(report["text"]), "an escape code is shown as text"
    assert "red words" in report["text"] and "VBox(" not in report["text"]

    def rgb(css: str) -> tuple[int, ...]:
        return tuple(int(v) for v in re.findall(r"\d+", css)[:3])

    by_text = {text.strip(): (rgb(color), weight) for text, color, weight, _ in colours}
    red, green = by_text.get("red words"), by_text.get("bold green")
    assert red and red[0][0] > 150 and red[0][1] < 100, f"ANSI red is not red: {colours}"
    assert green and green[0][1] > red[0][1] and int(green[1]) >= 600, f"ANSI bold green: {colours}"
    # a traceback is highlighted as one (myst-nb's ipythontb lexer), its escape codes dropped
    assert any(t.strip() == "ValueError" and c != plain for t, c, _, plain in colours), \
        f"the traceback is not highlighted: {colours}"

    assert long and long[0][0] > long[0][1] + 100 and long[0][2] in ("auto", "scroll"), \
        f"a 300-line output does not scroll: {long}"
    assert report["explorers"] == [0, 1], "the frozen explorer shows its still, the live one where it runs"
    assert report["text"].count("Live in the lab") == 2
    assert report["maths"] == 2 and report["untypeset"] == []
