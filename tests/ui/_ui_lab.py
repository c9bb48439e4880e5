"""JupyterLab on a temporary copy of the course, and a notebook driven the way a learner drives it.

:class:`LabServer` copies the course into a temporary folder and serves it with the arguments of
``make lab`` (its default URL, the course's ``lab/settings``) on a free loopback port with a random
token, private workspaces, user settings and Jupyter config/data/runtime folders: no earlier tabs
reopen, nothing is written into the repository or the user's home, and :meth:`LabServer.stop`
shuts every kernel down.

:class:`NotebookPage` opens one notebook in a fresh kernel and runs cells with the keyboard and the
menus. A run waits for the kernel and for the cell's *next* execution count: the cell's prompt must
be seen going through ``[*]`` (a mutation observer on the prompt, set before the keys are pressed)
and end on the count that follows the last one this page produced. A stored ``[n]`` therefore never
counts as done, and nothing sleeps for a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
#: what a learner's course folder holds (copied; the notebooks' links point into these)
COURSE_PARTS = ("notebooks", "exercises", "solutions", "scripts", "gpucourse", "lab", "README.md")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
VIEWPORT = {"width": 1280, "height": 900}
CELL_TIMEOUT_S = 300          # one cell (chapter 00's Run All is many cells: it gets more)
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|^\s*Cell In\[\d+\], line \d+", re.MULTILINE)


def find_chromium() -> str | None:
    """``$GPUCOURSE_CHROMIUM``, else the first Chromium on PATH (Debian's package: ``chromium``)."""
    explicit = os.environ.get("GPUCOURSE_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def make_lab_args() -> dict[str, str]:
    """The ``--LabApp.*`` options of the Makefile's ``lab`` target (default URL, settings dir)."""
    recipe = re.search(r"^lab:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    if recipe is None:
        raise LookupError("the Makefile has no 'lab:' target")
    return dict(re.findall(r"--LabApp\.(\w+)=\"?([^\"\s]+)\"?", recipe[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """``jupyter lab`` serving a temporary copy of the course (see the module docstring)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.course = self.workdir / "course"
        self.token = secrets.token_hex(24)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "jupyter-lab.log"
        self.default_url = make_lab_args()["default_url"]

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 120) -> LabServer:
        ignore = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.egg-info")
        for part in COURSE_PARTS:
            src = ROOT / part
            if src.is_dir():
                shutil.copytree(src, self.course / part, ignore=ignore)
            elif src.is_file():
                self.course.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, self.course / part)
        state = self.workdir / "state"
        env = dict(os.environ)
        env.update({
            # the kernels import the package of the checkout under test, whatever .venv points at
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
            "JUPYTER_CONFIG_DIR": str(state / "config"), "JUPYTER_DATA_DIR": str(state / "data"),
            "JUPYTER_RUNTIME_DIR": str(state / "runtime"), "IPYTHONDIR": str(state / "ipython"),
        })
        env.pop("MPLBACKEND", None)          # kernels choose the inline backend, as in `make lab`
        for attempt in range(3):             # the free port can be taken before the server binds it
            self.port = _free_port()
            cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                   f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.course}",
                   f"--LabApp.default_url={self.default_url}",
                   f"--LabApp.app_settings_dir={self.course / 'lab' / 'settings'}",
                   f"--LabApp.workspaces_dir={state / 'workspaces'}",
                   f"--LabApp.user_settings_dir={state / 'user-settings'}"]
            if os.geteuid() == 0:
                cmd.append("--allow-root")
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(cmd, cwd=self.course, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    self.api("GET", "/api/status")
                    return self
                except (urllib.error.URLError, ConnectionError, OSError):
                    time.sleep(0.2)          # polling a starting server, not waiting for an effect
            if self.proc.poll() is None:
                self.stop()
                break
        raise RuntimeError(f"jupyter lab did not start; its log ({self.log_path}):\n{self.log_tail()}")

    def stop(self) -> None:
        """Shut every kernel down, then the server (its whole process group if it lingers)."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                for kernel in self.api("GET", "/api/kernels"):
                    self.api("DELETE", f"/api/kernels/{kernel['id']}")
                self.api("POST", "/api/shutdown")
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- REST ---------------------------------------------------------------------------------
    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base}{path}{sep}token={self.token}"

    def api(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else None

    def forget_workspaces(self) -> None:
        for ws in self.api("GET", "/lab/api/workspaces").get("workspaces", {}).get("ids", []):
            self.api("DELETE", f"/lab/api/workspaces/{ws}")

    def restore(self, path: str) -> None:
        """Put the course's own copy of ``path`` back (after a test saved changes to it)."""
        shutil.copy2(ROOT / path, self.course / path)

    def end_sessions(self, path: str | None = None) -> None:
        """Shut down the kernel of ``path``'s session (every session if None)."""
        for s in self.api("GET", "/api/sessions"):
            if path is None or s.get("path") == path:
                self.api("DELETE", f"/api/sessions/{s['id']}")


class NotebookPage:
    """One notebook open in JupyterLab in a browser page, with a kernel of its own."""

    def __init__(self, page, lab: LabServer, path: str):
        self.page, self.lab, self.path = page, lab, path
        self.nb = nbformat.read(lab.course / path, as_version=4)
        self.count = 0               # execution count of the kernel: the next run must show count + 1
        self.focus: int | None = None  # the cell a screenshot should show
        self.used_at = time.time()     # last open, select or paste (a failing test shows the pages it used)
        self.ran: set[int] = set()     # cells run in this kernel

    # -- opening ------------------------------------------------------------------------------
    def open(self, url_path: str | None = None) -> NotebookPage:
        """Open the notebook (or ``url_path``, which must land on it) in a fresh kernel; wait until
        every cell is rendered and the kernel is idle."""
        self.lab.end_sessions(self.path)          # a fresh kernel: its first count is 1
        self.lab.forget_workspaces()              # no tab of an earlier page reopens
        self.used_at = time.time()
        # a workspace of its own: JupyterLab restores a workspace's tabs, and a page still open in
        # another browser context keeps saving the default one (its tab then reopened here, and its
        # panel was found instead of this one's)
        own = f"/lab/workspaces/ui-{secrets.token_hex(4)}/tree/{self.path}"
        self.page.goto(self.lab.url(url_path or own))
        self.page.wait_for_function(
            "([sel, n]) => { const p = document.querySelector(sel);"
            " return p && p.querySelectorAll('.jp-Notebook .jp-Cell').length === n; }",
            arg=[PANEL, len(self.nb.cells)], timeout=120_000)
        self.wait_idle(timeout=120_000)
        return self

    def wait_idle(self, timeout: float = 60_000) -> None:
        """The toolbar names a kernel and its status indicator says idle."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(
                "(sel) => { const p = document.querySelector(sel); if (!p) return false;"
                " const k = p.querySelector('.jp-KernelName'), i = p.querySelector('.jp-Notebook-ExecutionIndicator');"
                " return !!k && !/No Kernel|Unknown/i.test(k.textContent) && !!i && i.dataset.status === 'idle'; }",
                arg=PANEL, timeout=timeout)
        except PlaywrightTimeout:
            shown = self.page.evaluate(
                "(sel) => { const p = document.querySelector(sel), d = document.querySelector('.jp-Dialog');"
                " return [p && p.querySelector('.jp-KernelName')?.textContent,"
                "         p && p.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status,"
                "         d && d.textContent]; }", PANEL)
            raise AssertionError(f"{self.path}: the kernel did not become idle within {timeout / 1000:.0f} s "
                                 f"(kernel {shown[0]!r}, status {shown[1]!r}, dialog {shown[2]!r})") from None

    @property
    def panel(self):
        return self.page.locator(PANEL)

    def cell(self, index: int):
        return self.panel.locator(f'.jp-Cell[data-windowed-list-index="{index}"]')

    def code_cells(self) -> list[int]:
        return [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]

    def prompt(self, index: int) -> str:
        return (self.cell(index).locator(".jp-InputPrompt").text_content() or "").strip()

    def output_text(self, index: int) -> str:
        return self.cell(index).locator(".jp-Cell-outputArea").text_content() or ""

    def error_outputs(self, index: int) -> list[str]:
        """Texts of the tracebacks (error outputs) a cell shows."""
        texts = self.cell(index).locator(
            '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').all_text_contents()
        return [t for t in texts if ERROR_TEXT.search(t)]

    def select(self, index: int) -> None:
        """Select a cell in command mode (a click on its prompt area)."""
        self.page.keyboard.press("Escape")
        cell = self.cell(index)
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputPrompt").click()
        self.focus, self.used_at = index, time.time()

    def menu(self, top: str, item: str) -> None:
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(top)}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()

    # -- running ------------------------------------------------------------------------------
    def _watch(self, index: int) -> None:
        """Note on the cell's prompt when it shows ``[*]`` (queued or running) from now on."""
        self.cell(index).locator(".jp-InputPrompt").evaluate(
            "(el) => { if (el.__uiWatch) el.__uiWatch.disconnect(); el.__uiRan = false;"
            " el.__uiWatch = new MutationObserver(() => { if (el.textContent.includes('*')) el.__uiRan = true; });"
            " el.__uiWatch.observe(el, {childList: true, characterData: true, subtree: true}); }")

    def _wait_ran(self, index: int, timeout_s: float, stop_on_error: bool = False) -> str:
        """Wait until cell ``index`` went through ``[*]``, shows a count and the kernel is idle, or
        (``stop_on_error``, for Run All) the run stopped early: kernel idle, nothing queued, an
        error shown. Returns the prompt."""
        prompt = self.cell(index).locator(".jp-InputPrompt").element_handle()
        self.page.wait_for_function(
            "([el, sel, stop]) => { const p = document.querySelector(sel); if (!p) return false;"
            " const i = p.querySelector('.jp-Notebook-ExecutionIndicator');"
            " const idle = !!i && i.dataset.status === 'idle';"
            " if (el.__uiRan && /\\[\\d+\\]/.test(el.textContent) && idle) return true;"
            " const queued = [...p.querySelectorAll('.jp-InputPrompt')].some(q => q.textContent.includes('*'));"
            " const err = [...p.querySelectorAll('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]')]"
            "   .some(o => /Traceback \\(most recent call last\\)|Cell In\\[\\d+\\], line \\d+/.test(o.textContent));"
            " return stop && idle && !queued && err; }",
            arg=[prompt, PANEL, stop_on_error], timeout=timeout_s * 1000, polling=200)
        return self.prompt(index)

    def run(self, index: int, timeout_s: float = CELL_TIMEOUT_S) -> str:
        """Run one cell (select it, Ctrl+Enter); return the text of its outputs.

        Asserts that the cell shows the next execution count (so it really ran, once)."""
        self.select(index)
        self._watch(index)
        self.page.keyboard.press("Control+Enter")
        prompt = self._wait_ran(index, timeout_s)
        self.count += 1
        self.ran.add(index)
        assert prompt == f"[{self.count}]:", (
            f"cell {index} of {self.path} shows {prompt!r} after running, expected [{self.count}]:")
        return self.output_text(index)

    def run_needed(self, cells: list[int]) -> None:
        """Run, in order, those of ``cells`` this kernel has not run yet."""
        for i in sorted(set(cells) - self.ran):
            self.run(i)

    def run_all(self, timeout_s: float) -> None:
        """Run ▸ Run All Cells; wait for the last code cell's next count."""
        codes = self.code_cells()
        self._watch(codes[-1])
        self.menu("Run", "Run All Cells")
        self._wait_ran(codes[-1], timeout_s, stop_on_error=True)
        for i in codes:
            self.count += 1
            self.ran.add(i)
            shown = self.prompt(i)
            assert shown == f"[{self.count}]:", (
                f"after Run All, cell {i} of {self.path} shows {shown!r}, expected [{self.count}]: "
                f"(errors shown: {[e[-300:] for j in codes for e in self.error_outputs(j)]})")

    # -- editing ------------------------------------------------------------------------------
    def editor_text(self, index: int) -> str:
        lines = self.cell(index).locator(".cm-content .cm-line").all_text_contents()
        return "\n".join(lines)

    def paste_into(self, index: int, text: str) -> None:
        """Click into the cell's editor, select all and paste ``text`` (a clipboard paste event,
        as Ctrl+V delivers it: the editor inserts it verbatim, no auto-indent)."""
        editor = self.cell(index).locator(".cm-content")
        editor.scroll_into_view_if_needed()
        editor.click()
        self.page.keyboard.press("Control+a")
        editor.evaluate(
            "(el, text) => { const dt = new DataTransfer(); dt.setData('text/plain', text);"
            " el.dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true})); }",
            text)
        self.page.keyboard.press("Escape")
        self.focus, self.used_at = index, time.time()

    def append_code_cell(self, text: str) -> int:
        """A new code cell below the last one (key B), with ``text`` in it; returns its index."""
        last = len(self.nb.cells) - 1
        self.select(last)
        self.page.keyboard.press("b")
        index = last + 1
        self.cell(index).wait_for()
        self.nb.cells.append(nbformat.v4.new_code_cell(text))
        self.paste_into(index, text)
        return index

    def save(self) -> None:
        """Ctrl+S; wait for the server to answer the save."""
        self.page.keyboard.press("Escape")
        with self.page.expect_response(lambda r: r.request.method == "PUT" and "/api/contents/" in r.url,
                                       timeout=60_000) as saved:
            self.page.keyboard.press("Control+s")
        assert saved.value.ok, f"saving {self.path} failed: HTTP {saved.value.status}"

    def screenshot(self, path: Path) -> None:
        if self.focus is not None:
            try:
                self.cell(self.focus).evaluate("(el) => el.scrollIntoView({block: 'center'})", timeout=5_000)
            except Exception:  # noqa: BLE001 - a screenshot of whatever is shown is still useful
                pass
        self.page.screenshot(path=str(path))


#: the notebooks open now (a failing test's screenshots show them)
OPEN_PAGES: list[NotebookPage] = []


def open_notebook(browser, lab: LabServer, path: str, url_path: str | None = None) -> NotebookPage:
    """A new browser context and page with ``path`` open in a fresh kernel."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(60_000)
    nbp = NotebookPage(page, lab, path)
    OPEN_PAGES.append(nbp)
    nbp.open(url_path)
    return nbp


def close_notebook(nbp: NotebookPage) -> None:
    """Close its page and shut its kernel down."""
    try:
        nbp.page.context.close()
    finally:
        OPEN_PAGES.remove(nbp)
        nbp.lab.end_sessions(nbp.path)
