"""Public cases: what a check decides with where the course's ``solutions/`` are not.

Instructors keep ``solutions/`` to themselves, and the judge (:mod:`.judge`) needs the course's
answers to compute the expected values. So ``make exercises`` ships, beside the release, each
chapter's *public cases*: ``exercises/public/NN_public_cases.json``, the inputs each visible check
draws from a fixed public seed (:data:`PUBLIC_SEED`) — at most :data:`MAX_CASES` of them, the first
ones and the rare kinds and the last ones (:func:`select_public`) — and the course's values on those
inputs, computed by the real judge on ``solutions/``::

    make exercises ──► JudgeProcess(NN, solutions/) ──► cases + reference, seed PUBLIC_SEED,
                       visible checks only ──► MAX_CASES of each ──► public/NN_….json

It holds *data* only — wire text (:mod:`.wire`), seeds, content hashes — never code and nothing of a
hidden check. Where ``solutions/`` is absent, a check (the check cell, ``python -m gpucourse check``,
``gc.check_this_notebook()``) asks a *public judge* instead: the same :class:`.judge.Judge`, loading
the release notebook (its check cells define the same ``cases``/``compare``/``describe``; they are
the same locked cells as in ``solutions/``) and taking the inputs and the expected values from this
file instead of running any answer. Everything else — structure first, the check's compare, the
messages — is the same code. The instructor's grader (``grade``) never uses it: it draws fresh
inputs with the real judge, so a notebook that hard-codes these values scores 0 there.

Only cells of the release that the course wrote run in a public judge: the file lists their content
hashes (``course_cells``: set-up, helpers, check cells — not the answer cells), so a release copy a
learner works in (their answers filled in) can serve as the release, and an edited check cell is not
used ("not the course's").

This module is light (no torch, no nbformat at import): the kernel's check cell imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FORMAT", "MAX_CASES", "PUBLIC_SEED", "PublicCases", "build_public", "course_cells",
           "dumps_public", "find_public", "load_public", "public_file", "public_problems", "release_folder",
           "select_public", "source_fingerprint", "write_public"]

#: the seed every public case is drawn from (fixed: the same inputs on every machine, every run)
PUBLIC_SEED = 20_250_039
#: at most this many cases of each visible check are shipped (:func:`select_public` picks them) ...
MAX_CASES = 40
#: ... the first this many of them (the first 25 alone were shipped before format 2)
HEAD_CASES = 25
#: the file format's version (2: the cases are picked from the whole draw, not its first ones)
FORMAT = 2
#: the folder, inside the release folder, that holds the public files
FOLDER = "public"
#: the largest public file read (a check's values are bounded by the wire's limit anyway)
MAX_FILE_BYTES = 64 << 20

ABOUT = ("Public cases of the course's visible checks: inputs drawn from a fixed public seed and the "
         "course's values for them, computed by the judge on solutions/ (on CPU) by `make exercises`. "
         "Data only (wire format). A check uses them where solutions/ is absent; the instructor's "
         "grader draws new inputs and runs the hidden checks.")


def public_name(chapter: str) -> str:
    """``02`` → ``02_public_cases.json``."""
    return f"{chapter}_public_cases.json"


def public_file(release_dir: str | os.PathLike, chapter: str) -> Path:
    """Where a release folder keeps chapter ``chapter``'s public cases."""
    return Path(release_dir) / FOLDER / public_name(chapter)


def _cell_hash(source: str) -> str:
    from .exercises import check_hash

    return check_hash(source)


# --- what a public file is made from (solutions side) -------------------------------------------

def course_cells(solutions_nb, *, name: str = "notebook") -> list[str]:
    """The content hashes of the cells a public judge may run, in order: the judge's definition
    cells of the solutions notebook (:func:`.exercises.definition_cells`) less the answer cells,
    the hidden checks and the cells the release leaves out — set-up, helpers and visible check
    cells, which the release carries unchanged."""
    from .exercises import HIDDEN_TAG, SOLUTION_ONLY_TAG, definition_cells, exercise_index

    index = exercise_index(solutions_nb, name=name)
    answers = {i for ex in index.values() for i in ex.solution_cells}
    out = []
    for i in definition_cells(solutions_nb, name=name):
        cell = solutions_nb.cells[i]
        tags = cell.get("metadata", {}).get("tags", [])
        if i in answers or HIDDEN_TAG in tags or SOLUTION_ONLY_TAG in tags:
            continue
        out.append(_cell_hash(cell.source))
    return out


