"""Fixtures of the browser tests (``make test-ui``): a JupyterLab server on a temporary copy of the
course, one headless Chromium, and notebook pages; a screenshot in ``tests/ui/artifacts/`` for
every failing test; the time of each scenario at the end of the run.

The tests are marked ``ui``; ``make test`` deselects them (pyproject's ``addopts``), so it never
needs a browser. Without the ``playwright`` package or a Chromium each of them skips, saying what
to install.
"""

from __future__ import annotations

import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pytest
from _ui_lab import OPEN_PAGES, LabServer, NotebookPage, close_notebook, find_chromium, open_notebook

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
_times: dict[str, dict[str, float]] = defaultdict(dict)


def _requirements() -> tuple[str | None, str]:
    """(path of Chromium, reason to skip or '')."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None, ("the playwright package is not installed (make test-ui installs it: "
                      "pip install -c constraints.txt -e '.[ui]')")
    chromium = find_chromium()
    if chromium is None:
        return None, ("no Chromium found (Debian/Ubuntu: apt-get install chromium; or set "
                      "GPUCOURSE_CHROMIUM=/path/to/chrome)")
    return chromium, ""


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path, reason = _requirements()
    if path is None:
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def lab(chromium_path, tmp_path_factory):
    """JupyterLab serving a temporary copy of the course; every kernel and the server stop at the end."""
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    server = LabServer(tmp_path_factory.mktemp("ui-lab")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # Debian's Chromium, not a browser Playwright downloads; --no-sandbox: CI runs as root
        b = p.chromium.launch(executable_path=chromium_path, headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def _notebook_factory(browser, lab):
    opened: list[NotebookPage] = []

    def _open(path: str, url_path: str | None = None) -> NotebookPage:
        opened.append(open_notebook(browser, lab, path, url_path))
        return opened[-1]

    return _open, opened


@pytest.fixture
def notebook(browser, lab):
    """``notebook("notebooks/01_….ipynb")`` opens a notebook in a new page with a fresh kernel."""
    _open, opened = _notebook_factory(browser, lab)
    yield _open
    for nbp in opened:
        close_notebook(nbp)


@pytest.fixture(scope="module")
def lessons(browser, lab):
    """``lessons("notebooks/01_….ipynb")``: the module's one page (and kernel) for that notebook,
    opened on first use; the tests of a module continue in it as a learner would (what a cell
    needs is run once: :meth:`NotebookPage.run_needed`)."""
    pages: dict[str, NotebookPage] = {}

    def _get(path: str) -> NotebookPage:
        if path not in pages:
            pages[path] = open_notebook(browser, lab, path)
        pages[path].used_at = time.time()
        return pages[path]

    yield _get
    for nbp in pages.values():
        close_notebook(nbp)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if item.get_closest_marker("ui") is None:
        return report
    if report.when in ("setup", "call"):
        _times[item.nodeid][report.when] = report.duration
    used = [p for p in OPEN_PAGES if p.used_at >= call.start]
    if report.when == "call" and report.failed and used:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^\w.-]+", "_", item.name)
        for k, nbp in enumerate(used):
            shot = ARTIFACTS / f"{name}{f'-{k}' if k else ''}.png"
            try:
                nbp.screenshot(shot)
                report.sections.append(("screenshot", f"{shot} ({nbp.path})"))
            except Exception as e:  # noqa: BLE001 - the failure itself is what matters
                report.sections.append(("screenshot", f"could not take one: {e}"))
        log = ARTIFACTS / "jupyter-lab.log"
        log.write_text(used[0].lab.log_tail(400))
    return report


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    tr = terminalreporter
    tr.section("UI scenario times (wall clock, s)")
    total = 0.0
    for nodeid, t in _times.items():
        spent = t.get("setup", 0.0) + t.get("call", 0.0)
        total += spent
        setup = t.get("setup", 0.0)
        note = f"  (setup {setup:.1f})" if setup > 1 else ""
        tr.write_line(f"{spent:7.1f}  {nodeid.split('::', 1)[-1]}{note}")
    tr.write_line(f"{total:7.1f}  total (server and browser start-up in the first setup)")
    tr.write_line(f"finished {time.strftime('%H:%M:%S')}")
