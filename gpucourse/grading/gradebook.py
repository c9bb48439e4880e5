"""The gradebook: one row per student × exercise, as CSV, JSON, a stdout table and feedback files.

**One rule for points**, the same in ``grade`` and in the nbgrader export: an exercise earns its
points (the ``points`` metadata of its check cell, default 1) when its check passes — and, when
the hidden checks were run (``--hidden``; nbgrader's autograde always), its hidden check too.
Anything else earns 0.

CSV/JSON columns (:data:`COLUMNS`)::

    student   the student's folder (or the file name when submissions are flat)
    notebook  the submitted file
    exercise  NN.k ("-" for a notebook whose chapter is unknown and that could not be graded)
    title     the exercise's check title (the file's name for a "-" row)
    visible   ✓ / ✗ — the course's check
    hidden    ✓ / ✗ / "" — its hidden check ("" without --hidden)
    points    points earned under the rule above;  max  the exercise's points
    seconds   time the check cells ran
    error     the first line of the judge's reason (or why the notebook was not graded)
    restored  "edited" (the check was changed: restored), "deleted" (put back), "missing" (0 points)
    status    graded / unreadable / duplicate / wrong chapter / no release / no checks / not graded /
              ignored (another copy of a chapter whose release-named file is graded: a "-" row, 0 of 0)

The JSON also records the grading run: when (``date``, ISO 8601, UTC), with what (``course``: the
course's version and git commit when it has one, and the release the checks came from; ``grader``:
the grader's version and Python's), the isolation in force, the seed every check's inputs were
drawn from (``grade --seed`` with it reproduces the grades), and per notebook its wall time and the
errors of cells that are not checks.

The totals file (``--totals``, :data:`TOTALS_COLUMNS`) is one line per student for an LMS to
import: ``student, points, max, percent``.

**A student writes much of what is in here** (their folder's and files' names, their exceptions'
messages, the values the judge quotes back), so every such text is cut where it is stored or printed
(:func:`cut`: 200 characters for a name, 2,000 for an error, "… [cut, N characters]" after it); a
CSV cell never starts with ``= + - @``, a tab or a CR (a quote is put before it, as OWASP advises
against formula injection); the terminal, the CSV, the totals and the feedback are shown control and
format characters as escapes, ``\\n``, ``\\x1b`` or ``\\u202e`` (:func:`printable`; the JSON keeps
the text, with the controls below U+0020 escaped as JSON does); the feedback shows a student's text as code or plain text, never as
a link or an image (:func:`feedback_html` renders none at all).
"""

from __future__ import annotations

import csv
import hashlib
import html
import json
import re
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["COLUMNS", "NotAGradebook", "Row", "TOTALS_COLUMNS", "Update", "csv_cell", "cut", "earned",
           "printable", "students_in", "summary_table", "write_csv", "write_feedback", "write_json",
           "write_totals"]

NAME_LIMIT = 200            # a student's, a notebook's or a title's name, wherever it is stored or shown
ERROR_LIMIT = 2_000         # an error (one line) in the gradebook and on the terminal
MESSAGE_LIMIT = 3_000       # the judge's full message, shown in the feedback


def cut(text, limit: int) -> str:
    """``text`` with at most ``limit`` of its characters, saying how many were cut, and writable as
    UTF-8 (a file name that is not, ``b"ann\\xff"``, keeps its bytes as ``\\udcff``-style escapes).

    Example::

        >>> cut("abcdef", 4), cut("abc", 4), cut("ann\\udcff", 10)
        ('abcd… [cut, 2 characters]', 'abc', 'ann\\\\udcff')
    """
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else f"{text[:limit]}… [cut, {len(text) - limit} characters]"


_HIDDEN_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}     # controls, format (bidi…), surrogates, separators


