"""Command line: ``python -m gpucourse {doctor,check,exercises}`` (also installed as ``gpucourse``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpucourse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="can the course run on this machine? (hardware, backends, a "
                                      "2-process all-reduce)")
    p.add_argument("--no-smoke-test", action="store_true", help="skip the 2-process all-reduce")

    p = sub.add_parser("check", help="run notebooks in a fresh kernel and grade their exercises")
    p.add_argument("notebooks", nargs="+", help="notebook files or folders of notebooks")
    p.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300)")

    p = sub.add_parser("exercises", help="regenerate exercises/ from solutions/")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--exercises", default="exercises")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if exercises/ is out of date")

    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .runtime.doctor import doctor

        return 0 if doctor(smoke_test=not args.no_smoke_test) else 1
    if args.command == "check":
        from .grading.check import main as check_main

        return check_main(args.notebooks, cell_timeout=args.cell_timeout)
    from .grading.exercises import generate_exercises

    try:
        changed = generate_exercises(args.solutions, args.exercises, check_only=args.check)
    except FileNotFoundError as e:
        print(f"gpucourse exercises: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(("out of date: " if args.check else "wrote ") + str(path))
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
