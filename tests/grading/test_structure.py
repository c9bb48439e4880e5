"""Structure before values (issue 37, part A): a value without the shape of the course's answer fails
its case in the judge before any compare runs — for every check of the course at once.

- a check whose compare only loops over ``zip(got, want)`` (the tiny chapter 99) no longer passes
  an empty or truncated result, and a rank's error reads as one line;
- the family test: for every chapter 00–12 and every slot of its judge, the course's own values for
  a fixed seed pass (the control), and forged sets of values — ``[]`` or ``None`` for every case,
  every list cut by one item (at the first level that holds lists, or inside each item: rank by
  rank), every tensor cut or reshaped, every tensor of another dtype — fail wherever they change the
  structure of at least one case.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading import structure, wire
from gpucourse.grading.exercises import BEGIN, END
from gpucourse.grading.harness import JudgeProcess

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
SEED = 37

# --- a compare that trusts zip: the judge's structure check is what stops the forgeries ----------

ZIP_CHECK = """# Check 99.1 — squares of a few lists
def cases(rng):
    return [([rng.randint(-9, 9) for _ in range(n)],) for n in (1, 3, 4)]


def squares_run(xs):
    return [square(x) for x in xs], {"n": len(xs), "each": [[x] for x in xs]}


def compare(case, got, want):                  # trusts the lengths: it only zips
    for g, w in zip(got[0], want[0]):
        gc.expect(g == w, f"expected {w}, got {g}")


gc.check_exercise("99.1", squares_run, cases, compare=compare)"""

CUBES_CHECK = """# Check 99.2 — cubes, with a compare that names a missing value its own way
def cases(rng):
    return [([rng.randint(-9, 9) for _ in range(n)],) for n in (1, 3)]


def cubes_run(xs):
    return [cube(x) for x in xs]


def compare(case, got, want):
    gc.expect(len(got) == len(want), f"one cube per number: expected {len(want)}, got {len(got)}")
    for x, g, w in zip(case[0], got, want):
        gc.expect(g == w, f"cube({x}): expected {w}, got {g}")


