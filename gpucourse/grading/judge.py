"""The judge: the one process that decides a check — it runs the course's answers, never yours.

``python -m gpucourse.grading.judge --chapter 08 --solutions solutions/`` executes
``solutions/08_*.ipynb`` (its set-up, its answers, and its check cells, which only *register* each
check: see :mod:`.harness`; not the measurements an exercise shows after its checks), then answers
requests, one JSON object per line on stdin → stdout:

=============================================  ==================================================
``{"op": "hello"}``                            the chapter's slots (``08.1``, ``08.1/hidden``, …)
``{"op": "cases", "slot", "seed"}``            the slot's inputs as wire text, drawn from
                                               ``seed`` (``null``: a fresh random seed)
``{"op": "compare", "slot", "seed", "values"}`` the verdict on the values a kernel computed for
                                               those inputs: ``{"passed", "message"}``; with
                                               ``"seconds"`` (the grader's clock around the
                                               cell; ``"clock": "kernel"`` where a learner's own
                                               check timed itself), a timed hidden check's time too
``{"op": "reference", "slot", "seed"}``        the course's own values on those inputs (wire text;
                                               for the grader's tests — a judge answers only the
                                               process that started it, never a kernel it grades)
=============================================  ==================================================

The expected values are computed here, by the check's own ``run`` with the course's answer in
place of the learner's function, on the same inputs — when the inputs are drawn (a ``cases``
request), so that a ``compare`` only reads values and compares: it is quick, and a judge that
takes long over one is stalled by those values. Both are cached per slot and seed, so a class
graded with one seed computes each reference once. Values from a kernel are read with
:mod:`.wire` — data only — and must have the structure of the course's answer, case by case
(:mod:`.structure`), or fail whatever the check's compare says: there the compare runs only to word
the failure (its own message where it raises one, else the structure's). Anything a cell prints
goes to stderr; stdout carries only the replies.

**Host mode** (``--host FD [--warm]``, :func:`host`): a grading run starts one host that imports torch,
IPython and the course once and forks a judge per chapter on request (:class:`.harness.JudgeHost`);
the forks share those pages and start in a fraction of a second. A learner's own check starts its
judge directly.

**Public mode** (``--public exercises/public/08_public_cases.json --solutions exercises/``): where the
course's ``solutions/`` are absent (see :mod:`.public`). The judge loads the *release* notebook —
only the cells the course wrote, by their content hashes (set-up, helpers, check cells; an answer
cell is not run, the names it defines stand for nothing) — so its checks register the same
``cases``/``compare``/``describe``; it answers for the visible checks that have public cases, takes
their inputs and the course's values from the file instead of drawing and running anything, and
only for the public seed. Everything else (structure first, the compare, the messages, which say
"public case k of n") is the code above — but the file's values were computed on another machine,
so the compare allows floats that machine's rounding (:func:`.harness.values_from_another_machine`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

if __name__ == "__main__":
    # nbformat imports jsonschema, which imports rfc3987_syntax where it is installed (jupyter-events
    # asks for it) and builds an IRI grammar as it does: 1.3 s of every judge's start, the wait of a
    # learner's first check, for a format no notebook schema uses. This process is the judge alone.
    sys.modules.setdefault("rfc3987_syntax", None)      # an import of it raises ImportError: skipped

from . import harness, structure, wire  # noqa: E402
from .exercises import CHECK_HEADER, CHECK_TAG, HIDDEN_HEADER, HIDDEN_TAG, check_hash, definition_cells

__all__ = ["ANY_LENGTH", "Judge", "main"]

#: exercises whose right answers need not have the course's length: the paths (as
#: :func:`.structure.mismatch` takes them) of the lists that may hold any number of items.
#: 08.5: any cheapest set of blocks to checkpoint is right, and two may hold different numbers of
#: blocks (its compare checks every item: an int, in range, sorted, fits the budget, cheapest).
ANY_LENGTH: dict[str, frozenset] = {"08.5": frozenset({()})}


class Judge:
    """One chapter's checks, as its solutions notebook defines them."""

    def __init__(self, chapter: str, solutions: str | os.PathLike, *, public: str | os.PathLike | None = None):
        """``solutions``: the folder of the chapter's solutions notebook — or, with ``public`` (a public
        cases file, :mod:`.public`), of its release notebook: public mode."""
        self.chapter = chapter
        self.public = None
        if public is not None:
            from .public import load_public

            self.public = load_public(public)
            if self.public.chapter != chapter:
                raise ValueError(f"{public} holds the public cases of chapter {self.public.chapter}, not {chapter}")
        paths = sorted(Path(solutions).glob(f"{chapter}_*.ipynb"))
        if self.public is not None and (Path(solutions) / self.public.release).is_file():
            paths = [Path(solutions) / self.public.release]
        if not paths:
            what = "release" if self.public is not None else "solutions"
            raise FileNotFoundError(f"no {what} notebook for chapter {chapter} in {str(solutions)!r}")
        self.path = paths[0]
        self.errors: list[str] = []
        self.skipped: list[str] = []            # public mode: cells stopped by an answer they called
        self.check_hashes: dict[str, str] = {}  # visible slot -> the course's check cell (exercises.check_hash)
        self.cases_cache: dict = {}
        self.reference_cache: dict = {}
        self.reference_seconds: dict = {}       # timed hidden checks: the course's time per (slot, seed)
        self._load()

    def _load(self) -> None:
        import types

        from IPython.core.interactiveshell import InteractiveShell

        import nbformat

        nb = nbformat.read(self.path, as_version=4)
        self.nb = nb
        shell = InteractiveShell.instance()
        module = types.ModuleType("__main__")          # this chapter's own globals
        shell.user_module, shell.user_ns = module, module.__dict__
        shell.init_user_ns()
        self.namespace = module.__dict__
        mode = harness._state["mode"]
        harness._state["mode"] = "judge"
        harness.SPECS.clear()
        cwd = os.getcwd()
        os.chdir(self.path.parent)
        try:
            with _no_live_ranks() if self.public is not None else contextlib.nullcontext():
                self._run_cells(shell, nb)
        finally:
            os.chdir(cwd)
            harness._state["mode"] = mode
            harness._state["title"] = ""
            self.specs = dict(harness.SPECS)
            harness.SPECS.clear()

    def _run_cells(self, shell, nb) -> None:
        if self.public is not None:
            needed = self._course_cells(shell, nb)
        else:
            needed = set(definition_cells(nb, name=self.path.name))
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or index not in needed:
                continue
            source = cell.source
            tags = cell.get("metadata", {}).get("tags", [])
            first = source.lstrip().splitlines()[0] if source.strip() else ""
            header = CHECK_HEADER.match(first) or HIDDEN_HEADER.match(first)
            harness._state["title"] = header["title"].strip() if header else ""
            before = set(harness.SPECS)
            result = shell.run_cell(source, store_history=False, silent=True)
            if CHECK_TAG in tags:
                for slot in set(harness.SPECS) - before:
                    self.check_hashes[slot] = check_hash(source)
            if not result.success:
                err = result.error_in_exec or result.error_before_exec
                what = f"{type(err).__name__}: {err}"
                if self.public is not None and isinstance(err, NotImplementedError) and str(err).endswith(STAND_IN):
                    # a check cell that goes on to show the answer at work (a timing): expected here
                    self.skipped.append(f"{self.path.name} cell {index} ({first}) stopped at an answer: {what}")
                elif CHECK_TAG in tags or HIDDEN_TAG in tags:
                    self.errors.append(f"{self.path.name} cell {index} ({first}) failed: {what}")
                else:
                    self.errors.append(f"{self.path.name} cell {index} failed: {what}")

    def _course_cells(self, shell, nb) -> set[int]:
        """Public mode: the release's cells the course wrote (their hashes are in the public file),
        in order, as many times as the course has them. Any other code cell (an answer, stub or
        filled in; a cell of the learner's) is not run: the top-level names it defines that nothing
        defined yet stand for a function that raises (a check cell names the answer it checks)."""
        from collections import Counter

        allowed = Counter(self.public.course_cells)
        needed = set()
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            h = check_hash(cell.source)
            if allowed[h] > 0:
                allowed[h] -= 1
                needed.add(index)
                continue
            for name in _defined_names(shell, cell.source):
                self.namespace.setdefault(name, _stand_in(name))
        # a check cell of the release that is not the course's (edited): its check is not used
        for slot, public in self.public.slots.items():
            if allowed[public.check_hash] > 0:
                self.errors.append(f"{self.path.name}: the check cell of {slot} is not the course's (edited or "
                                   "missing); restore it from the course's exercises/ to check it here")
        return needed

    def slots(self) -> list[dict]:
        specs = [s for s in self.specs.values() if self.public is None or s.slot in self.public.slots]
        return [{"slot": s.slot, "exercise": s.exercise, "kind": s.kind, "title": s.title,
                 "forbid": list(s.forbid), **({"check_hash": self.check_hashes[s.slot]}
                                              if s.slot in self.check_hashes else {})} for s in specs]

    def describe_public(self) -> dict | None:
        """For the hello reply: where the public cases come from (``None``: not public mode)."""
        if self.public is None:
            return None
        return {"file": str(self.public.path), "seed": self.public.seed, "max_cases": self.public.max_cases,
                "cases": {slot: [len(s.seeds), s.cases_total] for slot, s in self.public.slots.items()}}

    def plan(self, submitted: dict | None = None) -> dict:
        """The notebook runs a submission is graded in (see :mod:`.graded_build`)."""
        from . import graded_build

        return graded_build.plan_for(self.nb, self.specs, submitted)

    def build(self, strip: list[str], exercises_of: dict, root: str) -> str:
        """A copy of the package without the helpers in ``strip``, under ``root``."""
        from . import graded_build

        return str(graded_build.build(tuple(strip), exercises_of, Path(root)))

    def _spec(self, slot: str) -> harness.Spec:
        spec = self.specs.get(slot)
        if self.public is not None and slot not in self.public.slots:
            kind = "hidden check" if slot.endswith("/hidden") else "check"
            raise KeyError(f"no public cases for {kind} {slot!r} (only the instructor's grader, with the "
                           "course's solutions, checks it)")
        if spec is None and self.public is not None:
            problem = next((e for e in self.errors + self.skipped if f" {slot} " in e), "its check cell did not run")
            raise KeyError(f"{slot} cannot be checked on the public cases: {problem}")
        if spec is None:
            known = ", ".join(self.specs) or "none"
            raise KeyError(f"no check {slot!r} in {self.path.name} (its checks: {known})")
        return spec

    def cases(self, slot: str, seed: int | None) -> dict:
        """The slot's inputs drawn from ``seed`` (a fresh one if ``None``) — and the course's values
        on them, computed now (see :meth:`reference`)."""
        spec = self._spec(slot)
        if seed is None:
            seed = self.public.seed if self.public is not None else random.SystemRandom().randrange(1 << 62)
        text, seeds = self._draw(slot, seed)
        self.reference(slot, seed)
        reply = {"slot": slot, "seed": seed, "cases": text, "seeds": seeds, "forbid": list(spec.forbid),
                 "title": spec.title}
        if self.public is not None:
            reply["public"] = {"cases": len(seeds), "of": self.public.slots[slot].cases_total}
        return reply

    def _draw(self, slot: str, seed: int) -> tuple[str, list[int]]:
        if self.public is not None:
            if int(seed) != self.public.seed:
                raise ValueError(f"without the course's solutions only the public cases can be checked "
                                 f"(seed {self.public.seed}), not inputs drawn from seed {seed}")
            public = self.public.slots[slot]
            return public.cases, public.seeds
        key = (slot, seed)
        if key not in self.cases_cache:
            rng = harness.CaseRNG(harness.case_seed(seed, slot))
            cases = list(self._spec(slot).cases(rng))
            if not cases:
                raise ValueError(f"check {slot} drew no cases")
            seeds = [rng.seed31() for _ in cases]
            self.cases_cache[key] = (wire.dumps(cases), seeds)
        return self.cases_cache[key]

    def reference(self, slot: str, seed: int) -> str:
        """The course's values on the slot's inputs drawn from ``seed`` (wire text, cached)."""
        key = (slot, seed)
        if self.public is not None:
            self._spec(slot)
            self._draw(slot, seed)
            return self.public.slots[slot].reference
        if key not in self.reference_cache:
            spec = self._spec(slot)
            text, seeds = self._draw(slot, seed)
            times = []
            # a timed check: the course's time, as the grader times a kernel's (the cases run and
            # packed), the faster of two runs (the first pays for this process's first allocations)
            for _ in range(2 if spec.max_slowdown else 1):
                started = time.perf_counter()
                nodes = harness.run_cases(spec.run, wire.loads(text), seeds)
                packed = wire.pack(nodes)
                times.append(time.perf_counter() - started)
            for i, value in enumerate(wire.loads(packed)):
                if isinstance(value, wire.Raised) and value.not_implemented:
                    raise RuntimeError(f"the course's answer to {slot} is not implemented (case {i + 1})")
            self.reference_cache[key] = packed
            self.reference_seconds[key] = min(times)
        return self.reference_cache[key]

    def compare(self, slot: str, seed: int, values: str, seconds: float | None = None, *,
                clock: str = "grader") -> dict:
        """The verdict on a kernel's values (wire text: one value per case) for the slot's inputs
        drawn from ``seed``: every case must have the structure of the course's value
        (:mod:`.structure`) before the check's compare (or :func:`.harness.same`) looks at it.

        ``seconds``: how long the cases took, on ``clock``: ``"grader"`` (the engine's, outside the
        kernel) or ``"kernel"`` (a learner's own check, timed where it ran). A timed hidden check
        (``max_slowdown``) whose values are right fails when that is over
        :func:`.harness.time_limit` of the course's time on the same inputs."""
        # the public cases' values were computed on the machine that ran `make exercises`: floats may
        # differ from this one's by rounding alone (harness.ACROSS_MACHINES_ULPS)
        with harness.values_from_another_machine(self.public is not None):
            verdict = self._compare_values(slot, seed, values)
        spec = self.specs[slot]
        if not verdict["passed"] or not spec.max_slowdown or seconds is None or self.public is not None:
            return verdict
        course = self.reference_seconds[(slot, seed)]   # set with the reference the values met
        limit = harness.time_limit(spec.max_slowdown, course)
        if seconds <= limit:
            return {**verdict, "seconds": round(seconds, 3), "limit": round(limit, 3)}
        return self._verdict(
            False, f"hidden check of {spec.exercise}: every value was right, but its {verdict['cases']} cases took "
                   f"{seconds:.2f} s, {CLOCKS[clock]}; the course's answer took "
                   f"{course:.2f} s on the same inputs, and the limit is {limit:.2f} s ({spec.max_slowdown:g}× "
                   f"that, at least {harness.TIMED_FLOOR_SECONDS:g} s). Work that grows with the inputs is "
                   "still done one piece at a time in Python", spec, seed)

    def _compare_values(self, slot: str, seed: int, values: str) -> dict:
        spec = self._spec(slot)
        text, _ = self._draw(slot, seed)
        cases = wire.loads(text)
        name = f"hidden check of {spec.exercise}" if spec.kind == "hidden" else spec.exercise
        try:
            gots = wire.loads(values)
            if not isinstance(gots, list):
                raise wire.WireError(f"not a list of values but {structure.describe(gots)}")
        except wire.WireError as e:
            return self._verdict(False, f"{name}: the values sent by the notebook could not be read ({e})",
                                 spec, seed)
        if gots and isinstance(gots[0], wire.Raised) and gots[0].not_implemented:
            return {"passed": False, "message": f"{spec.exercise}: not implemented yet ({gots[0]})",
                    "not_implemented": True}
        wants = wire.loads(self.reference(slot, seed))
        for got, want in zip(gots, wants):                # the run stops at a NotImplementedError
            if isinstance(got, wire.Raised) and got.not_implemented and not isinstance(want, wire.Raised):
                return {**self._verdict(False, f"{spec.exercise}: not implemented yet ({got})", spec, seed,
                                        hint=False), "not_implemented": True}
        stopped = (0 < len(gots) < len(cases) and len(gots) <= len(wants) and isinstance(gots[-1], wire.Raised)
                   and not isinstance(wants[len(gots) - 1], wire.Raised))   # ranks that hung end the run
        if len(gots) < len(cases) and not stopped:
            return self._verdict(False, f"{name}: only {len(gots)} of {len(cases)} cases ran", spec, seed)
        if len(gots) > len(cases):
            return self._verdict(False, f"{name}: {len(gots)} values for {len(cases)} cases", spec, seed)
        any_length = ANY_LENGTH.get(spec.exercise, frozenset())
        for i, (case, got, want) in enumerate(zip(cases[:len(gots)], gots, wants[:len(gots)], strict=True)):
            where = f"{name}, {'public ' if self.public is not None else ''}case {i + 1} of {len(cases)}"
            if isinstance(want, wire.Raised) and spec.compare is not None and not isinstance(got, wire.Raised):
                return self._verdict(False, f"{where} — {self._describe(spec, case)}: the course's own answer "
                                            f"raised {want} on this case (report this to the course)", spec, seed)
            if isinstance(got, wire.Raised) and not isinstance(want, wire.Raised):
                return self._verdict(False, f"{where} — {self._describe(spec, case)}: "
                                            f"{structure.raised_text(got)}", spec, seed)
            try:
                problem = structure.mismatch(got, want, any_length=any_length)
            except Exception as e:  # noqa: BLE001 - odd values must become a verdict, not a crash
                problem = f"the result could not be checked ({type(e).__name__}: {e})"
            if problem:     # it fails: the check's own message, where it has one, says why better
                text = self._compare_message(spec, case, got, want) if not _holds_raised(got) else None
                return self._verdict(False, f"{where} — {self._describe(spec, case)}: {text or problem}", spec, seed)
            try:
                if spec.compare is not None:
                    spec.compare(case, got, want)
                else:
                    harness.same(got, want, rtol=spec.rtol, atol=spec.atol, exact=spec.exact)
            except AssertionError as e:
                text = str(e).strip() or "the check's comparison failed (no message)"
                return self._verdict(False, f"{where} — {self._describe(spec, case)}: {text}", spec, seed)
            except Exception as e:  # noqa: BLE001 - odd values must become a verdict, not a crash
                return self._verdict(False, f"{where} — {self._describe(spec, case)}: the result could not "
                                            f"be checked ({type(e).__name__}: {e})", spec, seed)
        return {"passed": True, "message": "", "cases": len(cases)}

    @staticmethod
    def _compare_message(spec: harness.Spec, case, got, want) -> str | None:
        """For a value without the course's structure, which fails whatever the compare says: the
        compare's own message (``rank 0 at step 0: expected [(0, 0, 'diagonal')], got []``) where it
        raises one, else None (the structure's message: ``expected a list of 1 item, got 0 items``)."""
        if spec.compare is None:
            return None
        try:
            spec.compare(case, got, want)
        except AssertionError as e:
            return str(e).strip() or None
        except Exception:  # noqa: BLE001 - a compare that cannot read this value: the structure says why
            return None
        return None

    @staticmethod
    def _describe(spec: harness.Spec, case) -> str:
        try:
            if spec.describe is not None:
                return str(spec.describe(case))
            return harness.describe_call(getattr(spec.run, "__name__", "run"), case)
        except Exception as e:  # noqa: BLE001
            return f"(case could not be described: {type(e).__name__})"

    def _verdict(self, passed: bool, message: str, spec: harness.Spec, seed: int, *, hint: bool = True) -> dict:
        if hint and spec.hint:
            message += f"\nhint: {spec.hint}"
        if self.public is not None:
            message += (f"\n(on the public cases: fixed inputs from seed {seed}, shipped with the exercises; "
                        "your instructor's grader draws new ones and runs hidden checks too)")
        else:
            message += f"\n(inputs drawn from seed {seed})"
        return {"passed": passed, "message": message}


