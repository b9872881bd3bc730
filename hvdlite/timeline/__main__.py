"""``python -m hvdlite.timeline summary trace.json [--plot out.png] [--top N]``, and
``python -m hvdlite.timeline doctor DIR`` (the same as ``hvdlite-doctor DIR``)."""

import argparse
import sys

from hvdlite.timeline import format_summary, lateness, plot_summary, summary_of_file


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        from hvdlite.timeline import doctor

        return doctor.main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m hvdlite.timeline",
        description="Summarise an hvdlite timeline (Chrome trace).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "doctor",
        help="diagnose a failed job from its flight-recorder dumps (see hvdlite-doctor --help)",
    )
    s = sub.add_parser("summary", help="time per tensor and phase, and the ranks waited for")
    s.add_argument("trace", help="timeline file (complete, or cut short by a killed job)")
    s.add_argument("--plot", metavar="PNG", help="also draw the summary into this PNG file")
    s.add_argument("--top", type=int, default=20, help="tensors shown (default 20)")
    args = p.parse_args(argv)
    try:
        summary = summary_of_file(args.trace)
    except (OSError, ValueError) as exc:
        print(f"python -m hvdlite.timeline: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary, args.top))
    print(lateness.report(args.trace, args.plot))
    if args.plot:
        try:
            plot_summary(summary, args.plot, args.top)
        except ImportError as exc:
            print(f"python -m hvdlite.timeline: {exc}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
