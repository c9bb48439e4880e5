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
                                               those inputs: ``{"passed", "message"}``
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
(:mod:`.structure`), before a check's compare sees them. Anything a cell prints goes to stderr;
stdout carries only the replies.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import traceback
from pathlib import Path

from . import harness, structure, wire
from .exercises import CHECK_HEADER, CHECK_TAG, HIDDEN_HEADER, HIDDEN_TAG, definition_cells

__all__ = ["ANY_LENGTH", "Judge", "main"]

#: exercises whose right answers need not have the course's length: the paths (as
#: :func:`.structure.mismatch` takes them) of the lists that may hold any number of items.
#: 08.5: any cheapest set of blocks to checkpoint is right, and two may hold different numbers of
#: blocks (its compare checks every item: an int, in range, sorted, fits the budget, cheapest).
ANY_LENGTH: dict[str, frozenset] = {"08.5": frozenset({()})}


class Judge:
    """One chapter's checks, as its solutions notebook defines them."""

    def __init__(self, chapter: str, solutions: str | os.PathLike):
        self.chapter = chapter
        paths = sorted(Path(solutions).glob(f"{chapter}_*.ipynb"))
        if not paths:
            raise FileNotFoundError(f"no solutions notebook for chapter {chapter} in {str(solutions)!r}")
        self.path = paths[0]
        self.errors: list[str] = []
        self.cases_cache: dict = {}
        self.reference_cache: dict = {}
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
            self._run_cells(shell, nb)
        finally:
            os.chdir(cwd)
            harness._state["mode"] = mode
            harness._state["title"] = ""
            self.specs = dict(harness.SPECS)
            harness.SPECS.clear()

    def _run_cells(self, shell, nb) -> None:
        needed = set(definition_cells(nb, name=self.path.name))
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or index not in needed:
                continue
            source = cell.source
            tags = cell.get("metadata", {}).get("tags", [])
            first = source.lstrip().splitlines()[0] if source.strip() else ""
            header = CHECK_HEADER.match(first) or HIDDEN_HEADER.match(first)
            harness._state["title"] = header["title"].strip() if header else ""
            result = shell.run_cell(source, store_history=False, silent=True)
            if not result.success:
                err = result.error_in_exec or result.error_before_exec
                what = f"{type(err).__name__}: {err}"
                if CHECK_TAG in tags or HIDDEN_TAG in tags:
                    self.errors.append(f"{self.path.name} cell {index} ({first}) failed: {what}")
                else:
                    self.errors.append(f"{self.path.name} cell {index} failed: {what}")

    def slots(self) -> list[dict]:
        return [{"slot": s.slot, "exercise": s.exercise, "kind": s.kind, "title": s.title,
                 "forbid": list(s.forbid)} for s in self.specs.values()]

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
        if spec is None:
            known = ", ".join(self.specs) or "none"
            raise KeyError(f"no check {slot!r} in {self.path.name} (its checks: {known})")
        return spec

    def cases(self, slot: str, seed: int | None) -> dict:
        """The slot's inputs drawn from ``seed`` (a fresh one if ``None``) — and the course's values
        on them, computed now (see :meth:`reference`)."""
        spec = self._spec(slot)
        if seed is None:
            seed = random.SystemRandom().randrange(1 << 62)
        text, seeds = self._draw(slot, seed)
        self.reference(slot, seed)
        return {"slot": slot, "seed": seed, "cases": text, "seeds": seeds, "forbid": list(spec.forbid),
                "title": spec.title}

    def _draw(self, slot: str, seed: int) -> tuple[str, list[int]]:
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
        if key not in self.reference_cache:
            spec = self._spec(slot)
            text, seeds = self._draw(slot, seed)
            nodes = harness.run_cases(spec.run, wire.loads(text), seeds)
            for i, value in enumerate(wire.loads(wire.pack(nodes))):
                if isinstance(value, wire.Raised) and value.not_implemented:
                    raise RuntimeError(f"the course's answer to {slot} is not implemented (case {i + 1})")
            self.reference_cache[key] = wire.pack(nodes)
        return self.reference_cache[key]

    def compare(self, slot: str, seed: int, values: str) -> dict:
        """The verdict on a kernel's values (wire text: one value per case) for the slot's inputs
        drawn from ``seed``: every case must have the structure of the course's value
        (:mod:`.structure`) before the check's compare (or :func:`.harness.same`) looks at it."""
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
            return {"passed": False, "message": f"{spec.exercise}: not implemented yet ({gots[0]})"}
        wants = wire.loads(self.reference(slot, seed))
        for got, want in zip(gots, wants):                # the run stops at a NotImplementedError
            if isinstance(got, wire.Raised) and got.not_implemented and not isinstance(want, wire.Raised):
                return self._verdict(False, f"{spec.exercise}: not implemented yet ({got})", spec, seed, hint=False)
        if len(gots) < len(cases):
            return self._verdict(False, f"{name}: only {len(gots)} of {len(cases)} cases ran", spec, seed)
        if len(gots) > len(cases):
            return self._verdict(False, f"{name}: {len(gots)} values for {len(cases)} cases", spec, seed)
        any_length = ANY_LENGTH.get(spec.exercise, frozenset())
        for i, (case, got, want) in enumerate(zip(cases, gots, wants, strict=True)):
            where = f"{name}, case {i + 1} of {len(cases)}"
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
            if problem:
                return self._verdict(False, f"{where} — {self._describe(spec, case)}: {problem}", spec, seed)
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
    def _describe(spec: harness.Spec, case) -> str:
        try:
            if spec.describe is not None:
                return str(spec.describe(case))
            return harness.describe_call(getattr(spec.run, "__name__", "run"), case)
        except Exception as e:  # noqa: BLE001
            return f"(case could not be described: {type(e).__name__})"

    @staticmethod
    def _verdict(passed: bool, message: str, spec: harness.Spec, seed: int, *, hint: bool = True) -> dict:
        if hint and spec.hint:
            message += f"\nhint: {spec.hint}"
        message += f"\n(inputs drawn from seed {seed})"
        return {"passed": passed, "message": message}


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpucourse.grading.judge")
    p.add_argument("--chapter", required=True)
    p.add_argument("--solutions", required=True)
    p.add_argument("--die-with-parent", action="store_true")
    args = p.parse_args(argv)
    if args.die_with_parent:
        _die_with_parent()
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)                               # whatever a cell prints goes to stderr
    sys.stdout = sys.stderr
    judge, failure = None, ""
    try:
        judge = Judge(args.chapter, args.solutions)
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
                         "solutions": str(judge.path)}
            elif op == "cases":
                reply = judge.cases(msg["slot"], msg.get("seed"))
            elif op == "plan":
                reply = judge.plan(msg.get("submitted"))
            elif op == "build":
                reply = {"path": judge.build(msg["strip"], msg.get("exercises_of", {}), msg["root"])}
            elif op == "compare":
                reply = judge.compare(msg["slot"], int(msg["seed"]), msg["values"])
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


if __name__ == "__main__":
    sys.exit(main())
