"""Build the course as a static website: ``make site`` (= ``python website/build.py``).

The site is a book of the README, the 13 lessons with their *stored* outputs and the 13 exercises
notebooks, in the order of the README's chapter table, plus an API reference generated from the
package's docstrings. Nothing is executed: lessons are shown as they were last run by
``make notebooks`` (their timings are measurements), and a lesson without outputs fails the build.

Three steps, each redone only when its input changed (so an edit to one notebook rebuilds one page):

1. **MathJax 3** from the npm registry, pinned by ``website/mathjax/package-lock.json``:
   ``npm ci`` into ``_build/npm/`` (once per lock file), then the files the site needs are copied
   into its static files. No page loads anything from outside the site.
2. **Stage** the sources into ``_build/site-src/`` (a complete Sphinx project: ``conf.py``,
   ``_static/``, ``index.md`` …): every notebook is read and checked here — valid JSON, a valid
   notebook, every image output decodable, lessons with outputs — and a bad one stops the build
   with its path and cell. Each page gets a "Run this chapter" note; a frozen widget's placeholder
   says the explorer is live in the lab; README links to package folders point at their API page;
   linked files (``scripts/train_ddp.py``) become downloads. Unchanged files keep their time stamp.
3. **Sphinx** (myst-nb, sphinx-book-theme, autodoc + napoleon) into ``_build/site/``, strict:
   every warning is an error.

    python website/build.py            # incremental
    python website/build.py --clean    # from scratch (keeps the npm download)

Cells are counted from 0, as nbformat and the course's other tools count them.
"""

from __future__ import annotations

import argparse
import ast
import base64
import binascii
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: the placeholder ``scripts/execute_notebooks.py`` stores in place of a widget (kept in step by a test)
PLACEHOLDER = "▶ run this cell for the interactive explorer"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
IMAGE_MIMES = {"image/png": ("PNG",), "image/jpeg": ("JPEG", "MPO"), "image/gif": ("GIF",)}
#: the parts of MathJax's es5 folder the site needs: the TeX → HTML component, its fonts, the TeX
#: extensions it loads on demand, the menu and the accessibility components the menu loads
MATHJAX_PARTS = ("tex-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions", "ui", "a11y")
CHAPTER_ROW = re.compile(r"^\|\s*(\d\d)\s*\|(.*)$")
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
#: fenced code blocks and inline code spans (a run of backticks up to the same run), kept as they are
CODE = re.compile(r"(^[ \t]*(?:```|~~~)[^\n]*\n.*?^[ \t]*(?:```|~~~)[ \t]*$|(`+)(?:(?!\2).)+?\2)", re.M | re.S)


class SiteError(Exception):
    """A source the site cannot be built from; the message names the file (and cell)."""


@dataclass
class Chapter:
    number: str
    lesson: str                 # notebooks/NN_topic.ipynb
    exercises: str              # exercises/NN_topic_exercises.ipynb
    parts: list[str] = field(default_factory=list)   # package folders the row links to


@dataclass
class Paths:
    """Where a build reads and writes: the repository, ``_build/`` and the npm download in it."""

    root: Path = ROOT
    build: Path | None = None
    npm_dir: Path | None = None              # another build's download of MathJax (tests share one)

    def __post_init__(self):
        self.root = Path(self.root).resolve()
        self.build = Path(self.build).resolve() if self.build else self.root / "_build"

    @property
    def src(self) -> Path:
        return self.build / "site-src"

    @property
    def out(self) -> Path:
        return self.build / "site"

    @property
    def doctrees(self) -> Path:
        return self.build / "site-doctrees"

    @property
    def npm(self) -> Path:
        return Path(self.npm_dir).resolve() if self.npm_dir else self.build / "npm"


# -- reading and checking notebooks ------------------------------------------------------------------

def _json_error_cell(text: str, pos: int) -> str:
    """Where a JSON error sits: 'cell N' when it is inside the cells list, else 'the notebook's header'."""
    start = text.find('"cells"')
    if start < 0 or pos < start:
        return "before the cells"
    count = len(re.findall(r'"cell_type"\s*:', text[start:pos]))
    return f"cell {max(count - 1, 0)}"


