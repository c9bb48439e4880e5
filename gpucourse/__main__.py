"""Command line: ``python -m gpucourse {doctor,check,grade,exercises,export-nbgrader}``.

Also installed as the ``gpucourse`` console script (``.venv/bin/gpucourse check …``).
"""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _workers(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpucourse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="can the course run on this machine? (hardware, backends, a "
                                      "2-process all-reduce)")
    p.add_argument("--no-smoke-test", action="store_true", help="skip the 2-process all-reduce")

    p = sub.add_parser("check", help="self-check: run your exercises notebook in a fresh kernel, with "
                                     "the course's checks, one row per exercise")
    p.add_argument("notebooks", nargs="+", help="notebook files or folders of notebooks")
    p.add_argument("--cell-timeout", type=_positive, default=300, help="seconds per cell (default 300)")
    p.add_argument("--notebook-timeout", type=_positive, default=1800,
                   help="seconds per notebook (default 1800)")
    p.add_argument("--release", default=None,
                   help="release folder to restore checks from (default: exercises/ next to the notebook "
                        "or in the current folder)")
    p.add_argument("--solutions", default=None,
                   help="the course's solutions folder the judge computes expected values from "
                        "(default: the course's own solutions/)")
    p.add_argument("--seed", type=int, default=None, help="draw the checks' inputs from this seed")
    p.add_argument("--hidden", action="store_true",
                   help="run each exercise's hidden checks too, as grade --hidden does (needs the course's "
                        "solutions/, where the hidden checks live)")

    p = sub.add_parser("grade", help="grade a class: checks restored from the release, each notebook "
                                     "sandboxed, gradebook out")
    p.add_argument("submissions", nargs="+", help="submitted notebooks, or folders of them "
                                                  "(subs/<student>/*.ipynb or flat subs/*.ipynb)")
    p.add_argument("--release", default=None,
                   help="release folder (or one notebook) the checks come from (default: exercises/ of the "
                        "course the package belongs to, else ./exercises; the first lines printed say which)")
    p.add_argument("--chapter", default=None, metavar="NN",
                   help="grade this chapter's notebooks only (the others are left out, and listed)")
    p.add_argument("--hidden", nargs="?", const="", default=None, metavar="SOLUTIONS",
                   help="also run the hidden checks (from --solutions, or the folder given here)")
    p.add_argument("--solutions", default=None,
                   help="the course's solutions folder: the judge computes every expected value from it "
                        "(default: solutions/ of the course the package belongs to)")
    p.add_argument("--seed", type=int, default=None,
                   help="draw every check's inputs from this seed (default: a fresh one, printed and "
                        "recorded in the gradebook; the same seed reproduces a grade)")
    p.add_argument("--workers", type=_workers, default=None,
                   help="notebooks graded at once (default: cores / 2, at least 1)")
    p.add_argument("--csv", help="write the gradebook as CSV")
    p.add_argument("--json", help="write the gradebook as JSON (with the run's date, versions, seed)")
    p.add_argument("--totals", metavar="CSV",
                   help="write one line per student for an LMS: student, points, max, percent")
    p.add_argument("--update", action="store_true",
                   help="merge this run into the --csv/--json/--totals file already there, student by "
                        "student (this run's students replaced, the others kept); without it, a gradebook "
                        "holding students not in this run is not overwritten (exit 2)")
    p.add_argument("--feedback", metavar="DIR", help="write one feedback file per student into DIR")
    p.add_argument("--feedback-format", choices=["md", "html"], default="md")
    p.add_argument("--cell-timeout", type=_positive, default=300, help="seconds per cell (default 300)")
    p.add_argument("--notebook-timeout", type=_positive, default=900,
                   help="seconds per notebook, all cells together (default 900)")
    p.add_argument("--memory-mb", type=_workers, default=8192, help="address space per process (MB)")
    p.add_argument("--output-kb", type=_workers, default=1024, help="output kept per cell (KB)")
    p.add_argument("--no-bwrap", action="store_true",
                   help="grade without bubblewrap (the notebooks could then read the course's solutions: "
                        "trusted notebooks only; without this flag grade refuses to run unsandboxed)")

    p = sub.add_parser("exercises", help="regenerate exercises/ from solutions/")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--exercises", default="exercises")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if exercises/ is out of date")
    p.add_argument("--chapter", action="append", metavar="NN",
                   help="only this chapter (repeatable); default: every chapter")
    p.add_argument("--refresh-public", action="store_true",
                   help="recompute every chapter's public cases (exercises/public/), even those up to date")
    p.add_argument("--no-public", action="store_true",
                   help="leave the public cases (exercises/public/) alone")

    p = sub.add_parser("export-nbgrader", help="write an nbgrader course folder (source/<assignment>/, "
                                               "nbgrader_config.py)")
    p.add_argument("dir", help="nbgrader course folder to write into")
    p.add_argument("--solutions", default=None,
                   help="the course's solutions folder (default: the course's own solutions/)")
    p.add_argument("--chapter", action="append", metavar="NN",
                   help="export this chapter (repeatable); default: every chapter")
    p.add_argument("--assignment", default=None,
                   help="put the chapters into this one assignment (default: one assignment per chapter, "
                        "e.g. 08_sharded_data_parallel)")
    p.add_argument("--course-id", default="gpucourse",
                   help="nbgrader's course id, written into a new nbgrader_config.py (default gpucourse)")

    args = parser.parse_args(argv)
    if args.command != "doctor":
        from .grading.sandbox import SKIP_IMPORTS

        for name in SKIP_IMPORTS:             # before nbformat is imported: see SKIP_IMPORTS
            sys.modules.setdefault(name, None)
    if args.command == "doctor":
        from .runtime.doctor import doctor

        return 0 if doctor(smoke_test=not args.no_smoke_test) else 1
    if args.command == "check":
        from .grading.selfcheck import main as check_main

        return check_main(args.notebooks, cell_timeout=args.cell_timeout,
                          notebook_timeout=args.notebook_timeout, release=args.release,
                          solutions=args.solutions, seed=args.seed, hidden=args.hidden)
    if args.command == "grade":
        from .grading.grade import Options, grade
        from .grading.sandbox import Limits

        options = Options(cell_timeout=args.cell_timeout, notebook_timeout=args.notebook_timeout,
                          limits=Limits(memory_bytes=args.memory_mb << 20, output_bytes=args.output_kb << 10,
                                        cpu_seconds=int(args.notebook_timeout * 2) + 60),
                          use_bwrap=not args.no_bwrap)
        return grade(args.submissions, release=args.release, hidden_from=args.hidden or None,
                     hidden=args.hidden is not None, workers=args.workers, csv_path=args.csv,
                     json_path=args.json, feedback=args.feedback, feedback_format=args.feedback_format,
                     options=options, chapter=args.chapter, solutions=args.solutions, seed=args.seed,
                     allow_unisolated=args.no_bwrap, update=args.update, totals_path=args.totals)
    if args.command == "export-nbgrader":
        from .grading.nbgrader import export_nbgrader

        try:
            written = export_nbgrader(args.dir, solutions=args.solutions, chapters=args.chapter,
                                      assignment=args.assignment, course_id=args.course_id)
        except (FileNotFoundError, ValueError) as e:
            print(f"gpucourse export-nbgrader: {e}", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}")
        print(f"next: cd {args.dir} && nbgrader generate_assignment {written[0].parent.name}")
        return 0
    from .grading.exercises import generate_exercises, generate_public_cases

    try:
        changed = generate_exercises(args.solutions, args.exercises, check_only=args.check,
                                     chapters=args.chapter)
        if not args.no_public:
            # each visible check's public cases (what a check decides with where solutions/ is absent)
            changed += generate_public_cases(args.solutions, args.exercises, check_only=args.check,
                                             chapters=args.chapter, refresh=args.refresh_public,
                                             log=lambda line: print(line, flush=True))
    except FileNotFoundError as e:
        print(f"gpucourse exercises: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(("out of date: " if args.check else "wrote ") + str(path))
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