gc.check_exercise("99.2", cubes_run, cases, compare=compare)"""


@pytest.fixture(scope="module")
def zip_judge(tmp_path_factory):
    sol = tmp_path_factory.mktemp("zip") / "solutions"
    sol.mkdir()
    nb = new_notebook(cells=[new_markdown_cell("# 99 · tiny"), new_code_cell("import gpucourse as gc"),
                             new_markdown_cell("## Exercise 99.1 — square"),
                             new_code_cell(f"def square(x):\n    {BEGIN}\n    return x * x\n    {END}"),
                             new_code_cell(ZIP_CHECK, metadata={"tags": ["check"]}),
                             new_markdown_cell("## Exercise 99.2 — cube"),
                             new_code_cell(f"def cube(x):\n    {BEGIN}\n    return x ** 3\n    {END}"),
                             new_code_cell(CUBES_CHECK, metadata={"tags": ["check"]})])
    nbformat.write(nb, sol / "99_tiny_exercises.ipynb")
    judge = JudgeProcess("99", sol, local=True)
    assert not judge.hello["errors"], judge.hello["errors"]
    judge.request({"op": "cases", "slot": "99.1", "seed": SEED})
    judge.request({"op": "cases", "slot": "99.2", "seed": SEED})
    wants = wire.loads(judge.request({"op": "reference", "slot": "99.1", "seed": SEED})["values"])
    yield judge, wants
    judge.close()


def verdict(judge, values: list, slot: str = "99.1") -> dict:
    return judge.request({"op": "compare", "slot": slot, "seed": SEED, "values": wire.dumps(values)})


def test_the_course_values_pass_and_a_tuple_for_a_list_is_fine(zip_judge):
    judge, wants = zip_judge
    assert verdict(judge, wants)["passed"]
    assert verdict(judge, [tuple(w) for w in wants])["passed"]


@pytest.mark.parametrize("forge, where", [
    (lambda w: ([], w[1]), "the result[0]: expected a list of 1 item, got 0 items"),
    (lambda w: (w[0][:-1], w[1]), "the result[0]: expected a list of 1 item, got 0 items"),
    (lambda w: (w[0], {"n": w[1]["n"]}), "missing [\"'each'\"]"),
    (lambda w: (w[0], {"n": float(w[1]["n"]), "each": w[1]["each"]}),
     "the result[1]['n']: expected an int, got a float"),
    (lambda w: (w[0], {"n": w[1]["n"], "each": [[] for _ in w[1]["each"]]}),
     "the result[1]['each'][0]: expected a list of 1 item"),
    (lambda w: [], "the result: expected a tuple of 2 items, got 0 items"),
    (lambda w: None, "the result: expected a tuple of 2 items, got None"),
])
def test_a_forged_structure_fails_before_the_compare(zip_judge, forge, where):
    judge, wants = zip_judge
    v = verdict(judge, [forge(w) for w in wants])
    assert not v["passed"] and "case 1 of 3" in v["message"] and where in v["message"], v["message"]


def test_every_case_is_checked_not_only_the_first(zip_judge):
    judge, wants = zip_judge
    forged = [wants[0], wants[1], (wants[2][0][:2], wants[2][1])]           # the 4-item list cut to 2
    v = verdict(judge, forged)
    assert not v["passed"] and "case 3 of 3" in v["message"]
    assert "the result[0]: expected a list of 4 items, got 2 items" in v["message"], v["message"]


def test_an_error_reads_as_one_line_naming_the_rank(zip_judge):
    judge, wants = zip_judge
    message = "rank 1 raised NameError: name 'x' is not defined\nTraceback (most recent call last):\n  ..."
    rank_error = wire.Raised("WorkerError", ("WorkerError", "RuntimeError", "Exception"), message,
                             "NameError")
    v = verdict(judge, [wants[0], rank_error, wants[2]])
    assert not v["passed"] and "case 2 of 3" in v["message"]
    first = v["message"].splitlines()[0]
    assert first.endswith(": rank 1 raised NameError: name 'x' is not defined"), first
    assert "Raised(" not in v["message"] and "\\n" not in v["message"]
    plain = wire.Raised("ValueError", ("ValueError", "Exception"), "bad list\nmore")
    v = verdict(judge, [plain] + wants[1:])
    assert v["message"].splitlines()[0].endswith(": the code raised ValueError: bad list"), v["message"]
    inner = (wants[0][0], {"n": rank_error, "each": wants[0][1]["each"]})
    v = verdict(judge, [inner] + wants[1:])
    assert "the result[1]['n']: expected an int, but rank 1 raised NameError" in v["message"], v["message"]


def test_a_structure_that_differs_fails_in_the_compares_words_where_it_has_some(zip_judge):
    """A truncated result never passes; where the check's compare says why in its own words (the
    number it expected, a tile it missed), those words are the message, not the structure's."""
    judge, _ = zip_judge
    wants = wire.loads(judge.request({"op": "reference", "slot": "99.2", "seed": SEED})["values"])
    assert verdict(judge, wants, "99.2")["passed"]
    v = verdict(judge, [wants[0], wants[1][:2]], "99.2")
    assert not v["passed"] and "case 2 of 2" in v["message"], v["message"]
    assert "one cube per number: expected 3, got 2" in v["message"], v["message"]
    assert "expected a list of 3 items" not in v["message"], v["message"]
    # an error inside the value: the structure names it, not a compare that tripped over it
    rank_error = wire.Raised("WorkerError", ("WorkerError", "RuntimeError", "Exception"),
                             "rank 1 raised NameError: name 'x' is not defined", "NameError")
    v = verdict(judge, [wants[0], [wants[1][0], rank_error, wants[1][2]]], "99.2")
    assert not v["passed"] and "the result[1]: expected an int, but rank 1 raised NameError" in v["message"], \
        v["message"]