def printable(text, limit: int | None = None) -> str:
    """``text`` as one line that the terminal shows as it is: control characters (newlines, ANSI
    escapes), Unicode format characters (bidi overrides) and line separators written as escapes,
    the way ``repr`` writes them; then cut to ``limit``.

    Example::

        >>> print(printable("bob\\n\\x1b[31mred\\u202e"))
        bob\\n\\x1b[31mred\\u202e
    """
    text = "".join(repr(c)[1:-1] if unicodedata.category(c) in _HIDDEN_CATEGORIES else c for c in str(text))
    return cut(text, limit) if limit is not None else text


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value):
    """A value for a CSV cell that no spreadsheet runs as a formula: a text starting with one of
    ``= + - @``, a tab or a CR gets a ``'`` in front (OWASP's advice on CSV injection).

    Example::

        >>> print(csv_cell('=HYPERLINK("x")'), csv_cell("alice"), csv_cell(3.0))
        '=HYPERLINK("x") alice 3.0
    """
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA_START) else value


def _csv_text(value):
    """A value for the CSV or totals file: a text with its control and format characters escaped
    (:func:`printable`: no ESC or bidi override reaches a terminal or viewer that shows the file)
    and no formula start (:func:`csv_cell`)."""
    return csv_cell(printable(value)) if isinstance(value, str) else value


@dataclass
class Row:
    student: str
    notebook: str
    exercise: str
    title: str
    visible: str
    hidden: str
    points: float
    max: float
    seconds: float
    error: str
    restored: str
    status: str
    message: str = ""        # the judge's full message (feedback only; never a hidden check's source)
    note: str = ""           # how the notebook was matched ("homework.ipynb: chapter 02 by its exercise
                             # ids"): in the student's line of the table and the feedback, not a column
    unsolved: bool = False   # failed because the exercise is not implemented yet (the judge says so):
                             # its inputs do not matter, so check names no seed for it; not a column

    def __post_init__(self):
        # a student's exception or value can be megabytes long: cut once, for every output
        self.error = cut(self.error, ERROR_LIMIT)
        self.message = cut(self.message, MESSAGE_LIMIT)
        self.note = cut(self.note, ERROR_LIMIT)


COLUMNS = [f for f in Row.__dataclass_fields__ if f not in ("message", "note", "unsolved")]
TOTALS_COLUMNS = ["student", "points", "max", "percent"]


def earned(points: float, visible_passed: bool, hidden_passed: bool | None) -> float:
    """The rule: full points when the check passes and the hidden check (if run) passes, else 0.

    Example::

        >>> earned(2, True, None), earned(2, True, True), earned(2, True, False), earned(2, False, True)
        (2, 2, 0, 0)
    """
    return points if visible_passed and hidden_passed is not False else 0


def stored(r: Row) -> dict:
    """A row's columns as stored in the gradebook, each text a student controls cut to its limit."""
    out = {k: v for k, v in asdict(r).items() if k in COLUMNS}
    for k in ("student", "notebook", "title"):
        out[k] = cut(out[k], NAME_LIMIT)
    out["error"] = cut(out["error"], ERROR_LIMIT)
    return out


class NotAGradebook(ValueError):
    """A file in the way of a gradebook that is not one this grader wrote (not overwritten)."""


def stored_student(student: str, kind: str) -> str:
    """A student's name as a gradebook of ``kind`` (``"csv"``, ``"json"``, ``"totals"``) stores it."""
    name = cut(student, NAME_LIMIT)
    return name if kind == "json" else _csv_text(name)


def _read_records(path: Path, kind: str) -> tuple[list[dict], dict]:
    """(records, the rest of a JSON gradebook) of an existing gradebook; ``([], {})`` when there is
    none or it is empty; :class:`NotAGradebook` when the file is something else."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], {}
    except (OSError, UnicodeDecodeError) as e:
        raise NotAGradebook(f"{path} cannot be read as a gradebook: {e}") from None
    if not text.strip():
        return [], {}
    if kind == "json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise NotAGradebook(f"{path} is not a JSON gradebook: {e}") from None
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "student" in r for r in rows):
            raise NotAGradebook(f"{path} is not a JSON gradebook of this grader (no rows with a student)")
        return rows, data
    header = TOTALS_COLUMNS if kind == "totals" else COLUMNS
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames != header:
        raise NotAGradebook(f"{path} is not a {'totals file' if kind == 'totals' else 'CSV gradebook'} of "
                            f"this grader (its columns: {', '.join(reader.fieldnames or [])[:200]})")
    return list(reader), {}


def students_in(path: str | Path, kind: str) -> list[str]:
    """The students an existing gradebook file holds, as it stores them, in its order."""
    records, _ = _read_records(Path(path), kind)
    return list(dict.fromkeys(r["student"] for r in records))


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old``'s records with each student of ``new`` replaced by ``new``'s records (where the
    student's first old record was); students only in ``new`` after.

    Example::

        >>> _merge([{"student": "a", "x": 1}, {"student": "b", "x": 1}, {"student": "a", "x": 2}],
        ...        [{"student": "a", "x": 3}, {"student": "c", "x": 3}])
        [{'student': 'a', 'x': 3}, {'student': 'b', 'x': 1}, {'student': 'c', 'x': 3}]
    """
    fresh: dict[str, list[dict]] = {}
    for r in new:
        fresh.setdefault(r["student"], []).append(r)
    out, placed = [], set()
    for r in old:
        s = r.get("student")
        if s not in fresh:
            out.append(r)
        elif s not in placed:
            out += fresh[s]
            placed.add(s)
    for s, records in fresh.items():
        if s not in placed:
            out += records
    return out


