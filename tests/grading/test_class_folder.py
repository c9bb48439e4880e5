"""Issue 37, part 5: the class's own folder is an attack surface.

A student controls what is in their folder: its name, the names of the files in it, symbolic links,
folders inside it, and every text their notebook makes (exception messages, values the judge
quotes back). Each attack below is built in a class of the tiny chapter-99 release and graded the
way a teacher does (``grade subs/*``); the tests check that the attack fails and is reported:

* a link to the course's ``solutions/`` notebook (or a folder linked to ``solutions/``) scores 0
  and the student's row says "not graded: … is a symbolic link";
* a link to a classmate's notebook neither takes the classmate's grade nor removes the classmate
  from the gradebook;
* a notebook in a folder inside a student's folder (``aaron/zoe/…``) is refused in aaron's row,
  never graded as zoe;
* a student named ``=HYPERLINK(…)`` is no formula in the CSV, one named with a newline forges no
  line of the printed summary, one with terminal escapes sends none to the terminal;
* a 3 MB exception message is cut in the JSON gradebook and on stdout;
* the HTML feedback holds no link and no remote image made from a student's text;
* a dangling link does not stop the class from being graded (it is that student's row), nor does a
  folder name that is not UTF-8 stop the gradebook from being written.

Discovery-only checks (no notebook runs, milliseconds) cover ``grade subs/`` as well as
``grade subs/*``, single folders and files, a link swapped in after the folder was listed, and a FIFO
named like a notebook; unit checks cover the feedback's file names and code fences.
"""

import contextlib
import csv
import io
import json
import os
import re
from pathlib import Path

import pytest
from _grading_helpers import TINY, tiny_solutions, tiny_submission, write_tiny_course

from gpucourse.grading.grade import Options, discover, grade
from gpucourse.grading.sandbox import isolation

HAVE_BWRAP = isolation() == "bwrap"
NO_BWRAP = "bwrap (Debian package bubblewrap) is not installed or does not work here"

FORMULA = '=HYPERLINK("evil.example","see your grade")'
FORGED = "bob      3∕3     1∕1     1∕1"              # ∕ (U+2215): a folder name holds no "/"
NEWLINE = "mallet\x1b[2J\n" + FORGED
BIG = 3_000_000
BYTES = os.fsdecode(b"bytes\xff")
PHISH = ("[click here](https://evil.example/login) ![t](https://evil.example/t.png) <https://evil.example/a>"
         "\n````\n[and here](https://evil.example/fence) ![u](https://evil.example/u.png)\n````")


