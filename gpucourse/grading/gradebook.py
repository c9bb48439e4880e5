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
    status    graded / unreadable / duplicate / wrong chapter / no release / no checks / not graded

The JSON also records the grading run: the isolation in force, the seed every check's inputs were
drawn from (``grade --seed`` with it reproduces the grades), and per notebook its wall time and the
errors of cells that are not checks.
"""

from __future__ import annotations

import csv
import html
import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["COLUMNS", "Row", "earned", "summary_table", "write_csv", "write_feedback", "write_json"]


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


COLUMNS = [f for f in Row.__dataclass_fields__ if f != "message"]


def earned(points: float, visible_passed: bool, hidden_passed: bool | None) -> float:
    """The rule: full points when the check passes and the hidden check (if run) passes, else 0.

    Example::

        >>> earned(2, True, None), earned(2, True, True), earned(2, True, False), earned(2, False, True)
        (2, 2, 0, 0)
    """
    return points if visible_passed and hidden_passed is not False else 0


def write_csv(rows: list[Row], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def write_json(rows: list[Row], path: str | Path, *, isolation: str = "", seed: int | None = None,
               notebooks: list[dict] | None = None) -> None:
    data = {"isolation": isolation, "seed": seed, "notebooks": notebooks or [],
            "rows": [{k: v for k, v in asdict(r).items() if k in COLUMNS} for r in rows]}
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


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
        if r.status != "graded" and r.status not in t["notes"]:
            t["notes"].append(r.status)
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
    totals = _totals(rows)
    width = max([len("student")] + [len(s) for s in totals])
    lines = [f"{'student':<{width}}  points  checks  hidden  notes"]
    for student, t in totals.items():
        pts = f"{_num(t['points'])}/{_num(t['max'])}"
        checks = f"{t['vis']}/{t['n']}"
        hidden = f"{t['hid']}/{t['hid_n']}" if t["hid_n"] else "-"
        lines.append(f"{student:<{width}}  {pts:>6}  {checks:>6}  {hidden:>6}  {', '.join(t['notes'])}".rstrip())
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, no pipes that would split it."""
    return " ".join(str(text).split()).replace("|", "\\|")


def feedback_markdown(student: str, rows: list[Row]) -> str:
    """One student's feedback as Markdown: totals, a row per exercise, then what to look at."""
    t = _totals(rows)[student]
    lines = [f"# Feedback for {student}", "", "Notebook: " + ", ".join(f"`{n}`" for n in t["notebooks"]), "",
             f"Points: **{_num(t['points'])} / {_num(t['max'])}** — an exercise earns its points when "
             "its check passes, and its hidden check too when one was run.", "",
             "| exercise | check | hidden | points | note |", "|---|---|---|---|---|"]
    for r in rows:
        parts = []
        if r.restored:
            parts.append(f"check cell {r.restored}" + (" — restored" if r.restored == "edited" else ""))
        if r.error:
            parts.append(r.error)
        label = f"{r.exercise} {r.title}" if r.exercise != "-" else r.title
        lines.append(f"| {_cell(label)} | {r.visible} | {r.hidden or '-'} | {_num(r.points)}/{_num(r.max)} | "
                     f"{_cell('; '.join(parts))} |")
    failed = [r for r in rows if r.points < r.max or r.visible != "✓"]
    if failed:
        lines += ["", "## What to look at", ""]
        for r in failed:
            lines += [f"### {r.exercise} — {r.title}" if r.exercise != "-" else f"### {r.title}", ""]
            message = (r.message or r.error or "").strip()
            if message:
                fence = "````" if "```" in message else "```"
                lines += [fence, message[:3000], fence, ""]
    return "\n".join(lines) + "\n"


def feedback_html(markdown_text: str, title: str) -> str:
    """The Markdown feedback as a page: rendered by markdown-it-py, with raw HTML in it (a student's
    output, say) shown as text, never interpreted."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown_text)
    style = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3rem .5rem;vertical-align:top}"
             "pre{background:#f6f6f6;padding:.6rem;overflow-x:auto;white-space:pre-wrap}")
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n{body}</body></html>\n")


def write_feedback(rows: list[Row], folder: str | Path, *, fmt: str = "md") -> list[Path]:
    """One feedback file per student (Markdown, or HTML with ``fmt="html"``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for student in _totals(rows):
        text = feedback_markdown(student, [r for r in rows if r.student == student])
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in student) or "student"
        if fmt == "html":
            path = folder / f"{safe}.html"
            path.write_text(feedback_html(text, f"Feedback for {student}"), encoding="utf-8")
        else:
            path = folder / f"{safe}.md"
            path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