def read_notebook(path: Path, rel: str) -> dict:
    """The notebook at ``path`` as a dict, checked: valid JSON, valid nbformat 4, decodable images."""
    import nbformat

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SiteError(f"{rel}: cannot be read: {e}") from None
    try:
        nb = json.loads(text)
    except json.JSONDecodeError as e:
        raise SiteError(f"{rel}: not valid JSON, {_json_error_cell(text, e.pos)} "
                        f"(line {e.lineno}, column {e.colno}): {e.msg}") from None
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        raise SiteError(f"{rel}: not a Jupyter notebook in format 4 (no 'nbformat': 4 and 'cells' list)")
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        where = list(getattr(e, "absolute_path", []) or [])
        cell = f"cell {where[1]}: " if len(where) > 1 and where[0] == "cells" else ""
        raise SiteError(f"{rel}: {cell}not a valid notebook: {e.message}") from None
    check_images(nb, rel)
    return nb


def check_images(nb: dict, rel: str) -> None:
    """Every image output decodes (base64, then the image itself) — else SiteError naming the cell."""
    from PIL import Image

    for index, cell in enumerate(nb["cells"]):
        for k, out in enumerate(cell.get("outputs", [])):
            for mime in IMAGE_MIMES:
                data = out.get("data", {}).get(mime)
                if data is None:
                    continue
                where = f"{rel}: cell {index}, output {k}: the {mime} image"
                raw = "".join(data) if isinstance(data, list) else data
                try:
                    blob = base64.b64decode(raw.replace("\n", ""), validate=True)
                except (binascii.Error, ValueError) as e:
                    raise SiteError(f"{where} is not valid base64: {e}") from None
                try:
                    with Image.open(io.BytesIO(blob)) as img:
                        img.verify()
                    with Image.open(io.BytesIO(blob)) as img:
                        img.load()             # verify() misses a truncated image, decoding does not
                        kind = img.format
                except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a corrupt image
                    raise SiteError(f"{where} is corrupt: {type(e).__name__}: {e}") from None
                if kind not in IMAGE_MIMES[mime]:
                    raise SiteError(f"{where} holds a {kind} picture, not {mime}")
            svg = out.get("data", {}).get("image/svg+xml")
            if svg is not None:
                import xml.etree.ElementTree as ET

                try:
                    ET.fromstring("".join(svg) if isinstance(svg, list) else svg)
                except ET.ParseError as e:
                    raise SiteError(f"{rel}: cell {index}, output {k}: the image/svg+xml image is "
                                    f"corrupt: {e}") from None


def has_outputs(nb: dict) -> bool:
    return any(cell.get("outputs") for cell in nb["cells"])


# -- the book's order ---------------------------------------------------------------------------------

def chapters_from_readme(root: Path) -> list[Chapter]:
    """The README's chapter table (its first table with a row per chapter), row by row: lesson,
    exercises and the package folders it links."""
    chapters = []
    for line in (root / "README.md").read_text(encoding="utf-8").splitlines():
        m = CHAPTER_ROW.match(line)
        if not m:
            if chapters and not line.startswith("|"):
                break                               # the first such table only: later ones have rows per chapter too
            continue
        lesson = re.search(r"\]\((notebooks/[^)]+\.ipynb)\)", line)
        exercises = re.search(r"\]\((exercises/[^)]+\.ipynb)\)", line)
        if not (lesson and exercises):
            raise SiteError(f"README.md: chapter {m[1]}'s row links no lesson or no exercises notebook")
        parts = list(dict.fromkeys(re.findall(r"\]\(gpucourse/(\w+)/?\)", line)))
        chapters.append(Chapter(m[1], lesson[1], exercises[1], parts))
    if not chapters:
        raise SiteError("README.md: no chapter table (rows '| NN | … |')")
    listed = {c.lesson for c in chapters} | {c.exercises for c in chapters}
    for folder in ("notebooks", "exercises"):
        for nb in sorted((root / folder).glob("*.ipynb")):
            rel = f"{folder}/{nb.name}"
            if rel not in listed:
                raise SiteError(f"{rel} is not in the README's chapter table: add its row")
    for rel in sorted(listed):
        if not (root / rel).is_file():
            raise SiteError(f"README.md links {rel}, which does not exist")
    return chapters


