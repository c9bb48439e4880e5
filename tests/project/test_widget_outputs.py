"""Widget cells are stored frozen: a placeholder and a still picture, never a bare widget view.

JupyterLab does not render a saved widget view while a live kernel runs: it shows the view's text
fallback, ``VBox(children=(FloatSlider(...``, until the learner runs the cell.
``scripts/execute_notebooks.py`` (``make notebooks``) replaces every widget view it stores.
"""

import base64
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "exercises")
                   for p in (ROOT / folder).glob("*.ipynb"))
WIDGET_CALLS = re.compile(r"\bgc\.\w*(widget|explorer)\(|\bipywidgets\b|\binteract(ive)?\(")
WIDGET_REPR = re.compile(r"^(VBox|HBox|Box|GridBox|Output|Tab|Accordion)\(children=|"
                         r"^(\w*Slider|Dropdown|ToggleButtons|Checkbox)\((value|options|description)=")


def _script():
    path = ROOT / "scripts" / "execute_notebooks.py"
    spec = importlib.util.spec_from_file_location("execute_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = _script()


def _outputs(nb):
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            yield index, cell, out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_stored_widget_view_or_widget_repr(path):
    nb = nbformat.read(path, as_version=4)
    for index, _, out in _outputs(nb):
        data = out.get("data", {})
        assert EX.WIDGET_VIEW not in data, f"cell {index} stores a widget view (run make notebooks)"
        text = data.get("text/plain", "")
        text = "".join(text) if isinstance(text, list) else text
        assert not WIDGET_REPR.match(text), f"cell {index} shows a widget's text repr: {text[:60]!r}"
    assert "widgets" not in nb.metadata, "saved widget state left in the notebook metadata"


def test_every_widget_cell_has_placeholder_still_and_words_above():
    widget_cells = 0
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or not WIDGET_CALLS.search(cell.source):
                continue
            widget_cells += 1
            where = f"{path.name} cell {index}"
            if path.parent.name == "exercises":
                continue                         # shipped without outputs
            outputs = cell.get("outputs", [])
            assert outputs, f"{where}: no stored output"
            first = outputs[0].get("data", {})
            assert first.get("text/plain", "").startswith(EX.PLACEHOLDER), f"{where}: no placeholder first"
            stills = "".join(str(list(o.get("data", {}))) for o in outputs[1:])
            assert "image/png" in stills or "text/html" in stills, \
                f"{where}: no still picture (a plot, or the readout's HTML) after the placeholder"
            above = nb.cells[index - 1]
            assert above.cell_type == "markdown" and "explorer below" in above.source.lower() \
                and "still picture" in above.source and "run the cell" in above.source, \
                f"{where}: the markdown above does not say what the learner will see"
    assert widget_cells >= 2, "expected the widget cells of chapters 01 and 03"


def _png() -> str:
    # a 1x1 PNG
    return base64.b64encode(bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d4944415478da63f8cfc0f01f0005000201a1d1b9c40000000049454e44ae426082")).decode()


def _executed_widget_notebook():
    """A notebook as nbclient stores it after displaying a VBox(FloatSlider, SelectionSlider, Output)."""
    state = {
        "box": {"model_name": "VBoxModel",
                "state": {"children": ["IPY_MODEL_s", "IPY_MODEL_n", "IPY_MODEL_out"],
                          "layout": "IPY_MODEL_lay"}},
        "s": {"model_name": "FloatSliderModel", "state": {"description": "serial s", "value": 0.05,
                                                          "layout": "IPY_MODEL_lay"}},
        "n": {"model_name": "SelectionSliderModel", "state": {"description": "workers n", "index": 2,
                                                              "_options_labels": ["1", "2", "4"]}},
        "out": {"model_name": "OutputModel", "state": {"outputs": [
            {"output_type": "display_data", "metadata": {},
             "data": {"image/png": _png(), "text/plain": "<Figure size 700x450 with 1 Axes>"}}]}},
        "lay": {"model_name": "LayoutModel", "state": {}},
    }
    view = {"output_type": "execute_result", "execution_count": 3, "metadata": {},
            "data": {EX.WIDGET_VIEW: {"model_id": "box", "version_major": 2, "version_minor": 0},
                     "text/plain": "VBox(children=(FloatSlider(value=0.05, description='serial s'), …"}}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("The explorer below ..."),
                nbformat.v4.new_code_cell("gc.amdahl_widget()", execution_count=3, outputs=[view]),
                nbformat.v4.new_code_cell("print(1)", execution_count=4,
                                          outputs=[nbformat.v4.new_output("stream", name="stdout",
                                                                          text="1\n")])]
    nb.metadata["widgets"] = {EX.WIDGET_STATE: {"state": state, "version_major": 2, "version_minor": 0}}
    return nbformat.from_dict(nb)


def test_freeze_widgets_replaces_the_view_by_placeholder_and_still():
    nb = _executed_widget_notebook()
    assert EX.freeze_widgets(nb) == 1
    nbformat.validate(nb)
    placeholder, still = nb.cells[1].outputs
    assert placeholder.output_type == "display_data"
    assert placeholder.data["text/plain"] == (f"{EX.PLACEHOLDER} (sliders: serial s = 0.05, workers n = 4)"
                                              " — below, a still picture of it at these values")
    assert placeholder.data["text/markdown"] == f"**{placeholder.data['text/plain']}**"
    assert still.data["image/png"] == _png()
    assert nb.cells[2].outputs[0].text == "1\n"          # other outputs untouched
    assert "widgets" not in nb.metadata
    assert EX.freeze_widgets(nb) == 0                     # idempotent


def test_freeze_widgets_without_saved_state_still_gives_the_placeholder():
    nb = _executed_widget_notebook()
    del nb.metadata["widgets"]
    assert EX.freeze_widgets(nb) == 1
    (placeholder,) = nb.cells[1].outputs
    assert placeholder.data["text/plain"] == EX.PLACEHOLDER


@pytest.mark.timeout(300)
def test_execute_notebooks_stores_a_real_widget_frozen(tmp_path, capsys):
    """End to end: a kernel really displays gc.amdahl_widget; the stored cell is placeholder + PNG."""
    path = tmp_path / "widget.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%matplotlib inline\nimport gpucourse as gc\n"
                                          "gc.amdahl_widget(serial_fraction=0.1, workers=8, max_workers=64)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    # the cell takes seconds; a kernel stuck (CI saw one, once) is stopped before pytest's timeout,
    # and the failure says where it was
    if EX.main([str(path)], cell_timeout=200) != 0:
        err = capsys.readouterr().err.replace(str(tmp_path), "<tmp>").strip()
        pytest.fail(f"{err.splitlines()[-1] if err else 'no output'}\n{err[-1500:]}")   # innermost first
    stored = nbformat.read(path, as_version=4)
    outputs = stored.cells[0].outputs
    expected = f"{EX.PLACEHOLDER} (sliders: serial s = 0.1, workers n = 8)"
    assert outputs[0].data["text/plain"].startswith(expected)
    assert any("image/png" in o.get("data", {}) for o in outputs[1:])
    assert all(EX.WIDGET_VIEW not in o.get("data", {}) for o in outputs)
    assert "widgets" not in stored.metadata