def _class(root: Path) -> tuple[Path, Path, Path]:
    """(release, solutions, subs): the tiny release and a class with every attack in it."""
    subs = root / "subs"
    rel, sol = write_tiny_course(root, tiny_solutions(hidden=True, points=3))
    zoe = tiny_submission(subs, "zoe", "return x * x")                     # the honest classmate
    (subs / "mallory").mkdir()
    (subs / "mallory" / TINY).symlink_to(sol / TINY)                       # the course's answers
    (subs / "trudy").symlink_to(sol)                                       # a folder: solutions/
    (subs / "copycat").mkdir()
    (subs / "copycat" / TINY).symlink_to(Path("..") / "zoe" / TINY)       # the classmate's work
    nested = tiny_submission(subs, "aaron", "return 0")                    # aaron/zoe/…: not zoe
    (subs / "aaron" / "zoe").mkdir()
    nested.rename(subs / "aaron" / "zoe" / TINY)
    for name in (FORMULA, NEWLINE):                                        # names only: nothing runs
        (subs / name).mkdir()
        (subs / name / TINY).write_bytes(b'{"cells": [')
    tiny_submission(subs, "loud", f"raise ValueError('x' * {BIG})",
                    extra=[f"raise RuntimeError('y' * {BIG})"])
    tiny_submission(subs, "phish", f"raise ValueError({PHISH!r})")
    tiny_submission(subs, "phish2", "return '[x](https://evil.example/v) ![i](https://evil.example/i.png)'")
    (subs / "ghost").symlink_to(root / "nowhere")                          # a dangling link
    (subs / BYTES).mkdir()                                                 # a name that is not UTF-8
    (subs / BYTES / TINY).symlink_to(Path("..") / "zoe" / TINY)
    assert zoe.is_file() and not zoe.is_symlink()
    return rel, sol, subs


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The class graded as ``grade subs/* --hidden solutions/ --csv --json --feedback (html)``."""
    if not HAVE_BWRAP:
        pytest.skip(NO_BWRAP)
    root = tmp_path_factory.mktemp("classfolder")
    rel, sol, subs = _class(root)
    out, table, fb = root / "g.json", root / "g.csv", root / "fb"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = grade(sorted(map(str, subs.iterdir())), release=str(rel), hidden_from=str(sol), workers=1,
                     json_path=str(out), csv_path=str(table), feedback=str(fb), feedback_format="html",
                     options=Options(cell_timeout=60, notebook_timeout=120))
    (root / "stdout.txt").write_text(buf.getvalue(), encoding="utf-8")       # to read when a test fails
    data = json.loads(out.read_text(encoding="utf-8"))
    return {"code": code, "data": data, "rows": data["rows"], "csv": table.read_text(encoding="utf-8"),
            "stdout": buf.getvalue(), "feedback": fb, "subs": subs}


def _mine(graded, student):
    return [r for r in graded["rows"] if r["student"] == student]


def test_a_link_to_the_solutions_scores_zero_and_is_reported(graded):
    for student, name in (("mallory", TINY), ("trudy", "trudy"), ("ghost", "ghost")):
        rows = _mine(graded, student)
        assert rows, f"{student} has no row: {[r['student'] for r in graded['rows']]}"
        assert sum(r["points"] for r in rows) == 0, rows
        assert all(r["status"] == "not graded" for r in rows), rows
        assert all(f"not graded: {name} is a symbolic link" in r["error"] for r in rows), rows
        assert f"not graded: {name} is a symbolic link" in graded["stdout"]
    assert graded["code"] == 2                      # a submission that could not be graded


def test_a_link_to_a_classmates_notebook_leaves_the_classmate_alone(graded):
    zoe = _mine(graded, "zoe")
    assert [Path(n["notebook"]).parent.name for n in graded["data"]["notebooks"]
            if n["student"] == "zoe"] == ["zoe"]                                   # her own file only
    assert zoe and all(r["status"] == "graded" and r["visible"] == "✓" for r in zoe), zoe
    assert sum(r["points"] for r in zoe) == sum(r["max"] for r in zoe) > 0, zoe
    copycat = _mine(graded, "copycat")
    assert copycat and sum(r["points"] for r in copycat) == 0, copycat
    assert all(f"not graded: {TINY} is a symbolic link" in r["error"] for r in copycat), copycat


def test_a_folder_inside_a_students_folder_is_refused_in_their_row(graded):
    aaron = _mine(graded, "aaron")
    assert aaron and sum(r["points"] for r in aaron) == 0, aaron
    assert all(r["status"] == "not graded" and "zoe" in r["error"] and "folder inside" in r["error"]
               for r in aaron), aaron
    zoe = _mine(graded, "zoe")
    assert {r["status"] for r in zoe} == {"graded"}, zoe                        # not "duplicate"
    assert all(r["visible"] == "✓" for r in zoe), zoe                            # her answer, not aaron's


def test_a_formula_as_a_name_is_text_in_the_csv(graded):
    cells = [cell for row in csv.reader(io.StringIO(graded["csv"])) for cell in row]
    bad = [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r") and c != "-"]
    assert bad == [], bad
    assert "'" + FORMULA in cells


def test_a_newline_in_a_name_forges_no_line_and_no_escape_reaches_the_terminal(graded):
    out = graded["stdout"]
    assert "\x1b" not in out, "an ANSI escape from a folder name reached the terminal"
    forged = [line for line in out.splitlines() if line.lstrip().startswith("bob")]
    assert forged == [], forged
    assert "mallet\\x1b[2J\\nbob" in out                           # shown, escaped
    assert "\x1b" not in graded["csv"] and "mallet\\x1b[2J\\nbob" in graded["csv"]     # in the CSV too
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if re.match(r"student +points +checks", line))
    table = lines[header + 1:lines.index("", header)]
    names = {r["student"] for r in graded["rows"]}
    assert len(table) == len(names), table                      # one line per student, no more


def test_a_3_mb_message_is_cut_in_the_gradebook_and_on_stdout(graded):
    loud = _mine(graded, "loud")
    assert loud and all(len(r["error"]) < 2_200 for r in loud), [len(r["error"]) for r in loud]
    # cut where it is stored — by the gradebook, or already by the judge's one-line message
    assert all(re.search(r"… \[cut, \d+ characters\]|…|\.\.\.", r["error"] + r.get("message", "")) for r in loud), [r["error"][-80:] for r in loud]
    notebook, = [n for n in graded["data"]["notebooks"] if n["student"] == "loud"]
    assert notebook["other_errors"] and all(len(e) < 2_200 for e in notebook["other_errors"])
    raw = json.dumps(graded["data"])
    assert "x" * 5_000 not in raw and "y" * 5_000 not in raw
    assert "x" * 5_000 not in graded["stdout"] and "y" * 5_000 not in graded["stdout"]
    assert len(graded["stdout"]) < 100_000, len(graded["stdout"])
    assert "x" * 5_000 not in graded["csv"]


def test_html_feedback_has_no_live_link_or_remote_image(graded):
    pages = {p.stem: p.read_text(encoding="utf-8") for p in graded["feedback"].glob("*.html")}
    # phish raises with links in its message, which reaches the feedback; phish2 returns them as a value
    # where a number is expected, which the judge's message describes without quoting it
    assert "evil.example" in pages["phish"], "phish's message is not in the feedback"
    for student in ("phish", "phish2"):
        page = pages[student]
        assert "<a " not in page and "href=" not in page, page
        assert "<img" not in page and 'src="http' not in page, page
    assert all("<a href" not in p and "<img" not in p for p in pages.values())


# discovery only: no notebook runs, both forms of the command line ---------------------------------


@pytest.fixture
def klass(tmp_path):
    return _class(tmp_path)


@pytest.mark.parametrize("form", ["subs/", "subs/*"])
def test_discovery_refuses_links_and_nested_folders_in_every_form(klass, form):
    _, _, subs = klass
    args = [str(subs)] if form == "subs/" else sorted(map(str, subs.iterdir()))
    found = discover(args)
    by = {}
    for s in found:
        by.setdefault(s.student, []).append(s)
    # every student is a top-level folder of the class, and nothing else
    assert set(by) == {p.name for p in subs.iterdir()}, sorted(by)
    zoe, = by["zoe"]
    assert zoe.problem == "" and zoe.path == subs / "zoe" / TINY
    assert zoe.data == (subs / "zoe" / TINY).read_bytes()
    for student, name in (("mallory", TINY), ("trudy", "trudy"), ("copycat", TINY), ("ghost", "ghost")):
        sub, = by[student]
        assert sub.data is None and sub.problem == f"not graded: {name} is a symbolic link", sub
    aaron, = by["aaron"]
    assert aaron.data is None and aaron.problem.startswith("not graded: ") and "zoe" in aaron.problem, aaron
    refused = {"mallory", "trudy", "copycat", "ghost", "aaron", BYTES}
    assert all(s.data is not None and not s.problem for s in found if s.student not in refused)


def test_a_symlinked_file_argument_and_a_symlinked_student_folder_argument_are_refused(klass):
    _, sol, subs = klass
    mallory, = discover([str(subs / "mallory" / TINY)])
    assert mallory.student == "mallory" and mallory.data is None and "symbolic link" in mallory.problem
    trudy, = discover([str(subs / "trudy")])
    assert trudy.student == "trudy" and trudy.data is None and "symbolic link" in trudy.problem
    # a course notebook reached through a linked folder belongs to nobody: refused, not read
    inside, = discover([str(subs / "trudy" / TINY)])
    assert inside.data is None and "symbolic link" in inside.problem, inside


def test_a_single_student_folder_and_single_files_keep_working(klass):
    _, _, subs = klass
    zoe, = discover([str(subs / "zoe")])
    assert (zoe.student, zoe.problem) == ("zoe", "") and zoe.data
    zoe, = discover([str(subs / "zoe" / TINY)])
    assert (zoe.student, zoe.problem) == ("zoe", "") and zoe.data
    flat = subs.parent / "flat"
    flat.mkdir()
    (flat / "carol.ipynb").write_bytes((subs / "zoe" / TINY).read_bytes())
    (flat / "dave.ipynb").symlink_to(subs / "zoe" / TINY)
    found = {s.student: s for s in discover([str(flat)])}
    assert found["carol"].data and found["carol"].problem == ""
    assert found["dave"].data is None and found["dave"].problem == "not graded: dave.ipynb is a symbolic link"
    # the same file named twice is graded once
    assert len(discover([str(subs / "zoe"), str(subs / "zoe" / TINY)])) == 1


def test_a_link_swapped_in_after_the_listing_is_not_followed(klass, monkeypatch):
    """The race: the folder is listed while the notebook is a regular file, then a link replaces it
    before it is read. Reading opens with O_NOFOLLOW and checks what it opened."""
    from gpucourse.grading import grade as grade_module

    _, sol, subs = klass
    victim = subs / "zoe" / TINY
    real_open = os.open

    def swapping_open(path, flags, *args, **kw):
        if str(path).endswith(TINY) and not victim.is_symlink():
            victim.unlink()
            victim.symlink_to(sol / TINY)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(grade_module.os, "open", swapping_open)
    zoe, = discover([str(subs / "zoe")])
    assert victim.is_symlink()                                   # the swap happened
    assert zoe.data is None and "symbolic link" in zoe.problem, zoe


@pytest.mark.timeout(30)
def test_a_fifo_named_like_a_notebook_does_not_hang_discovery(tmp_path):
    (tmp_path / "subs" / "fifo").mkdir(parents=True)
    os.mkfifo(tmp_path / "subs" / "fifo" / TINY)
    sub, = discover([str(tmp_path / "subs")])
    assert sub.student == "fifo" and sub.data is None and "not a regular file" in sub.problem, sub


def test_feedback_files_of_look_alike_or_long_names_never_overwrite_each_other(tmp_path):
    from gpucourse.grading.gradebook import Row, write_feedback

    names = ["zoe_", "zoe?", "zoe*", "é" * 250, "é" * 249 + "è", "..", "."]
    rows = [Row(n, TINY, "99.1", "square", "✓", "", 3, 3, 0.1, "", "", "graded") for n in names]
    for fmt in ("md", "html"):
        written = write_feedback(rows, tmp_path / fmt, fmt=fmt)
        assert len({p.name for p in written}) == len(names), [p.name for p in written]
        assert all(p.parent == tmp_path / fmt and len(p.name.encode()) <= 255 for p in written)
        assert sorted(p.name for p in (tmp_path / fmt).iterdir()) == sorted(p.name for p in written)


def test_a_name_that_is_not_utf8_is_a_row_and_the_gradebook_is_written(graded):
    rows = _mine(graded, "bytes\\udcff")
    assert rows and all("symbolic link" in r["error"] for r in rows), [r["student"] for r in graded["rows"]]
    assert "bytes\\udcff" in graded["csv"] and "bytes\\udcff" in graded["stdout"]
    assert any(p.name.startswith("bytes_-") for p in graded["feedback"].iterdir())


def test_a_message_cannot_close_the_feedbacks_code_fence(tmp_path):
    from gpucourse.grading.gradebook import Row, feedback_markdown, write_feedback

    message = "99.1 failed\n````\n[click](https://evil.example/x)\n``````\n![i](https://evil.example/i.png)"
    rows = [Row("eve", TINY, "99.1", "square", "✗", "", 0, 3, 0.1, "[e](https://evil.example/e) `x`", "",
                "graded", message=message),
            Row("eve", "[n](https://evil.example/n).ipynb", "-", "[n](https://evil.example/n).ipynb", "✗", "",
                0, 0, 0.0, "unreadable", "", "unreadable")]
    text = feedback_markdown("eve", rows)
    assert "```````\n" + message + "\n```````" in text                # a fence longer than any run in it
    from markdown_it import MarkdownIt

    page = MarkdownIt("commonmark", {"html": False}).enable("table").render(text)   # links left on
    assert "<a " not in page and "<img" not in page, page
    path, = write_feedback(rows, tmp_path, fmt="html")
    html = path.read_text(encoding="utf-8")
    assert "evil.example/x" in html and "<a " not in html and "<img" not in html, html


def test_no_control_or_format_character_of_a_student_reaches_the_csv_totals_or_feedback(tmp_path):
    """ESC sequences, a CR and a right-to-left override (U+202E) in a student's folder name, file name,
    exception and the judge's message are written escaped (``\\x1b``, ``\\u202e``) in the CSV, the
    totals and the feedback (Markdown and HTML), and as JSON escapes in the JSON, which reads back the
    same text (a C1 CSI, U+009B, and U+202E reached it raw); ``--update`` still finds the student."""
    from gpucourse.grading.gradebook import Row, write_csv, write_feedback, write_json, write_totals

    evil = "\x1b[2J\x1b[31m=red\u202e\r99.1 ✓\x9b2J"
    student, notebook = "mal\x1b[8mlory\u202e", f"nb{evil}.ipynb"
    rows = [Row(student, notebook, "99.1", "square", "✗", "✗", 0, 3, 0.1, f"ValueError: {evil}", "",
                "graded", message=f"99.1 failed\nValueError: {evil}\nsecond line", note=f"{notebook}: chapter 99"),
            Row(student, notebook, "-", notebook, "✗", "", 0, 0, 0.0, evil, "", "ignored")]
    files = {"csv": tmp_path / "g.csv", "totals": tmp_path / "t.csv", "json": tmp_path / "g.json"}
    for update in (False, True):                 # the second time merged into the files already there
        write_csv(rows, files["csv"], update=update)
        write_totals(rows, files["totals"], update=update)
    write_json(rows, files["json"])
    written = [*files.values(), *write_feedback(rows, tmp_path / "md"),
               *write_feedback(rows, tmp_path / "html", fmt="html")]
    for path in written:
        text = path.read_text(encoding="utf-8")
        assert not any(c in text for c in "\x1b\u202e\r\x9b"), (path.name, text)
        if path != files["json"]:
            assert "\\x1b[" in text and "\\u202e" in text, (path.name, text)        # shown, escaped
        else:
            assert "\\u001b[" in text and "\\u202e" in text and "\\u009b" in text, text
    assert json.loads(files["json"].read_text(encoding="utf-8"))["rows"][0]["student"] == student
    totals = list(csv.DictReader(io.StringIO(files["totals"].read_text(encoding="utf-8"))))
    assert [t["student"] for t in totals] == ["mal\\x1b[8mlory\\u202e"], totals     # updated, not doubled
    md = (tmp_path / "md").glob("*.md").__next__().read_text(encoding="utf-8")
    assert "99.1 failed\nValueError: \\x1b[2J" in md and "\nsecond line\n" in md     # the message's lines kept