def source_fingerprint(solutions_nb, *, name: str = "notebook") -> str:
    """A hash of what a chapter's public values are computed from: the seed, the number of cases
    kept, and the solutions' definition cells (answers and visible checks; not the hidden checks,
    which the public file does not hold). The package's own code is not in it: a change there that
    changes a value is caught by the test that regenerates a chapter's file."""
    from .exercises import HIDDEN_TAG, definition_cells

    h = hashlib.sha256(f"gpucourse public cases {FORMAT}/{PUBLIC_SEED}/{MAX_CASES}\n".encode())
    for i in definition_cells(solutions_nb, name=name):
        cell = solutions_nb.cells[i]
        if HIDDEN_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        h.update(b"\0cell\0" + "\n".join(l.rstrip() for l in cell.source.strip().splitlines()).encode())
    return "sha256:" + h.hexdigest()


@contextlib.contextmanager
def _generation_env():
    """The environment a public file is computed in: CPU only, one thread, a fixed hash seed — the
    same values wherever the course's authors run ``make exercises``."""
    saved = {k: os.environ.get(k) for k in _GENERATION_ENV}
    os.environ.update(_GENERATION_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_GENERATION_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "PYTHONHASHSEED": "0"}


def _wire_doc(text: str) -> dict:
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("wire") != 1 or not isinstance(doc.get("value"), list):
        raise ValueError("the judge's reply is not a list in wire format")
    return doc


def build_public(chapter: str, solutions_dir: str | os.PathLike, release_path: str | os.PathLike, *,
                 max_cases: int = MAX_CASES, seed: int = PUBLIC_SEED) -> dict:
    """Chapter ``chapter``'s public file (as a dict), computed by the real judge on ``solutions_dir``:
    ``cases`` and ``reference`` requests with the public seed, for the visible checks only, each cut
    to ``max_cases`` of its cases (:func:`select_public`)."""
    import nbformat

    from .harness import JudgeProcess
    from .restore import load_release

    solutions_dir, release_path = Path(solutions_dir), Path(release_path)
    (source,) = sorted(solutions_dir.glob(f"{chapter}_*.ipynb"))[:1] or [None]
    if source is None:
        raise FileNotFoundError(f"no solutions notebook for chapter {chapter} in {str(solutions_dir)!r}")
    solutions_nb = nbformat.read(source, as_version=4)
    release = load_release(release_path)
    with _generation_env():
        judge = JudgeProcess(chapter, solutions_dir, local=False)
    try:
        if judge.hello.get("errors"):
            raise RuntimeError(f"the solutions of chapter {chapter} did not load cleanly: "
                               + "; ".join(judge.hello["errors"]))
        visible = [s for s in judge.hello["slots"] if s["kind"] == "visible"]
        if [s["slot"] for s in visible] != list(release.checks):
            raise RuntimeError(f"chapter {chapter}: the judge's visible checks {[s['slot'] for s in visible]} "
                               f"are not the release's {list(release.checks)} (run make exercises first)")
        slots = {}
        for s in visible:
            slot = s["slot"]
            drawn = judge.request({"op": "cases", "slot": slot, "seed": seed})
            values = judge.request({"op": "reference", "slot": slot, "seed": seed})
            cases, wants = _wire_doc(drawn["cases"]), _wire_doc(values["values"])
            total = len(cases["value"])
            if len(wants["value"]) != total or len(drawn["seeds"]) != total:
                raise RuntimeError(f"{slot}: {total} cases but {len(wants['value'])} values")
            kept = select_public(cases["value"], wants["value"], max_cases)
            slots[slot] = {"title": s["title"], "check_hash": release.checks[slot].hash, "cases_total": total,
                           "seeds": [drawn["seeds"][i] for i in kept],
                           "cases": {"wire": 1, "value": [cases["value"][i] for i in kept]},
                           "reference": {"wire": 1, "value": [wants["value"][i] for i in kept]}}
    finally:
        judge.close()
    return {"about": ABOUT, "format": FORMAT, "chapter": chapter, "release": release_path.name,
            "seed": seed, "max_cases": max_cases,
            "source": source_fingerprint(solutions_nb, name=source.name),
            "course_cells": course_cells(solutions_nb, name=source.name), "slots": slots}