def _holds_raised(value) -> bool:
    """Whether an error (a :class:`~.wire.Raised`) stands anywhere in a kernel's value: then the
    structure's message names it (``rank 1 raised NameError: …``), not a compare that stumbled on it."""
    if isinstance(value, wire.Raised):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_raised(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_raised(v) for v in value.values())
    if isinstance(value, wire.Record):
        return _holds_raised(value.fields)
    return False


def _defined_names(shell, source: str) -> list[str]:
    """The names a cell binds at its top level (functions, classes, plain assignments)."""
    import ast

    try:
        tree = ast.parse(shell.transform_cell(source))
    except (SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


#: how the error of an answer's stand-in ends (public mode)
STAND_IN = "a public judge does not run answers"


def _stand_in(name: str):
    """What an answer's name stands for in a public judge, which never runs an answer."""
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"{name}: {STAND_IN}")

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


@contextlib.contextmanager
def _no_live_ranks():
    """Public mode: the set-up's ``gc.start_ranks(n)`` starts nothing. A public judge runs no answer
    and no reference — the course's values come from the file — so live ranks would only cost its
    start (``torch._dynamo``'s import and n processes: 1.4 s before a learner's first check)."""
    import gpucourse

    def start_ranks(world_size: int = 2, *, timeout: float = 60.0):
        return gpucourse.ranks

    had = "start_ranks" in vars(gpucourse)
    original = getattr(gpucourse, "start_ranks")
    gpucourse.start_ranks = start_ranks
    try:
        yield
    finally:
        if had:
            gpucourse.start_ranks = original
        else:
            del gpucourse.start_ranks