@dataclass
class Update:
    """What writing a gradebook with ``update=True`` did, student by student."""

    regraded: list[str]         # this run's students already in the file (their records replaced)
    added: list[str]            # this run's students new to the file
    kept: int                   # other students' records left as they were


def _update(old: list[dict], new: list[dict]) -> tuple[list[dict], Update]:
    before = list(dict.fromkeys(r.get("student") for r in old))
    now = list(dict.fromkeys(r["student"] for r in new))
    return _merge(old, new), Update([s for s in now if s in before], [s for s in now if s not in before],
                                    len([s for s in before if s not in now]))


def _write_table(path: Path, header: list[str], records: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)


def write_csv(rows: list[Row], path: str | Path, *, update: bool = False) -> Update | None:
    """The gradebook as CSV. With ``update``, merged into the file already there, student by
    student (:func:`_merge`): returns what changed."""
    # the exercise column is the course's own ("NN.k", or "-" for a notebook not graded)
    records = [{k: v if k == "exercise" else _csv_text(v) for k, v in stored(r).items()} for r in rows]
    done = None
    if update:
        records, done = _update(_read_records(Path(path), "csv")[0], records)
    _write_table(Path(path), COLUMNS, records)
    return done


def write_totals(rows: list[Row], path: str | Path, *, update: bool = False) -> Update | None:
    """One line per student, for an LMS to import: ``student, points, max, percent`` (percent of the
    maximum, two decimals at most; empty when the maximum is 0), escaped as :func:`write_csv` does.
    With ``update``, merged into the file already there, student by student."""
    records = []
    for student, t in _totals(rows).items():
        percent = _num(round(100 * t["points"] / t["max"], 2)) if t["max"] else ""
        records.append({"student": stored_student(student, "totals"), "points": _num(t["points"]),
                        "max": _num(t["max"]), "percent": percent})
    done = None
    if update:
        records, done = _update(_read_records(Path(path), "totals")[0], records)
    _write_table(Path(path), TOTALS_COLUMNS, records)
    return done


def write_json(rows: list[Row], path: str | Path, *, isolation: str = "", seed: int | None = None,
               notebooks: list[dict] | None = None, provenance: dict | None = None,
               update: bool = False) -> Update | None:
    """The gradebook as JSON: this run's ``provenance`` (date, course and grader versions, release),
    isolation and seed, then ``notebooks`` and ``rows``. With ``update``, rows and notebooks are
    merged into the file already there, student by student; the file's earlier provenance moves to
    ``earlier_runs``, each naming the students whose rows it still holds."""
    data = {**(provenance or {}), "isolation": isolation, "seed": seed, "notebooks": notebooks or [],
            "rows": [stored(r) for r in rows]}
    done = None
    if update:
        old_rows, old = _read_records(Path(path), "json")
        data["rows"], done = _update(old_rows, data["rows"])
        if old:
            data["notebooks"] = _merge([n for n in old.get("notebooks", []) if isinstance(n, dict)],
                                       data["notebooks"])
            regraded = set(done.regraded)
            run = {k: v for k, v in old.items() if k not in ("rows", "notebooks", "earlier_runs")}
            before = {s for e in old.get("earlier_runs", []) for s in e.get("students", [])}
            run["students"] = list(dict.fromkeys(r["student"] for r in old_rows
                                                 if r["student"] not in before))
            earlier = []
            for e in [*old.get("earlier_runs", []), run]:
                e = dict(e, students=[s for s in e.get("students", []) if s not in regraded])
                if e["students"]:
                    earlier.append(e)
            if earlier:
                data["earlier_runs"] = earlier
    Path(path).write_text(_json_text(data) + "\n", encoding="utf-8")
    return done


