"""The lessons as a learner sees them in JupyterLab: chapter 00 runs, explorers move, plots draw.

Scenarios (issue 19): 1. ``make lab``'s default URL opens chapter 00 and Run All finishes with no
error; 2. every explorer (widget) renders and redraws when a control moves; 3. an inline matplotlib
plot renders as an image.
"""

from __future__ import annotations

import nbformat
import pytest
from _ui_course import (
    PLACEHOLDER,
    ROOT,
    lesson_notebooks,
    may_have_widgets,
    needed_cells,
    plot_cell,
    widget_cells,
)
from _ui_lab import ERROR_TEXT

pytestmark = [pytest.mark.ui, pytest.mark.timeout(900)]

RUN_ALL_TIMEOUT_S = 600
REDRAW_TIMEOUT_MS = 120_000
RAW_WIDGET_TEXT = ("VBox(", "HBox(", "Box(children", "Loading widget", "Error displaying widget")


def test_make_lab_default_url_opens_chapter_00_and_run_all_has_no_error(notebook, lab):
    nbp = notebook("notebooks/00_setup.ipynb", url_path="/")     # the bare URL: make lab's default_url
    assert nbp.page.url.split("?")[0].endswith(lab.default_url), nbp.page.url
    tab = nbp.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
    assert tab.text_content() == "00_setup.ipynb"
    nbp.run_all(RUN_ALL_TIMEOUT_S)
    errors = {i: e for i in nbp.code_cells() if (e := nbp.error_outputs(i))}
    assert not errors, f"Run All showed errors: {errors}"


# What a cell's output area shows (``el``: the cell's output area): the controls' values (slider
# readouts, dropdown choices), the loaded plot images, the other views (HTML readouts, Output
# widgets' text) and all of its text.
STATE_JS = """(el) => {
    const loaded = (i) => i.complete && i.naturalWidth > 0;
    const imgs = [...el.querySelectorAll('img')];
    const selects = [...el.querySelectorAll('.widget-dropdown select')];
    return {
        controls: [...el.querySelectorAll('.widget-readout')].map((r) => r.textContent)
            .concat(selects.map((s) => s.value)),
        handles: el.querySelectorAll('.widget-slider .noUi-handle').length,
        selects: selects.length,
        images: imgs.filter(loaded).map((i) => i.src),
        pending: imgs.filter((i) => !loaded(i)).length,
        views: [...el.querySelectorAll('.widget-html-content')].map((h) => h.textContent)
            .concat([...el.querySelectorAll('.jupyter-widgets .jp-OutputArea')].map((o) => o.textContent)),
        text: el.textContent,
    };
}"""


def _output_state(nbp, index: int) -> dict:
    return nbp.cell(index).locator(".jp-Cell-outputArea").evaluate(STATE_JS)


def _wait_output(nbp, index: int, condition: str, arg, what: str, timeout_ms: float) -> dict:
    """Wait until ``condition`` (JS on ``s``, the :data:`STATE_JS` state of the cell's output, and
    ``arg``) holds; else fail saying ``what`` and what the cell shows. Returns the state."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    area = nbp.cell(index).locator(".jp-Cell-outputArea").element_handle()
    try:
        nbp.page.wait_for_function(f"([el, arg]) => {{ const s = ({STATE_JS})(el); return {condition}; }}",
                                   arg=[area, arg], timeout=timeout_ms, polling=200)
    except PlaywrightTimeout:
        state = _output_state(nbp, index)
        raise AssertionError(f"{nbp.path}, cell {index}: {what}; it shows: {state['text'][-1500:]!r} "
                             f"(controls {state['controls']}, {len(state['images'])} image(s))") from None
    return _output_state(nbp, index)


def _move_a_control(nbp, index: int, state: dict) -> str:
    """Move the explorer's first slider one step (arrow key), or pick its first dropdown's next
    choice; returns what was moved."""
    cell = nbp.cell(index)
    if state["handles"]:
        handle = cell.locator(".widget-slider .noUi-handle").first
        now, top = (float(handle.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemax"))
        key = "ArrowRight" if now < top else "ArrowLeft"
        handle.focus()
        nbp.page.keyboard.press(key)
        return f"the first slider ({key})"
    select = cell.locator(".widget-dropdown select").first
    chosen, count = select.evaluate("(s) => [s.selectedIndex, s.options.length]")
    select.select_option(index=(chosen + 1) % count)
    return "the first dropdown"


def _check_widget(nbp, index: int) -> None:
    rendered = _wait_output(nbp, index, "s.handles + s.selects > 0 && s.pending === 0", None,
                            "no control (slider or dropdown) rendered", 60_000)
    for raw in (*RAW_WIDGET_TEXT, PLACEHOLDER):
        assert raw not in rendered["text"], f"{nbp.path}, cell {index} shows {raw!r}: {rendered['text'][-800:]!r}"
    assert not ERROR_TEXT.search(rendered["text"]), rendered["text"][-1500:]
    assert rendered["images"] or any(v.strip() for v in rendered["views"]), (
        f"{nbp.path}, cell {index}: the explorer shows no plot and no readout: {rendered['text'][-800:]!r}")

    moved = _move_a_control(nbp, index, rendered)
    # redrawn: the control shows its new value, and every plot is a new loaded image (an explorer
    # without a plot: its readouts changed)
    after = _wait_output(
        nbp, index,
        "JSON.stringify(s.controls) !== JSON.stringify(arg.controls) && s.pending === 0 && (arg.images.length"
        " ? s.images.length >= arg.images.length && s.images.every((x) => !arg.images.includes(x))"
        " : JSON.stringify(s.views) !== JSON.stringify(arg.views))",
        rendered, f"moving {moved} did not redraw the explorer (its value and plot or readout must change)",
        REDRAW_TIMEOUT_MS)
    assert not ERROR_TEXT.search(after["text"]), after["text"][-1500:]


WIDGET_NOTEBOOKS = [p for p in lesson_notebooks() if may_have_widgets(p)]


@pytest.mark.parametrize("path", WIDGET_NOTEBOOKS, ids=[p.stem for p in WIDGET_NOTEBOOKS])
def test_explorers_render_and_redraw_when_a_slider_moves(lessons, path):
    nb = nbformat.read(path, as_version=4)
    widgets = widget_cells(nb)
    if not widgets:
        pytest.skip(f"{path.name} mentions widgets, but no code cell builds one")
    nbp = lessons(str(path.relative_to(ROOT)))
    # a learner who scrolls to an explorer runs the cells it needs (the setup cell), then the explorer
    for w in widgets:
        nbp.run_needed(needed_cells(nb, w)[:-1])
        nbp.run(w)
        _check_widget(nbp, w)


def test_inline_matplotlib_plot_renders_as_an_image(lessons):
    found = plot_cell(lesson_notebooks())
    if found is None:
        pytest.skip("no lesson cell only draws with a gc.plot_* helper")
    path, index, cells = found
    nbp = lessons(str(path.relative_to(ROOT)))     # chapter 01's page goes on after its explorer
    nbp.run_needed(cells[:-1])
    nbp.run(index)
    loaded = _wait_output(nbp, index, "s.pending === 0 && s.images.some((src) => src.startsWith('data:image/png'))",
                          None, "no plot image (a loaded PNG) in the output", 60_000)
    assert not ERROR_TEXT.search(loaded["text"]), loaded["text"][-1500:]
    nbp.cell(index).locator(".jp-Cell-outputArea img").first.scroll_into_view_if_needed()