def _kind(node, depth: int = 0):
    """What sort of value a wire node is — its types and layout, not its numbers: ``(1, 2.5)`` and
    ``(7, 0.1)`` are one kind, ``(1, None)``, ``[1, 2]`` and a raised ``ValueError`` each another. A
    bool and a non-finite float count by value (``True`` and ``False``, ``inf`` and ``nan``, differ)."""
    if depth > 8:
        return "..."
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, (int, float, str)):
        return type(node).__name__
    if isinstance(node, list):
        return ("list", tuple(sorted({repr(_kind(x, depth + 1)) for x in node})))
    if not isinstance(node, dict):
        return type(node).__name__
    if "$raised" in node:
        return ("raised", node["$raised"].get("type"))
    if "$f" in node:
        return ("float", node["$f"])
    if "$tensor" in node:
        t = node["$tensor"]
        return ("tensor", t.get("dtype"), len(t.get("shape", [])))
    if "$t" in node:
        return ("tuple", tuple(_kind(x, depth + 1) for x in node["$t"]))
    if "$record" in node or "$opaque" in node:
        return (next(iter(node)), (node.get("$record") or node.get("$opaque") or {}).get("type"))
    return ("dict", tuple(sorted((str(k), repr(_kind(v, depth + 1))) for k, v in node.items())))