def _json_text(data) -> str:
    """``data`` as JSON whose text a terminal shows as it is: readable non-ASCII (``ensure_ascii=False``),
    but every control, format (bidi override) and separator character a student's text brings written
    as a ``\\u`` escape — ``json`` escapes only those below U+0020, so DEL, the C1 controls (U+009B:
    a one-character CSI) and U+202E reached ``cat grades.json`` raw. ``json.loads`` reads the same data.

    Example::

        >>> print(_json_text({"student": "mal\\u202elory\\x9b2J", "note": "✓"}))
        {
         "student": "mal\\u202elory\\u009b2J",
         "note": "✓"
        }
    """
    text = json.dumps(data, indent=1, ensure_ascii=False)
    return "".join(json.dumps(c)[1:-1] if c != "\n" and unicodedata.category(c) in _HIDDEN_CATEGORIES else c
                   for c in text)


def _num(x: float) -> str:
    return f"{x:g}"


def _totals(rows: list[Row]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        t = out.setdefault(r.student, {"points": 0.0, "max": 0.0, "vis": 0, "hid": 0, "hid_n": 0, "n": 0,
                                       "notes": [], "notebooks": []})
        t["points"] += r.points
        t["max"] += r.max
        if r.exercise != "-":
            t["n"] += 1
            t["vis"] += r.visible == "✓"
        if r.hidden:
            t["hid_n"] += 1
            t["hid"] += r.hidden == "✓"
        if r.notebook not in t["notebooks"]:
            t["notebooks"].append(r.notebook)
        note = f"ignored {r.notebook}" if r.status == "ignored" else r.status if r.status != "graded" else ""
        for n in (note, r.note):
            if n and n not in t["notes"]:
                t["notes"].append(n)
        if r.restored and f"{r.exercise} {r.restored}" not in t["notes"]:
            t["notes"].append(f"{r.exercise} {r.restored}")
    return out


def summary_table(rows: list[Row]) -> str:
    """Per-student totals, one line each.

    Example::

        >>> rows = [Row("alice", "a.ipynb", "00.1", "t", "✓", "✓", 1, 1, 1.0, "", "", "graded"),
        ...         Row("bob", "b.ipynb", "00.1", "t", "✓", "✗", 0, 1, 1.0, "E", "edited", "graded")]
        >>> print(summary_table(rows))
        student  points  checks  hidden  notes
        alice       1/1     1/1     1/1
        bob         0/1     1/1     0/1  00.1 edited
    """
    totals = [(printable(s, NAME_LIMIT), t) for s, t in _totals(rows).items()]    # one line each
    width = max([len("student")] + [len(s) for s, _ in totals])
    lines = [f"{'student':<{width}}  points  checks  hidden  notes"]
    for student, t in totals:
        pts = f"{_num(t['points'])}/{_num(t['max'])}"
        checks = f"{t['vis']}/{t['n']}"
        hidden = f"{t['hid']}/{t['hid_n']}" if t["hid_n"] else "-"
        notes = ", ".join(printable(n, ERROR_LIMIT) for n in t["notes"])     # file names are the student's
        lines.append(f"{student:<{width}}  {pts:>6}  {checks:>6}  {hidden:>6}  {notes}".rstrip())
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, no pipes that would split it."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text) -> str:
    """A student's text as an inline code span (one line): Markdown renders nothing in it — no link,
    no image, no emphasis — whatever backticks it holds.

    Example::

        >>> print(_code("[x](https://evil.example)"), _code("a `b` c"), _code("`"))
        `[x](https://evil.example)` ``a `b` c`` `` ` ``
    """
    text = printable(" ".join(str(text).split()))
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks in ``text``: the text cannot close it."""
    return "`" * max(3, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)


def feedback_markdown(student: str, rows: list[Row]) -> str:
    """One student's feedback as Markdown: totals, a row per exercise, then what to look at.

    What the student wrote (their name, their files' names, errors and the judge's messages, which
    quote their values) is shown as code, never rendered: no link or image from it is live.
    """
    t = _totals(rows)[student]
    lines = [f"# Feedback for {_code(cut(student, NAME_LIMIT))}", "",
             "Notebook: " + ", ".join(_code(cut(n, NAME_LIMIT)) for n in t["notebooks"]), "",
             *[line for n in dict.fromkeys(r.note for r in rows if r.note) for line in (f"Note: {_code(n)}", "")],
             f"Points: **{_num(t['points'])} / {_num(t['max'])}** — an exercise earns its points when "
             "its check passes, and its hidden check too when one was run.", "",
             "| exercise | check | hidden | points | note |", "|---|---|---|---|---|"]
    for r in rows:
        parts = []
        if r.restored:
            parts.append(f"check cell {r.restored}" + (" — restored" if r.restored == "edited" else ""))
        if r.error:
            parts.append(_code(cut(r.error, ERROR_LIMIT)))
        # an exercise's title is the course's; a "-" row's is the file's name, the student's
        label = f"{r.exercise} {r.title}" if r.exercise != "-" else _code(cut(r.title, NAME_LIMIT))
        lines.append(f"| {_cell(label)} | {r.visible} | {r.hidden or '-'} | {_num(r.points)}/{_num(r.max)} | "
                     f"{_cell('; '.join(parts))} |")
    failed = [r for r in rows if (r.points < r.max or r.visible != "✓") and r.status != "ignored"]
    if failed:
        lines += ["", "## What to look at", ""]
        for r in failed:
            lines += [f"### {r.exercise} — {r.title}" if r.exercise != "-" else
                      f"### {_code(cut(r.title, NAME_LIMIT))}", ""]
            message = cut((r.message or r.error or "").strip(), MESSAGE_LIMIT)
            message = "\n".join(printable(line) for line in message.split("\n"))    # its lines kept
            if message:
                fence = _fence(message)
                lines += [fence, message, fence, ""]
    return "\n".join(lines) + "\n"


def feedback_html(markdown_text: str, title: str) -> str:
    """The Markdown feedback as a page: rendered by markdown-it-py, with raw HTML in it (a student's
    output, say) shown as text, never interpreted, and no link or image rendered at all (the
    feedback's own Markdown has none, so any would be a student's)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
    body = md.disable(["link", "image", "autolink"]).render(markdown_text)
    style = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3rem .5rem;vertical-align:top}"
             "pre{background:#f6f6f6;padding:.6rem;overflow-x:auto;white-space:pre-wrap}")
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n{body}</body></html>\n")