def test_not_implemented_and_missing_cases_as_before(zip_judge):
    judge, wants = zip_judge
    stub = wire.Raised("NotImplementedError", ("NotImplementedError", "RuntimeError"), "Exercise 99.1")
    assert verdict(judge, [stub])["message"].startswith("99.1: not implemented yet")
    assert verdict(judge, [wants[0], stub])["message"].startswith("99.1: not implemented yet")
    assert "only 2 of 3 cases ran" in verdict(judge, wants[:2])["message"]
    assert "4 values for 3 cases" in verdict(judge, wants + wants[:1])["message"]


# --- the family: every slot of every chapter -------------------------------------------------------

def _is_raised(v) -> bool:
    return isinstance(v, wire.Raised)


def _walk(v, leaf):
    """``v`` with ``leaf(x)`` applied to every non-container inside it; (new value, changed)."""
    if _is_raised(v):
        return v, False
    if isinstance(v, (list, tuple)):
        items = [_walk(x, leaf) for x in v]
        return type(v)(x for x, _ in items), any(c for _, c in items)
    if isinstance(v, dict):
        items = {k: _walk(x, leaf) for k, x in v.items()}
        return {k: x for k, (x, _) in items.items()}, any(c for _, c in items.values())
    if isinstance(v, wire.Record):
        fields, changed = _walk(v.fields, leaf)
        return wire.Record(v.type, fields), changed
    return leaf(v)


def cut(v):
    """Every list/tuple at the first level of ``v`` that holds one, one item shorter."""
    if isinstance(v, (list, tuple)):
        return (type(v)(v[:-1]), True) if v else (v, False)
    if isinstance(v, dict):
        items = {k: cut(x) for k, x in v.items()}
        return {k: x for k, (x, _) in items.items()}, any(c for _, c in items.values())
    if isinstance(v, wire.Record):
        fields, changed = cut(v.fields)
        return wire.Record(v.type, fields), changed
    return v, False


def cut_inside(v):
    """Each item of a list (each rank's value) with its own lists cut by one item."""
    if isinstance(v, (list, tuple)):
        items = [cut(x) for x in v]
        return type(v)(x for x, _ in items), any(c for _, c in items)
    if isinstance(v, dict):
        items = {k: cut_inside(x) for k, x in v.items()}
        return {k: x for k, (x, _) in items.items()}, any(c for _, c in items.values())
    return v, False


def _reshaped(x):
    if isinstance(x, torch.Tensor):
        return (x[:-1] if x.dim() and x.shape[0] else x.unsqueeze(0)), True
    return x, False


OTHER_DTYPE = {torch.float32: torch.float64, torch.float64: torch.float32, torch.int64: torch.int32,
               torch.bool: torch.uint8}


def _retyped(x):
    if isinstance(x, torch.Tensor):
        return x.to(OTHER_DTYPE.get(x.dtype, torch.float32)), True
    return x, False


FORGERIES = {
    "[] for every case": lambda w: ([], not (isinstance(w, (list, tuple)) and len(w) == 0)),
    "None for every case": lambda w: (None, w is not None),
    "lists cut by one item": cut,
    "each item's lists cut by one item": cut_inside,
    "tensors cut or reshaped": lambda w: _walk(w, _reshaped),
    "tensors of another dtype": lambda w: _walk(w, _retyped),
}


def forged_sets(wants: list):
    """(name, values, changed) per forgery: a case whose course value raised is kept as it is."""
    for name, forge in FORGERIES.items():
        values, changed = [], False
        for w in wants:
            v, c = (w, False) if _is_raised(w) else forge(w)
            values.append(v)
            changed |= c
        yield name, values, changed


CHAPTERS = sorted(p.name[:2] for p in SOLUTIONS.glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="class")
def judge_of():
    """One judge process per chapter for the tests of a class (closed after them)."""
    started: dict[str, JudgeProcess] = {}

    def get(chapter: str) -> JudgeProcess:
        if chapter not in started:
            started[chapter] = JudgeProcess(chapter, SOLUTIONS, local=True)
            assert not started[chapter].hello["errors"], started[chapter].hello["errors"]
        return started[chapter]

    yield get
    for judge in started.values():
        judge.close()


def course_values(judge: JudgeProcess, slot: str) -> tuple[list, list]:
    """The slot's cases for :data:`SEED` and the course's values on them."""
    cases = wire.loads(judge.request({"op": "cases", "slot": slot, "seed": SEED})["cases"])
    return cases, wire.loads(judge.request({"op": "reference", "slot": slot, "seed": SEED})["values"])


