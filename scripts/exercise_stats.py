"""Per chapter: the exercises, and how many plausible wrong answers each visible check rejects.

    python scripts/exercise_stats.py        # a Markdown table for the README

Reads solutions/ (the exercises) and tests/grading/test_mutations_chNN.py (VISIBLE: wrong answers the
visible check must reject; HIDDEN: ones only the hidden check rejects). `make test` runs them all.
"""

import ast
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpucourse.grading.exercises import exercise_index  # noqa: E402


def _tables(path: Path) -> dict[str, dict]:
    """VISIBLE and HIDDEN of a mutation module, read as literals (nothing is imported or run)."""
    out = {"VISIBLE": {}, "HIDDEN": {}}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", "") in out:
            out[node.targets[0].id] = {k.value: len(v.keys) for k, v in zip(node.value.keys, node.value.values)}
    return out


def main() -> int:
    rows = ["| chapter | exercises | wrong answers each visible check rejects | only the hidden check rejects |",
            "|---|---|---|---|"]
    totals = [0, 0, 0]
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        chapter = path.name[:2]
        ids = list(exercise_index(nbformat.read(path, as_version=4), name=path.name))
        mutations = ROOT / "tests" / "grading" / f"test_mutations_ch{chapter}.py"
        t = _tables(mutations) if mutations.exists() else {"VISIBLE": {}, "HIDDEN": {}}
        visible = [t["VISIBLE"].get(e, 0) for e in ids]
        hidden = sum(t["HIDDEN"].get(e, 0) for e in ids)
        per = " · ".join(f"{e} {n}" for e, n in zip(ids, visible))
        rows.append(f"| {chapter} | {len(ids)} | {per} (total {sum(visible)}) | {hidden} |")
        totals[0] += len(ids)
        totals[1] += sum(visible)
        totals[2] += hidden
    rows.append(f"| all | {totals[0]} | {totals[1]} | {totals[2]} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
