"""``python -m gradcomp.report RUN [RUN ...] [-o report.html] [--png report.png] [--trace all.json]``:
see ``gradcomp.report``."""
from __future__ import annotations

import argparse
import json
import sys

from . import render
from .inputs import load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradcomp.report",
                                description="One HTML page from a run's stats records (*.jsonl, "
                                            "gradcomp.report.record) and timelines (*.json, GRADCOMP_TIMELINE).")
    p.add_argument("run", nargs="+", help="files, or folders holding them")
    p.add_argument("-o", "--output", default="gradcomp-report.html", help="the HTML page to write")
    p.add_argument("--png", help="also write the figures as one PNG picture")
    p.add_argument("--trace", help="also merge every rank's timeline into this one trace file "
                                   "(one Perfetto or chrome://tracing tab for the whole job)")
    args = p.parse_args(argv)
    try:
        if args.trace:
            run = load(args.run)
            with open(args.trace, "w", encoding="utf-8") as f:
                json.dump([e for rank in sorted(run.traces) for e in run.traces[rank]], f)
            print(f"wrote {args.trace}")
        print(f"wrote {render(args.run, args.output, args.png)}")
    except (ImportError, FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