def check_chapter(judge: JudgeProcess) -> None:
    problems, forged = [], 0
    for slot in (s["slot"] for s in judge.hello["slots"]):
        _, wants = course_values(judge, slot)
        control = verdict(judge, wants, slot)
        if not control["passed"]:
            problems.append(f"{slot}: the course's own values failed: {control['message']}")
        for name, values, changed in forged_sets(wants):
            if not changed:
                continue
            forged += 1
            if verdict(judge, values, slot)["passed"]:
                problems.append(f"{slot}: {name} passed")
    assert not problems, "\n".join(problems)
    assert forged >= 2 * len(judge.hello["slots"]), f"only {forged} forged sets changed a structure"


@pytest.mark.slow
class TestForgedStructuresFailChapters00To03:
    @pytest.mark.parametrize("chapter", [c for c in CHAPTERS if "00" <= c <= "03"])
    def test_forged_structures_fail(self, judge_of, chapter):
        check_chapter(judge_of(chapter))


@pytest.mark.slow
class TestForgedStructuresFailChapters04To06:
    @pytest.mark.parametrize("chapter", [c for c in CHAPTERS if "04" <= c <= "06"])
    def test_forged_structures_fail(self, judge_of, chapter):
        check_chapter(judge_of(chapter))


@pytest.mark.slow
class TestForgedStructuresFailChapters07To09:
    @pytest.mark.parametrize("chapter", [c for c in CHAPTERS if "07" <= c <= "09"])
    def test_forged_structures_fail(self, judge_of, chapter):
        check_chapter(judge_of(chapter))

    def test_any_cheapest_checkpoint_set_passes_whatever_its_length(self, judge_of):
        """08.5 (``ANY_LENGTH``): an answer as cheap as the course's, with more or fewer blocks."""
        judge = judge_of("08")
        cases, wants = course_values(judge, "08.5")
        others, swapped = [], 0
        for (full, kept, costs, budget), want in zip(cases, wants):
            n = len(full)
            fits = [list(s) for r in range(n + 1) for s in itertools.combinations(range(n), r)
                    if sum(kept[i] if i in s else full[i] for i in range(n)) <= budget]
            other = next((s for s in fits if want is not None and len(s) != len(want)
                          and abs(sum(costs[i] for i in s) - sum(costs[i] for i in want)) <= 1e-9), None)
            others.append(want if other is None else other)
            swapped += other is not None
        assert swapped, f"no case of seed {SEED} has an equally cheap set of another length"
        v = verdict(judge, others, "08.5")
        assert v["passed"], v["message"]
        longer = [w if w is None else w + [len(c[0])] for c, w in zip(cases, wants)]   # an index out of range
        assert not verdict(judge, longer, "08.5")["passed"]


@pytest.mark.slow
class TestForgedStructuresFailChapters10To12:
    @pytest.mark.parametrize("chapter", [c for c in CHAPTERS if "10" <= c])
    def test_forged_structures_fail(self, judge_of, chapter):
        check_chapter(judge_of(chapter))


def test_the_family_covers_every_chapter():
    assert CHAPTERS == [f"{i:02d}" for i in range(13)]


def test_the_forgeries_change_what_they_say_they_change():
    w = [{"a": [1, 2], "t": torch.zeros(2, 3)}, ([1], [2, 3])]
    (a, changed), = [cut(w[0])]
    assert changed and a["a"] == [1] and structure.mismatch(a, w[0])
    b, changed = cut_inside(w[1])
    assert changed and b == ([], [2]) and structure.mismatch(b, w[1])
    c, changed = _walk(w[0], _reshaped)
    assert changed and c["t"].shape == (1, 3) and structure.mismatch(c, w[0])
    d, changed = _walk(w[0], _retyped)
    assert changed and d["t"].dtype == torch.float64 and structure.mismatch(d, w[0])
    assert cut(7) == (7, False) and _walk([1, "x"], _reshaped) == ([1, "x"], False)
