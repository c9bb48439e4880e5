"""The website's sources (``make site``, website/build.py) without Sphinx or a browser: a bad notebook
stops the build naming its path and cell; a good one is staged as the site shows it.

The site itself is built and read in a browser by ``tests/ui/test_ui_site.py`` (``make test-ui``).
"""

import base64
import importlib.util
import io
import json
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module              # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


SITE = _module("website/build.py", "gpucourse_site_build")


def _png(size=(4, 3)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


def _lesson(extra_outputs=()) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    code = nbformat.v4.new_code_cell("print('hi')", execution_count=1)
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n"), *extra_outputs]
    nb.cells = [nbformat.v4.new_markdown_cell("# 00 · Demo\n\nGoals. See "
                                              "[the exercises](../exercises/00_demo_exercises.ipynb)."),
                code,
                nbformat.v4.new_markdown_cell("A script: [train](../scripts/train.py)."),
                nbformat.v4.new_code_cell("gc.amdahl_widget()")]
    return nb


def _course(tmp_path: Path, lesson=None, exercises=None) -> SITE.Paths:
    """A one-chapter course in ``tmp_path/repo``: README table, lesson, exercises, a script."""
    repo = tmp_path / "repo"
    for d in ("notebooks", "exercises", "scripts"):
        (repo / d).mkdir(parents=True)
    (repo / "README.md").write_text(
        "# Demo course\n\n| NN | chapter | lesson | exercises |\n|---|---|---|---|\n"
        "| 00 | demo | [00_demo](notebooks/00_demo.ipynb) | [ex](exercises/00_demo_exercises.ipynb) |\n")
    (repo / "scripts" / "train.py").write_text("print('train')\n")
    lesson = _lesson() if lesson is None else lesson
    if exercises is None:
        exercises = nbformat.v4.new_notebook()
        exercises.cells = [nbformat.v4.new_markdown_cell("# 00 · Demo — exercises"),
                           nbformat.v4.new_code_cell("def f():\n    raise NotImplementedError")]
    for rel, nb in (("notebooks/00_demo.ipynb", lesson), ("exercises/00_demo_exercises.ipynb", exercises)):
        path = repo / rel
        if isinstance(nb, str):
            path.write_text(nb)
        else:
            nbformat.write(nb, path)
    return SITE.Paths(root=repo, build=tmp_path / "build")


def _stage_error(paths) -> str:
    with pytest.raises(SITE.SiteError) as err:
        SITE.stage(paths, api=False)
    return str(err.value)


# -- bad input: the error names the notebook and the cell -----------------------------------------

def test_a_notebook_that_is_not_json_names_path_and_cell(tmp_path):
    text = nbformat.writes(_lesson())
    broken = text.replace("\"print('hi')\"", "\"print('hi')\" oops", 1)   # inside cell 1
    assert broken != text
    message = _stage_error(_course(tmp_path, lesson=broken))
    assert "notebooks/00_demo.ipynb" in message and "not valid JSON" in message
    assert "cell 1 " in message and "line " in message, message


def test_a_truncated_notebook_names_path(tmp_path):
    text = nbformat.writes(_lesson())
    message = _stage_error(_course(tmp_path, lesson=text[: len(text) // 2]))
    assert "notebooks/00_demo.ipynb" in message and "not valid JSON" in message


@pytest.mark.parametrize("data, why", [
    (_b64(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "corrupt"),                # a PNG header, then noise
    (_b64(_png((64, 64))[:-40]), "corrupt"),                                   # cut short
    ("not base64 at all!", "not valid base64"),
    (_b64(b"GIF89a" + _png()[6:]), "corrupt"),
])
def test_a_corrupt_image_output_names_path_cell_and_output(tmp_path, data, why):
    bad = nbformat.v4.new_output("display_data", data={"image/png": data, "text/plain": "<Figure>"})
    message = _stage_error(_course(tmp_path, lesson=_lesson([bad])))
    assert message.startswith("notebooks/00_demo.ipynb: cell 1, output 1: the image/png image"), message
    assert why in message, message


def test_an_image_of_the_wrong_kind_is_refused(tmp_path):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="GIF")
    bad = nbformat.v4.new_output("display_data", data={"image/png": _b64(buf.getvalue())})
    assert "holds a GIF picture" in _stage_error(_course(tmp_path, lesson=_lesson([bad])))


def test_a_lesson_without_outputs_fails_and_says_how_to_fix_it(tmp_path):
    lesson = _lesson()
    for cell in lesson.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    message = _stage_error(_course(tmp_path, lesson=lesson))
    assert "notebooks/00_demo.ipynb" in message and "no stored outputs" in message
    assert "make notebooks" in message


def test_an_invalid_notebook_names_the_cell(tmp_path):
    lesson = json.loads(nbformat.writes(_lesson()))
    lesson["cells"][2]["cell_type"] = "poem"
    message = _stage_error(_course(tmp_path, lesson=json.dumps(lesson)))
    assert message.startswith("notebooks/00_demo.ipynb: cell 2: not a valid notebook"), message


@pytest.mark.parametrize("link, why", [("../scripts/missing.py", "points at nothing"),
                                       ("../scripts", "folder the website has no page for"),
                                       ("../../outside.md", "leaves the repository")])
def test_a_link_the_site_cannot_resolve_names_path_and_cell(tmp_path, link, why):
    lesson = _lesson()
    lesson.cells[2].source = f"See [this]({link})."
    message = _stage_error(_course(tmp_path, lesson=lesson))
    assert message.startswith("notebooks/00_demo.ipynb: cell 2: the link"), message
    assert why in message


def test_code_that_looks_like_a_link_is_left_alone(tmp_path):
    """`modules[k](inputs[k])` in backticks or in a fenced block is code, not a link to check."""
    lesson = _lesson()
    lesson.cells[2].source = ("It computes `modules[k](inputs[k])` and ``f[`a`](b)``.\n\n"
                              "```python\nout = [fn](xs)\n```\n")
    _course(tmp_path, lesson=lesson)
    links = SITE.Links(tmp_path, set(), None, set())
    text = lesson.cells[2].source
    assert links.rewrite(text, "notebooks/00_demo.ipynb", "here") == text
    with pytest.raises(SITE.SiteError, match="the link 'missing.md' points at nothing"):
        links.rewrite(text + "\nSee [this](missing.md).", "notebooks/00_demo.ipynb", "here")


def test_a_notebook_missing_from_the_readme_table_is_reported(tmp_path):
    paths = _course(tmp_path)
    nbformat.write(_lesson(), paths.root / "notebooks" / "01_extra.ipynb")
    assert "notebooks/01_extra.ipynb is not in the README's chapter table" in _stage_error(paths)


# -- a good course: what the site shows --------------------------------------------------------------

def _placeholder_outputs():
    text = SITE.PLACEHOLDER + " (sliders: s = 0.05) — below, a still picture of it at these values"
    return [nbformat.v4.new_output("display_data", data={"text/markdown": f"**{text}**", "text/plain": text}),
            nbformat.v4.new_output("display_data", data={"image/png": _b64(_png()),
                                                         "text/plain": "<Figure>"})]


def test_staged_pages_read_like_the_book(tmp_path):
    lesson = _lesson()
    lesson.cells[3].outputs = _placeholder_outputs()
    live = nbformat.v4.new_output("display_data", data={
        SITE.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0},
        "text/plain": "VBox(children=(FloatSlider(value=0.05),))"})
    lesson.cells[1].outputs.append(live)
    paths = _course(tmp_path, lesson=lesson)
    chapters = SITE.stage(paths, api=False)
    assert [(c.number, c.lesson, c.exercises) for c in chapters] == \
        [("00", "notebooks/00_demo.ipynb", "exercises/00_demo_exercises.ipynb")]

    index = (paths.src / "index.md").read_text()
    assert index.startswith("# Demo course")
    toc = index[index.index("```{toctree}"):]
    assert toc.index("notebooks/00_demo\n") < toc.index("exercises/00_demo_exercises\n")

    staged = json.loads((paths.src / "notebooks" / "00_demo.ipynb").read_text())
    note = "".join(staged["cells"][1]["source"])
    assert "Run this chapter" in note and "`make lab`" in note and "`notebooks/00_demo.ipynb`" in note
    assert "widgets" not in staged["metadata"]
    text = json.dumps(staged)
    assert "VBox(" not in text and SITE.WIDGET_VIEW not in text and SITE.PLACEHOLDER not in text
    outputs = staged["cells"][4]["outputs"]                     # the widget cell, after the note
    assert outputs[0]["data"]["text/markdown"].startswith("**Live in the lab:**")
    assert "(sliders: s = 0.05)" in outputs[0]["data"]["text/markdown"]
    assert "image/png" in outputs[1]["data"]                    # the still picture stays
    assert "Live in the lab" in staged["cells"][2]["outputs"][-1]["data"]["text/markdown"]
    nbformat.validate(nbformat.from_dict(staged))

    ex = json.loads((paths.src / "exercises" / "00_demo_exercises.ipynb").read_text())
    assert "make check NB=exercises/00_demo_exercises.ipynb" in "".join(ex["cells"][1]["source"])
    # a linked script is staged next to the page's folder, so the site offers it as a download
    assert (paths.src / "scripts" / "train.py").read_text() == "print('train')\n"
    assert (paths.src / "conf.py").is_file() and (paths.src / "_static" / "site.css").is_file()


def test_staging_again_touches_nothing_and_removes_what_went(tmp_path):
    paths = _course(tmp_path)
    SITE.stage(paths, api=False)
    stamps = {p: p.stat().st_mtime_ns for p in paths.src.rglob("*") if p.is_file()}
    SITE.stage(paths, api=False)
    assert {p: p.stat().st_mtime_ns for p in paths.src.rglob("*") if p.is_file()} == stamps
    lesson = _lesson()
    lesson.cells[2].source = "No more links."
    nbformat.write(lesson, paths.root / "notebooks" / "00_demo.ipynb")
    SITE.stage(paths, api=False)
    assert not (paths.src / "scripts").exists(), "a download no page links any more is removed"
    changed = [p for p in paths.src.rglob("*") if p.is_file() and p.stat().st_mtime_ns != stamps.get(p)]
    assert changed == [paths.src / "notebooks" / "00_demo.ipynb"]


def test_readme_folder_links_point_at_the_api_pages(tmp_path):
    paths = _course(tmp_path)
    links = SITE.Links(paths.root, {"README.md"}, SITE.Stage(paths), {"runtime"})
    text = "[`runtime/`](gpucourse/runtime) and [the package](gpucourse/README.md#the-one-rule)"
    assert links.rewrite(text, "README.md", "README.md") == \
        "[`runtime/`](api/runtime.rst) and [the package](api/index.md#the-one-rule)"
    assert links.rewrite("[r](../gpucourse/runtime/)", "notebooks/x.ipynb", "x") == "[r](../api/runtime.rst)"


# -- the course's own sources ------------------------------------------------------------------------

def test_the_course_notebooks_are_fit_for_the_site():
    chapters = SITE.chapters_from_readme(ROOT)
    assert [c.number for c in chapters] == [f"{n:02d}" for n in range(13)]
    for c in chapters:
        assert SITE.has_outputs(SITE.read_notebook(ROOT / c.lesson, c.lesson)), c.lesson
        SITE.read_notebook(ROOT / c.exercises, c.exercises)
        assert c.parts or c.number == "00", f"chapter {c.number}'s row links no package folder"


def test_site_and_execute_notebooks_agree_on_the_widget_placeholder():
    execute = _module("scripts/execute_notebooks.py", "execute_notebooks_for_site")
    assert SITE.PLACEHOLDER == execute.PLACEHOLDER and SITE.WIDGET_VIEW == execute.WIDGET_VIEW