def _file_names(students) -> dict[str, str]:
    """A feedback file name (without suffix) per student, never the same for two students: the name
    itself when it is plain (letters, digits, ``-_.``, not hidden, short), else a plain version of it
    with a hash of the real name; a clash (two students' plain names, or a case-insensitive disk)
    gets a number."""
    names, used = {}, set()
    for student in students:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in student)
        if safe != student or not safe or safe.startswith(".") or len(safe.encode()) > 100:
            digest = hashlib.sha256(student.encode("utf-8", "surrogatepass")).hexdigest()[:12]
            safe = f"{safe.lstrip('.')[:40].rstrip('.') or 'student'}-{digest}"
        name, k = safe, 1
        while name.lower() in used:
            k += 1
            name = f"{safe}-{k}"
        used.add(name.lower())
        names[student] = name
    return names


def write_feedback(rows: list[Row], folder: str | Path, *, fmt: str = "md") -> list[Path]:
    """One feedback file per student (Markdown, or HTML with ``fmt="html"``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    totals = _totals(rows)
    names = _file_names(totals)
    for student in totals:
        text = feedback_markdown(student, [r for r in rows if r.student == student])
        if fmt == "html":
            path = folder / f"{names[student]}.html"
            path.write_text(feedback_html(text, f"Feedback for {printable(student, NAME_LIMIT)}"),
                            encoding="utf-8")
        else:
            path = folder / f"{names[student]}.md"
            path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
