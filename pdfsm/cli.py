"""The ``pdfsm`` command: diagrams of the tables, the demo, and the postmortem tools.

``replay`` checks and summarizes durable logs, ``trace`` turns them into a Chrome
trace (Perfetto), ``report`` into one self-contained HTML page; docs/postmortem.md
walks through them on a demo log with a planted fault.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import structlog

from pdfsm import diagram

__all__ = ["main"]


def _diagram(args: argparse.Namespace) -> int:
    if args.markdown:
        if args.machine is not None or args.format is not None:  # they were ignored (found by a helper's review)
            print("pdfsm diagram: --markdown is the whole page (every machine, Mermaid): "
                  "name no machine and no --format with it", file=sys.stderr)
            return 2
        text = diagram.markdown()
    else:
        if args.machine is None:
            print("pdfsm diagram: name a machine (consumer, producer, engine) or pass --markdown", file=sys.stderr)
            return 2
        table = diagram.TABLES[args.machine]
        text = diagram.dot(table) if args.format == "dot" else diagram.mermaid(table)
    if args.output:
        from pdfsm.postmortem import write_output

        return 0 if write_output(args.output, text, "pdfsm diagram") else 2
    sys.stdout.write(text)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from pdfsm.postmortem import replay_command

    return replay_command(args)


def _trace(args: argparse.Namespace) -> int:
    from pdfsm.trace import trace_command

    return trace_command(args)


def _report(args: argparse.Namespace) -> int:
    from pdfsm.report import report_command

    return report_command(args)


def configure_logging(level: str) -> None:
    """structlog to stderr at ``level``: the library logs, the application decides where."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdfsm", description=__doc__)
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="structlog level on stderr (debug: one line per transition)")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("diagram", help="render a machine's transition table")
    d.add_argument("machine", nargs="?", choices=sorted(diagram.TABLES))
    d.add_argument("--format", choices=("mermaid", "dot"), help="mermaid (the default) or dot")
    d.add_argument("--markdown", action="store_true", help="the whole docs/state-machines.md page")
    d.add_argument("-o", "--output", help="write to this file instead of stdout")
    d.set_defaults(func=_diagram)

    from pdfsm import demo, run, soak

    for name, module, func, summary in (
        ("demo", run, run.run_command,
         "a prefill and a decode engine in two processes over real NIXL, then the replay of their logs"),
        ("demo-sim", demo, demo.run, "the same hand-off in one process over the deterministic simulated "
         "transport, with planted faults for postmortems"),
        ("soak", soak, soak.soak_command, "the demo's engines under steady load with random faults and a "
         "restarted prefill; checks nothing leaked"),
    ):
        d = sub.add_parser(name, help=summary, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(d)
        d.set_defaults(func=func)

    from pdfsm.postmortem import add_replay_arguments, log_path

    r = sub.add_parser("replay", help="check durable logs by replaying them, and summarize what happened",
                       description="Exit codes: 0 clean or torn tail (reported), 2 usage, 3 divergence, "
                                   "4 corrupt log, 5 unsupported version, 6 no log (docs/postmortem.md).")
    add_replay_arguments(r)
    r.set_defaults(func=_replay)

    t = sub.add_parser("trace", help="write a Chrome trace (open it in Perfetto) of durable logs")
    t.add_argument("logs", nargs="+", metavar="LOG", type=log_path,
                   help="log directories or segment files, as for replay")
    t.add_argument("-o", "--output", required=True, help="the trace file to write (JSON; - for stdout)")
    t.add_argument("--no-events", action="store_true", help="leave out the instant per record on the thread tracks")
    t.set_defaults(func=_trace)

    h = sub.add_parser("report", help="write one self-contained HTML page about durable logs")
    h.add_argument("logs", nargs="+", metavar="LOG", type=log_path,
                   help="log directories or segment files, as for replay")
    h.add_argument("-o", "--output", required=True, help="the HTML file to write (- for stdout)")
    h.add_argument("--rows", type=int, default=200, help="machines (requests and engines) drawn in the timeline (200)")
    h.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pdfsm.postmortem import reader_left

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    code = 0  # a command that was still printing when its reader left (`pdfsm demo | head`) has none
    try:
        code = args.func(args)
        # Now, not at exit, where a reader that left would turn the code into 120. The reader leaving
        # is no error of ours, and replay, trace and report keep their code when it does (say()).
        if sys.stdout is not None:  # started with stdout closed (`>&-`): nothing was printed to flush
            sys.stdout.flush()
    except BrokenPipeError:
        reader_left()
    return code


if __name__ == "__main__":
    sys.exit(main())
