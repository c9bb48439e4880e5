"""The gradebook: one row per student × exercise, as CSV, JSON, a stdout table and feedback files.

CSV/JSON columns (:data:`COLUMNS`)::

    student   folder name (or the file name when submissions are flat)
    notebook  the submitted file
    exercise  NN.k ("-" for a notebook that could not be graded at all)
    title     the exercise's check title
    visible   ✓ / ✗ — the course's check
    hidden    ✓ / ✗ / "" — the hidden checks (only with --hidden)
    points, max                visible points earned / possible (points metadata, default 1)
    hidden_points, hidden_max  the same for the hidden checks (counted separately)
    seconds   time the check cells ran
    error     first error line (or why the notebook was not graded)
    restored  "edited" (the check was changed: restored), "deleted" (put back), "missing" (0 points)
    status    graded / unreadable / wrong chapter / no release / no checks / not graded
"""

from __future__ import annotations

import csv
import html
import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["COLUMNS", "Row", "summary_table", "write_csv", "write_feedback", "write_json"]


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
    hidden_points: float
    hidden_max: float
    seconds: float
    error: str
    restored: str
    status: str
    message: str = ""        # the check's full message (feedback only, never a hidden source)


COLUMNS = [f for f in Row.__dataclass_fields__ if f != "message"]


def write_csv(rows: list[Row], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def write_json(rows: list[Row], path: str | Path, *, isolation: str = "", seed: int | None = None,
               notebooks: list[dict] | None = None) -> None:
    data = {"isolation": isolation, "seed": seed, "notebooks": notebooks or [], "rows": [{k: v for k, v in asdict(r).items() if k in COLUMNS}
                                              for r in rows]}
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _totals(rows: list[Row]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        t = out.setdefault(r.student, {"points": 0.0, "max": 0.0, "hp": 0.0, "hm": 0.0, "notes": []})
        t["points"] += r.points
        t["max"] += r.max
        t["hp"] += r.hidden_points
        t["hm"] += r.hidden_max
        if r.status not in ("graded",) and r.status not in t["notes"]:
            t["notes"].append(r.status)
        if r.restored and f"{r.exercise} {r.restored}" not in t["notes"]:
            t["notes"].append(f"{r.exercise} {r.restored}")
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def summary_table(rows: list[Row]) -> str:
    """Per-student totals, one line each.

    Example::

        >>> rows = [Row("alice", "a.ipynb", "00.1", "t", "✓", "", 1, 1, 0, 0, 1.0, "", "", "graded"),
        ...         Row("bob", "b.ipynb", "00.1", "t", "✗", "", 0, 1, 0, 0, 1.0, "E", "edited", "graded")]
        >>> print(summary_table(rows))
        student  points  hidden  notes
        alice       1/1       -
        bob         0/1       -  00.1 edited
    """
    totals = _totals(rows)
    width = max([len("student")] + [len(s) for s in totals])
    lines = [f"{'student':<{width}}  points  hidden  notes"]
    for student, t in totals.items():
        hidden = f"{_num(t['hp'])}/{_num(t['hm'])}" if t["hm"] else "-"
        pts = f"{_num(t['points'])}/{_num(t['max'])}"
        lines.append(f"{student:<{width}}  {pts:>6}  {hidden:>6}  {', '.join(t['notes'])}".rstrip())
    return "\n".join(lines)


def write_feedback(rows: list[Row], folder: str | Path, *, fmt: str = "md") -> list[Path]:
    """One feedback file per student (Markdown, or HTML with ``fmt="html"``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    totals = _totals(rows)
    for student, t in totals.items():
        mine = [r for r in rows if r.student == student]
        lines = [f"# Feedback for {student}", "",
                 f"Points: **{_num(t['points'])} / {_num(t['max'])}**"
                 + (f" · hidden checks: **{_num(t['hp'])} / {_num(t['hm'])}**" if t["hm"] else ""), "",
                 "| exercise | check | hidden | points | note |", "|---|---|---|---|---|"]
        for r in mine:
            note = r.error.replace("|", "\\|")
            if r.restored:
                note = f"check cell {r.restored}{' — restored' if r.restored == 'edited' else ''}; {note}"
            lines.append(f"| {r.exercise} {r.title} | {r.visible} | {r.hidden or '-'} | "
                         f"{_num(r.points)}/{_num(r.max)} | {note} |")
        failed = [r for r in mine if r.visible != "✓" or r.hidden == "✗"]
        if failed:
            lines += ["", "## What to look at", ""]
            for r in failed:
                lines.append(f"### {r.exercise} — {r.title}")
                lines.append("")
                lines.append(f"First error: `{r.error or 'none'}`")
                if r.message and r.message.strip() != r.error:
                    lines += ["", "```", r.message.strip()[:1500], "```"]
                lines.append("")
        text = "\n".join(lines) + "\n"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in student) or "student"
        if fmt == "html":
            path = folder / f"{safe}.html"
            path.write_text("<!doctype html><meta charset='utf-8'><pre>" + html.escape(text) + "</pre>\n",
                            encoding="utf-8")
        else:
            path = folder / f"{safe}.md"
            path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