def select_public(cases: list, wants: list, max_cases: int = MAX_CASES, head: int = HEAD_CASES) -> list[int]:
    """Which of a check's drawn cases a public file keeps (positions, in drawing order), at most
    ``max_cases``. A check draws its fixed edges and random cases — the edges its title names (an
    error it expects, a sum too small, a node list with brackets) listed first or after the random
    ones. The first 25 alone, as shipped before, missed the ones after: 13 of the course's wrong
    answers that the visible checks reject passed every public case (05.2 raising a KeyError for a
    missing variable, 02.2 leaving a wrong sum to torch, 05.4 timing only the send). It keeps:

    1. the first ``head`` cases;
    2. one case of every kind of input and value the course's answer gives (:func:`_kind`) not kept
       yet, the rarest kinds first — the edges are rare among random cases (at most a third of the
       room left);
    3. the last three cases;
    4. cases spread evenly over the rest of the draw.

        >>> cases = [[i] for i in range(100)] + [["empty"], ["too large"]]
        >>> wants = [i % 7 for i in range(100)] + [{"$raised": {"type": "ValueError"}}] * 2
        >>> select_public(cases, wants, 12, head=5)   # the head, the errors, the end, 4 spread out
        [0, 1, 2, 3, 4, 16, 40, 63, 87, 99, 100, 101]
        >>> select_public(cases[:5], wants[:5], 12, head=5)
        [0, 1, 2, 3, 4]
    """
    n = len(cases)
    if n <= max_cases:
        return list(range(n))
    kept = list(range(min(head, max_cases)))

    def keep(i: int) -> None:
        if len(kept) < max_cases and i not in kept:
            kept.append(i)

    kinds = [repr((_kind(c), _kind(w))) for c, w in zip(cases, wants)]
    count = Counter(kinds)                         # in order of first appearance
    first = {k: kinds.index(k) for k in count}
    seen = {kinds[i] for i in kept}
    rare = [k for k in sorted(count, key=lambda k: (count[k], first[k])) if k not in seen]
    for k in rare[: (max_cases - len(kept)) // 3]:
        keep(first[k])
    for i in (n - 3, n - 2, n - 1):
        keep(i)
    rest = [i for i in range(n) if i not in kept]           # more than the room left: n > max_cases
    room = max_cases - len(kept)
    for j in range(room):
        keep(rest[int((j + 0.5) * len(rest) / room)])
    return sorted(kept)


def dumps_public(doc: dict) -> str:
    """A public file's text: one key a line, each slot's seeds, cases and values on a line of their
    own (compact JSON: small, and a diff shows which check's values changed)."""
    compact: dict[str, str] = {}

    def token(value) -> str:
        key = f"@@{len(compact)}@@"
        compact[key] = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return key

    shown = dict(doc, slots={slot: dict(s, seeds=token(s["seeds"]), cases=token(s["cases"]),
                                        reference=token(s["reference"]))
                             for slot, s in doc["slots"].items()})
    text = json.dumps(shown, indent=1, ensure_ascii=False, allow_nan=False)
    for key, value in compact.items():
        text = text.replace(json.dumps(key), value, 1)
    return text + "\n"


def write_public(doc: dict, path: str | os.PathLike) -> bool:
    """Write ``doc`` to ``path``; whether the file changed."""
    path = Path(path)
    text = dumps_public(doc)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


# --- reading a public file (judge side) ------------------------------------------------------------

@dataclass
class PublicSlot:
    title: str
    check_hash: str
    cases_total: int
    seeds: list[int]
    cases: str              # wire text of the list of cases
    reference: str          # wire text of the course's values, one per case


@dataclass
class PublicCases:
    path: Path
    chapter: str
    release: str
    seed: int
    max_cases: int
    source: str
    course_cells: list[str]
    slots: dict[str, PublicSlot]


def _wire_text(value, what: str) -> tuple[str, int]:
    if not isinstance(value, dict) or value.get("wire") != 1 or not isinstance(value.get("value"), list):
        raise ValueError(f"{what} is not a list in wire format")
    return json.dumps(value, separators=(",", ":"), allow_nan=False), len(value["value"])


def load_public(path: str | os.PathLike) -> PublicCases:
    """Read and validate a public file (data only: JSON and wire text). Raises ``ValueError`` for a
    file that is not one."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MB")
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a public cases file of format {FORMAT}")
    try:
        slots = {}
        for slot, s in doc["slots"].items():
            cases, n = _wire_text(s["cases"], f"{slot}'s cases")
            reference, m = _wire_text(s["reference"], f"{slot}'s values")
            seeds = [int(x) for x in s["seeds"]]
            if not (n == m == len(seeds)) or n == 0:
                raise ValueError(f"{slot}: {n} cases, {m} values, {len(seeds)} seeds")
            slots[str(slot)] = PublicSlot(str(s["title"]), str(s["check_hash"]), int(s["cases_total"]), seeds,
                                          cases, reference)
        return PublicCases(path, str(doc["chapter"]), str(doc["release"]), int(doc["seed"]),
                           int(doc["max_cases"]), str(doc["source"]), [str(h) for h in doc["course_cells"]],
                           slots)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid public cases file ({type(e).__name__}: {e})") from None


# --- where a check finds them ------------------------------------------------------------------------

def course_folder() -> Path:
    """The folder the ``gpucourse`` package sits in (the course's, in a clone)."""
    return Path(__file__).resolve().parents[2]


def find_public(chapter: str, near=()) -> Path | None:
    """Chapter ``chapter``'s public file: in the course's ``exercises/public`` next to the package,
    then in each folder of ``near`` (the notebook's: its ``public/`` subfolder, then itself), then
    in the current folder's ``exercises/public``."""
    name = public_name(chapter)
    folders = [course_folder() / "exercises" / FOLDER]
    for folder in near:
        folders += [Path(folder) / FOLDER, Path(folder)]
    folders.append(Path.cwd() / "exercises" / FOLDER)
    for folder in folders:
        candidate = folder / name
        if candidate.is_file():
            return candidate
    return None


def release_folder(public: str | os.PathLike, chapter: str, also=()) -> Path | None:
    """The folder holding the release notebook a public file belongs to: the one ``public/`` is in,
    else the file's own folder, else one of ``also``."""
    public = Path(public)
    folders = ([public.parent.parent] if public.parent.name == FOLDER else []) + [public.parent, *map(Path, also)]
    for folder in folders:
        if any(folder.glob(f"{chapter}_*.ipynb")):
            return folder
    return None


# --- is a shipped file up to date? (``exercises --check``) ------------------------------------------

def public_problems(path: str | os.PathLike, solutions_nb, release_path: str | os.PathLike, *,
                    name: str = "notebook") -> list[str]:
    """Why the public file at ``path`` does not fit the release at ``release_path`` and the
    solutions notebook it was made from (empty: it does). Cheap: no judge runs."""
    from .restore import load_release

    path = Path(path)
    if not path.is_file():
        return [f"{path}: missing (make exercises writes it)"]
    try:
        public = load_public(path)
    except (OSError, ValueError) as e:
        return [str(e)]
    release = load_release(release_path)
    problems = []
    if public.chapter != release.chapter or public.release != Path(release_path).name:
        problems.append(f"{path}: for {public.release} (chapter {public.chapter}), not {Path(release_path).name}")
    if list(public.slots) != list(release.checks):
        problems.append(f"{path}: slots {list(public.slots)}, but the release's visible checks are "
                        f"{list(release.checks)}")
    for slot, s in public.slots.items():
        if slot in release.checks and s.check_hash != release.checks[slot].hash:
            problems.append(f"{path}: {slot}'s check cell changed since its public cases were computed")
        if len(s.seeds) != min(MAX_CASES, s.cases_total):
            problems.append(f"{path}: {slot} holds {len(s.seeds)} cases, not {min(MAX_CASES, s.cases_total)}")
    if public.seed != PUBLIC_SEED or public.max_cases != MAX_CASES:
        problems.append(f"{path}: drawn from seed {public.seed} ({public.max_cases} cases), not {PUBLIC_SEED} "
                        f"({MAX_CASES})")
    if public.source != source_fingerprint(solutions_nb, name=name):
        problems.append(f"{path}: the solutions changed since its values were computed")
    elif public.course_cells != course_cells(solutions_nb, name=name):
        problems.append(f"{path}: the course's cells changed since it was written")
    return problems
