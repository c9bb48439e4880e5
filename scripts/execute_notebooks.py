"""Execute notebooks in place (fresh kernel of this environment, cwd = the notebook's folder).

Course authors run this (``make notebooks``) so that lessons and solutions are stored with fresh
outputs: learners open them with results already visible. Stops at the first error, except in cells
tagged ``raises-exception``.

Widget cells (sliders, explorers) are stored *frozen*: JupyterLab does not render a saved widget
while a live kernel runs, so the learner would see ``VBox(children=(FloatSlider(...`` until they run
the cell. Their stored output becomes a one-line placeholder (``PLACEHOLDER``) followed by a still
picture of the explorer as it was drawn at its start values; running the cell replaces both with
the live widget.

    python scripts/execute_notebooks.py notebooks/02_data_parallel.ipynb [...]
    python scripts/execute_notebooks.py --freeze-only NB [...]   # only freeze stored widget views
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient.exceptions import CellExecutionError

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLACEHOLDER = "▶ run this cell for the interactive explorer"


def _widget_tree(state: dict, model_id: str, seen: set[str] | None = None):
    """Yield (model_id, model) for a widget and everything it contains (children, outputs)."""
    seen = set() if seen is None else seen
    if model_id in seen or model_id not in state:
        return
    seen.add(model_id)
    model = state[model_id]
    yield model_id, model
    for value in model.get("state", {}).values():
        for ref in value if isinstance(value, list) else [value]:
            if isinstance(ref, str) and ref.startswith("IPY_MODEL_"):
                yield from _widget_tree(state, ref[len("IPY_MODEL_"):], seen)


def _control(model: dict) -> str | None:
    """``"description = value"`` for a slider-like control, else None."""
    s = model.get("state", {})
    if not s.get("description"):
        return None
    if "_options_labels" in s and isinstance(s.get("index"), int):    # Selection* widgets
        return f"{s['description']} = {s['_options_labels'][s['index']]}"
    if "value" in s and not isinstance(s["value"], (dict, list)):
        return f"{s['description']} = {s['value']}"
    return None


def _frozen(view: dict, state: dict) -> list:
    """The outputs that replace one widget view: the placeholder, then what its Output widgets showed."""
    controls, still = [], []
    for _, model in _widget_tree(state, view["model_id"]):
        if model.get("model_name") == "OutputModel":
            still += [nbformat.from_dict(o) for o in model["state"].get("outputs", [])
                      if o.get("output_type") in ("display_data", "stream")]
        elif model.get("model_name") == "HTMLModel" and model.get("state", {}).get("value"):
            # a readout drawn as HTML (a table, a sentence): its text is the still picture
            value = model["state"]["value"]
            still.append(nbformat.v4.new_output("display_data", data={"text/html": value,
                                                                      "text/plain": value}))
        elif (control := _control(model)) is not None:
            controls.append(control)
    text = PLACEHOLDER + (f" (sliders: {', '.join(controls)})" if controls else "")
    if still:
        text += " — below, a still picture of it at these values"
    placeholder = nbformat.v4.new_output("display_data", data={"text/markdown": f"**{text}**",
                                                               "text/plain": text})
    return [placeholder, *still]


def freeze_widgets(nb) -> int:
    """Replace every stored widget view in ``nb`` by a placeholder and a still picture (in place).

    Returns how many widget views were replaced; the notebook's saved widget state is dropped (no
    output refers to it any more).
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    replaced = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            outputs += _frozen(view, state)
            replaced += 1
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return replaced


def main(paths: list[str], cell_timeout: float = 900) -> int:
    if paths[:1] == ["--freeze-only"]:     # keep the stored outputs (measurements), freeze widget views
        for path in map(Path, paths[1:]):
            nb = nbformat.read(path, as_version=4)
            frozen = freeze_widgets(nb)
            nbformat.write(nb, path)
            print(f"{path}: {frozen} widget view(s) stored as placeholder + still picture", flush=True)
        return 0

    from gpucourse.grading.selfcheck import run_notebook

    for path in map(Path, paths):
        start = time.perf_counter()
        try:
            nb, fatal = run_notebook(path, cell_timeout=cell_timeout, allow_errors=False)
        except CellExecutionError as e:
            print(f"FAILED {path}:\n{e}", file=sys.stderr)
            return 1
        if fatal:
            print(f"FAILED {path}: {fatal}", file=sys.stderr)
            return 1
        frozen = freeze_widgets(nb)
        nbformat.write(nb, path)
        note = f" ({frozen} widget(s) stored as placeholder + still picture)" if frozen else ""
        print(f"executed {path} in {time.perf_counter() - start:.0f} s{note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