# -- staging ------------------------------------------------------------------------------------------

class Stage:
    """Writes the Sphinx project into ``paths.src``; a file whose content is unchanged is not touched."""

    def __init__(self, paths: Paths):
        self.paths = paths
        self.written: set[Path] = set()

    def write(self, rel: str, data: str | bytes) -> None:
        path = self.paths.src / rel
        blob = data.encode("utf-8") if isinstance(data, str) else data
        self.written.add(path)
        if path.is_file() and path.read_bytes() == blob:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)

    def copy_tree(self, src: Path, rel: str) -> None:
        for f in sorted(src.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                self.write(f"{rel}/{f.relative_to(src).as_posix()}", f.read_bytes())

    def prune(self) -> None:
        """Remove what an earlier build staged and this one did not (a deleted notebook)."""
        for f in sorted(self.paths.src.rglob("*"), reverse=True):
            if f.is_file() and f not in self.written:
                f.unlink()
            elif f.is_dir() and not any(f.iterdir()):
                f.rmdir()


class Links:
    """Rewrites relative links of a page's markdown so that each resolves on the site."""

    def __init__(self, root: Path, docs: set[str], stage: Stage, parts: set[str]):
        self.root, self.docs, self.stage, self.parts = root, docs, stage, parts

    def rewrite(self, text: str, page: str, where: str) -> str:
        """``page``: the page's path in the repository (``README.md``, ``notebooks/x.ipynb``)."""
        base = Path(page).parent

        def fix(m: re.Match) -> str:
            target = m[2]
            if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
                return m[0]                                   # a URL, an anchor on this page, absolute
            path, _, anchor = target.partition("#")
            rel = _normalise(base / path)
            if rel is None:
                raise SiteError(f"{where}: the link {target!r} leaves the repository")
            if rel in self.docs:
                return m[0]
            up = "../" * len(base.parts)
            part = re.fullmatch(r"gpucourse/(\w+)/?", rel)
            if part and part[1] in self.parts:
                return f"{m[1]}{up}api/{part[1]}.rst{m[3]}"
            if rel == "gpucourse/README.md":
                return f"{m[1]}{up}api/index.md{'#' + anchor if anchor else ''}{m[3]}"
            full = self.root / rel
            if full.is_file():
                self.stage.write(rel, full.read_bytes())      # the site offers it as a download
                return m[0]
            if full.is_dir():
                raise SiteError(f"{where}: the link {target!r} is a folder the website has no page for")
            raise SiteError(f"{where}: the link {target!r} points at nothing ({rel} does not exist)")

        # code is not markdown: `modules[k](inputs[k])` in backticks, or a fenced block, is no link
        code = [c.span() for c in CODE.finditer(text)]

        def fix_outside_code(m: re.Match) -> str:
            return m[0] if any(a <= m.start() < b for a, b in code) else fix(m)

        return LINK.sub(fix_outside_code, text)


def _normalise(path: Path) -> str | None:
    parts: list[str] = []
    for p in path.parts:
        if p == "..":
            if not parts:
                return None
            parts.pop()
        elif p not in (".", ""):
            parts.append(p)
    return "/".join(parts)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _run_note(chapter: Chapter, kind: str) -> str:
    if kind == "lesson":
        path = chapter.lesson
        body = (f"In the course folder: `make lab` (the first time it installs the course, see "
                f"[the README](../index.md)), then open `{path}` in JupyterLab's file browser and run "
                f"its cells from the top. The outputs on this page are the ones stored in the notebook: "
                f"timings and plots are measurements of the machine it was last run on, and yours will "
                f"differ. Then do [its exercises](../{chapter.exercises}).")
    else:
        path = chapter.exercises
        body = (f"In the course folder: `make lab`, then open `{path}` in JupyterLab's file browser. "
                f"Complete each function where it says `# YOUR CODE HERE` and run the check cell below "
                f"it; grade the whole notebook with `make check NB={path}`. This page shows the "
                f"notebook as it is handed out, without outputs; the lesson is "
                f"[chapter {chapter.number}](../{chapter.lesson}).")
    return f"```{{admonition}} Run this chapter\n:class: tip run-this-chapter\n\n{body}\n```\n"


def site_notebook(nb: dict, rel: str, kind: str, chapter: Chapter, links: Links) -> dict:
    """The notebook as the site shows it (a new dict; ``nb`` is not changed)."""
    nb = json.loads(json.dumps(nb))
    nb.get("metadata", {}).pop("widgets", None)
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            cell["source"] = links.rewrite(_source(cell), rel, f"{rel}: cell {index}")
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            plain = data.get("text/plain", "")
            plain = "".join(plain) if isinstance(plain, list) else plain
            if WIDGET_VIEW in data:            # a live widget never stored frozen: no still of it
                text = ("**Live in the lab:** an interactive explorer. Run this cell in JupyterLab "
                        "(`make lab`) to use it; the notebook stores no still picture of it.")
                out = {"output_type": "display_data", "metadata": {},
                       "data": {"text/markdown": text, "text/plain": text}}
            elif plain.startswith(PLACEHOLDER):
                controls = plain[len(PLACEHOLDER):].split(" — ")[0].strip()
                text = (f"**Live in the lab:** this cell is an interactive explorer"
                        f"{' ' + controls if controls else ''}. Below, a still picture of it at these "
                        f"values; run the cell in JupyterLab (`make lab`) to move the sliders.")
                out = {"output_type": "display_data", "metadata": {},
                       "data": {"text/markdown": text, "text/plain": text}}
            outputs.append(out)
        if "outputs" in cell:
            cell["outputs"] = outputs
    note = {"cell_type": "markdown", "metadata": {}, "source": _run_note(chapter, kind)}
    if nb.get("nbformat_minor", 0) >= 5:
        note["id"] = "gpucourse-site-run-this-chapter"
    nb["cells"].insert(1 if nb["cells"] else 0, note)
    return nb


def course_map(root: Path) -> dict[str, tuple[str, ...]]:
    """``_PARTS`` of ``gpucourse/__init__.py``: part → its public names (read, not imported)."""
    path = root / "gpucourse" / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_PARTS" for t in node.targets):
            return {part: tuple(names.split()) for part, names in ast.literal_eval(node.value).items()}
    raise SiteError(f"{path.relative_to(root)}: no _PARTS (the course's map of public names)")


@dataclass
class Definition:
    kind: str                   # "class", "function" or "data"
    path: Path
    node: ast.AST
    source: str


def _definitions(root: Path, part: str) -> dict[str, Definition]:
    """Top-level classes, functions and assignments of every module of a part (read, not imported:
    staging needs no torch; autodoc imports the package when Sphinx reads an API page)."""
    found: dict[str, Definition] = {}
    for path in sorted((root / "gpucourse" / part).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                found[node.name] = Definition("class", path, node, source)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[node.name] = Definition("function", path, node, source)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        found[target.id] = Definition("data", path, node, source)
    return found


def _api_page(root: Path, part: str, names: tuple[str, ...], chapters: list[Chapter]) -> str:
    """reStructuredText of one part's API page: its docstring, then every public name of it."""
    init = root / "gpucourse" / part / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    m = re.match(r"Chapters? ([\d–\-]+(?: \(part [AB]\))?) —", first)
    title = f"{part}/" + (f" (chapter {m[1]})" if m else "")
    used = [c for c in chapters if part in c.parts]
    lines = [title, "=" * len(title), ""]
    lines += [f".. automodule:: gpucourse.{part}", "   :no-members:", "", ".. currentmodule:: gpucourse", ""]
    refs = ", ".join(f":doc:`chapter {c.number} <../{c.lesson[:-6]}>`" for c in used)
    intro = (f"Used in {refs}. " if used else "") + ("Every name below is re-exported at the top level: "
                                                     f"``import gpucourse as gc; gc.{names[0]}``.")
    lines += [intro, ""]
    defs = _definitions(root, part)
    for name in names:
        d = defs.get(name)
        if d is None:
            raise SiteError(f"gpucourse/__init__.py lists {name!r} in part {part!r}, but no module of "
                            f"gpucourse/{part}/ defines it")
        if d.kind == "class":
            lines += [f".. autoclass:: {name}", "   :members:", ""]
        elif d.kind == "function":
            lines += [f".. autofunction:: {name}", ""]
        else:
            lines += _data_doc(name, d)
    return "\n".join(lines)


def _data_doc(name: str, d: Definition) -> list[str]:
    """A constant's entry: its value when short, and the ``#:`` comment above it in its module.

    (autodoc would show the docstring of its type — ``tuple``'s, ``dict``'s — for a constant
    re-exported at the top level.)"""
    src_lines = d.source.splitlines()
    comment: list[str] = []
    k = d.node.lineno - 2
    while k >= 0 and src_lines[k].startswith("#:"):
        comment.insert(0, src_lines[k][2:].strip())
        k -= 1
    value = " ".join((ast.get_source_segment(d.source, d.node.value) or "").split())
    lines = [f".. py:data:: {name}"]
    if value and len(value) <= 100:
        lines.append(f"   :value: {value}")
    elif isinstance(d.node, ast.AnnAssign):
        lines.append(f"   :type: {ast.unparse(d.node.annotation)}")
    lines += ["", *(f"   {c}" for c in comment), ""]
    return lines


def _api_index(root: Path, parts: list[str]) -> str:
    text = (root / "gpucourse" / "README.md").read_text(encoding="utf-8")
    text = "# API reference\n\n" + re.sub(r"^#", "##", text, count=1)     # its title, one level down
    toc = "\n".join(f"{p}" for p in parts)
    return (f"{text.rstrip()}\n\n## The public API, part by part\n\nGenerated from the docstrings; "
            f"each name is `gc.<name>` after `import gpucourse as gc`.\n\n"
            f"```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n")


def stage(paths: Paths, *, api: bool = True, mathjax: Callable[[], Path] | None = None) -> list[Chapter]:
    """Write the Sphinx project into ``paths.src`` (see the module docstring); returns the chapters.

    Every source is read and checked before anything else happens (``mathjax``, which may download,
    is called only then): a bad notebook fails fast with its path and cell."""
    root = paths.root
    chapters = chapters_from_readme(root)
    st = Stage(paths)
    course = course_map(root) if api else {}
    parts = [p for p, names in course.items() if names]
    docs = {"README.md"} | {c.lesson for c in chapters} | {c.exercises for c in chapters}
    links = Links(root, docs, st, set(parts))

    notebooks: dict[str, dict] = {}
    for c in chapters:
        for rel, kind in ((c.lesson, "lesson"), (c.exercises, "exercises")):
            nb = read_notebook(root / rel, rel)
            if kind == "lesson" and not has_outputs(nb):
                raise SiteError(f"{rel}: the lesson has no stored outputs — the site shows them, it does "
                                f"not run notebooks: run `make notebooks` (or python "
                                f"scripts/execute_notebooks.py {rel}) first")
            notebooks[rel] = site_notebook(nb, rel, kind, c, links)
    for rel, nb in notebooks.items():
        st.write(rel, json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n")

    readme = links.rewrite((root / "README.md").read_text(encoding="utf-8"), "README.md", "README.md")
    toc = "\n".join(f"{c.lesson[:-6]}\n{c.exercises[:-6]}" for c in chapters)
    readme += f"\n```{{toctree}}\n:hidden:\n:caption: Chapters\n\n{toc}\n```\n"
    if api:
        readme += "\n```{toctree}\n:hidden:\n:caption: Reference\n\napi/index\n```\n"
        st.write("api/index.md", _api_index(root, parts))
        for part in parts:
            st.write(f"api/{part}.rst", _api_page(root, part, course[part], chapters))
    st.write("index.md", readme)

    st.write("conf.py", (HERE / "conf.py").read_bytes())
    st.write("site.json", json.dumps({"root": str(root), "api": api}, indent=1) + "\n")
    st.copy_tree(HERE / "_static", "_static")
    if mathjax is not None:
        st.copy_tree(mathjax(), "_static/mathjax")
    st.prune()
    return chapters


# -- MathJax from the npm registry ----------------------------------------------------------------

def mathjax(paths: Paths, lock_dir: Path = HERE / "mathjax") -> Path:
    """MathJax's es5 folder, installed by ``npm ci`` from the committed lock file (once per lock)."""
    lock = (lock_dir / "package-lock.json").read_bytes()
    stamp = paths.npm / ".lock-sha256"
    es5 = paths.npm / "node_modules" / "mathjax" / "es5"
    digest = hashlib.sha256(lock + (lock_dir / "package.json").read_bytes()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == digest and (es5 / "tex-chtml.js").is_file()):
        npm = shutil.which("npm")
        if npm is None:
            raise SiteError("MathJax 3 comes from the npm registry and npm is not installed: install "
                            "Node.js with npm (Debian/Ubuntu: apt-get install npm), then make site again")
        paths.npm.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy2(lock_dir / name, paths.npm / name)
        print("== MathJax 3 from the npm registry (npm ci, pinned by website/mathjax/package-lock.json)",
              flush=True)
        run = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=paths.npm,
                             capture_output=True, text=True, check=False)
        if run.returncode != 0 or not (es5 / "tex-chtml.js").is_file():
            raise SiteError(f"npm ci of MathJax failed ({run.returncode}):\n{run.stdout}{run.stderr}")
        stamp.write_text(digest)
    selected = paths.npm / "mathjax-static"
    digest += " " + " ".join(MATHJAX_PARTS)
    if not (selected / ".from").is_file() or (selected / ".from").read_text() != digest:
        shutil.rmtree(selected, ignore_errors=True)
        for part in MATHJAX_PARTS:
            src = es5 / part
            if src.is_dir():
                shutil.copytree(src, selected / part)
            else:
                (selected / part).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, selected / part)
        shutil.copy2(es5.parent / "LICENSE", selected / "LICENSE")
        (selected / ".from").write_text(digest)
    return selected


# -- Sphinx ---------------------------------------------------------------------------------------

def sphinx(paths: Paths, *, jobs: str = "1", quiet: bool = True) -> int:
    from sphinx.cmd.build import build_main

    args = ["-b", "html", "-W", "--keep-going", "-j", jobs, "-d", str(paths.doctrees)]
    if quiet:
        args.append("-q")
    return build_main([*args, str(paths.src), str(paths.out)])


def build(paths: Paths | None = None, *, clean: bool = False, api: bool = True, jobs: str = "1",
          quiet: bool = True) -> float:
    """Stage and build the site; returns the seconds it took. Raises SiteError for a bad source."""
    paths = paths or Paths()
    t0 = time.perf_counter()
    if clean:
        for d in (paths.src, paths.out, paths.doctrees, paths.build / "jupyter_execute"):
            shutil.rmtree(d, ignore_errors=True)
    stage(paths, api=api, mathjax=lambda: mathjax(paths))
    rc = sphinx(paths, jobs=jobs, quiet=quiet)
    if rc != 0:
        # Sphinx saved what it read: the next build would not read (and warn about) those pages again
        shutil.rmtree(paths.doctrees, ignore_errors=True)
        raise SiteError(f"sphinx-build failed (exit status {rc}); the warnings above say where "
                        f"(paths under {paths.src} are the staged copies of the repository's files)")
    return time.perf_counter() - t0


def site_size(out: Path) -> tuple[int, int]:
    files = [f for f in out.rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clean", action="store_true", help="rebuild from scratch (keeps the npm download)")
    ap.add_argument("--jobs", "-j", default="1", help="Sphinx's parallel jobs (default 1)")
    ap.add_argument("--verbose", "-v", action="store_true", help="Sphinx's progress, not only warnings")
    args = ap.parse_args(argv)
    paths = Paths()
    try:
        seconds = build(paths, clean=args.clean, jobs=args.jobs, quiet=not args.verbose)
    except SiteError as e:
        print(f"make site: {e}", file=sys.stderr)
        return 1
    n, size = site_size(paths.out)
    rel = paths.out.relative_to(paths.root) if paths.out.is_relative_to(paths.root) else paths.out
    print(f"site built in {seconds:.1f} s: {rel}/ ({n} files, {size / 2**20:.1f} MiB); "
          f"read it with: make serve-site")
    return 0


if __name__ == "__main__":
    sys.exit(main())