#: how a timing failure names the clock that measured it (a compare request's ``clock``)
CLOCKS = {"grader": "timed by the grader outside your kernel", "kernel": "timed in your kernel"}


def _seconds(value) -> float | None:
    """A compare request's ``seconds``: absent, or a finite number ≥ 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"seconds must be a finite number ≥ 0, got {value!r}")
    return float(value)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpucourse.grading.judge")
    p.add_argument("--chapter", required=True)
    p.add_argument("--solutions", required=True,
                   help="the folder of the chapter's solutions notebook (of its release notebook with --public)")
    p.add_argument("--public", default=None, metavar="FILE",
                   help="public mode: the chapter's public cases (exercises/public/NN_public_cases.json)")
    p.add_argument("--die-with-parent", action="store_true")
    args = p.parse_args(argv)
    if args.die_with_parent:
        _die_with_parent()
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)                               # whatever a cell prints goes to stderr
    sys.stdout = sys.stderr
    judge, failure = None, ""
    try:
        judge = Judge(args.chapter, args.solutions, public=args.public)
    except Exception as e:  # noqa: BLE001 - reported on the first request
        failure = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if judge is None:
                reply = {"error": f"the judge could not load chapter {args.chapter}: {failure}"}
            elif op == "hello":
                reply = {"chapter": judge.chapter, "slots": judge.slots(), "errors": judge.errors,
                         "solutions": str(judge.path), "public": judge.describe_public()}
            elif op == "cases":
                reply = judge.cases(msg["slot"], msg.get("seed"))
            elif op == "plan":
                reply = judge.plan(msg.get("submitted"))
            elif op == "build":
                reply = {"path": judge.build(msg["strip"], msg.get("exercises_of", {}), msg["root"])}
            elif op == "compare":
                clock = msg.get("clock", "grader")
                if clock not in CLOCKS:
                    raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
                reply = judge.compare(msg["slot"], int(msg["seed"]), msg["values"], _seconds(msg.get("seconds")),
                                      clock=clock)
            elif op == "reference":
                reply = {"slot": msg["slot"], "seed": int(msg["seed"]),
                         "values": judge.reference(msg["slot"], int(msg["seed"]))}
            else:
                reply = {"error": f"unknown request {op!r}"}
        except Exception as e:  # noqa: BLE001 - one bad request is an answer, not the end
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


def _preload(warm: bool = False) -> None:
    """What every judge imports, imported once by the host (:func:`host`): its forks share the pages.

    ``warm``: also what a process imports before it forks ranks (:func:`gpucourse.runtime.warm_parent`:
    ``torch._dynamo``, 1.5-2 s and 50-80 MB), which each judge that runs the course's answers on
    ranks would otherwise import for itself — a public judge runs no answer and starts no rank.
    """
    for name in ("torch", "torch.distributed", "torch.nn", "torch.optim", "nbformat", "gpucourse",
                 "IPython.core.interactiveshell"):
        with contextlib.suppress(Exception):    # a judge that needs it meets the failure and reports it
            __import__(name)
    if warm:
        from ..runtime import warm_parent

        warm_parent()


def host(fd: int, *, warm: bool = False) -> int:
    """``--host FD [--warm]``: import torch, IPython and the course once (``--warm``: and what
    forking ranks needs, see :func:`_preload`), then fork one judge per request.

    Requests come over the ``SOCK_SEQPACKET`` socket ``FD``, one message each: a JSON list, the
    judge's arguments, with three file descriptors (its stdin, stdout, stderr). The reply is
    ``{"pid": …}``; when a judge ends, ``{"exited": pid, "status": …}`` follows (negative: the
    signal that ended it). A forked judge shares the pages of everything imported here with the
    others (copy-on-write), instead of each holding its own torch, and starts in a fraction of a
    second — a judge that a submission's values crashed included. The host ends when its socket
    closes; its judges die with it (a parent-death signal). The host starts no thread (a fork
    copies only the thread that forks).
    """
    import selectors
    import socket

    from ..runtime import reap_children

    _preload(warm)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    for end in (wake_r, wake_w):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)      # the wake-up byte is what counts
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)

    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                for pid, code in reap_children():
                    with contextlib.suppress(OSError):
                        sock.send(json.dumps({"exited": pid, "status": code}).encode())
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
            except OSError:
                message, fds = b"", []
            if not message:                   # the grader closed it (or ended): so do its judges
                # at once: the interpreter's own clean-up with torch loaded took 0.7 s of every
                # check and every grading run's close (the host holds no file or folder to remove)
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(0)
            pid = os.fork()
            if pid == 0:
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    sock.close()
                    for end in (wake_r, wake_w):
                        os.close(end)
                    for target, source in enumerate(fds):
                        os.dup2(source, target)
                    for source in fds:
                        if source > 2:
                            os.close(source)
                    sys.stdin = open(0, encoding="utf-8", closefd=False)     # noqa: SIM115
                    _die_with_parent()
                    code = main(json.loads(message))
                except BaseException:  # noqa: BLE001 - a judge's end, never a second host
                    traceback.print_exc()
                    code = 1
                with contextlib.suppress(Exception):
                    sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
            for source in fds:
                os.close(source)
            sock.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--host"]:
        sys.exit(host(int(sys.argv[2]), warm=sys.argv[3:4] == ["--warm"]))
    sys.exit(main())
