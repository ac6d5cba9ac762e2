"""The ``fusionllm`` command line: the entry point, the parser's frame (errors in one
line, every default shown, ``-v`` anywhere) and the dispatch to each command's module.
Each command's flags are built in ``fusionllm/parser_*.py`` from the groups it uses."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from fusionllm.data_cli import add_data_parser
from fusionllm.parser_job import add_local_commands
from fusionllm.parser_plan import add_plan_commands
from fusionllm.parser_swarm import add_swarm_commands
from fusionllm.parser_testbed import add_testbed_commands
from fusionllm.usage import EXIT_INTERRUPTED, EXIT_USAGE, UsageError

#: the module that holds each command's ``cmd_<name>``: imported only once the arguments
#: parsed, as the commands import torch (seconds) and a usage error or --help needs none
COMMANDS = {
    **dict.fromkeys(("demo", "coordinator", "join", "token", "ban"), "fusionllm.swarm_cmds"),
    **dict.fromkeys(("plan", "sim"), "fusionllm.plan_cmds"),
    **dict.fromkeys(("train", "inspect", "compare", "status"), "fusionllm.commands"),
    "export": "fusionllm.export_cmds",
    "data": "fusionllm.data_cmds",
    "testbed": "fusionllm.testbed.cmd",
}

#: defaults that say nothing when shown: an unset option, an off switch, an empty list
_UNSHOWN = (None, False, "", [], argparse.SUPPRESS)
#: how long a thread holds the GIL while another waits for it (Python's default: 5 ms).
#: A peer's event loop shares its process with the compute thread, the coordinator's with
#: a rebalance check's planner: at 5 ms, a frame that arrived waited up to 5 ms for its
#: loop. At 0.5 ms the demo's swarm ran 16% faster than at 5 ms, and 0.2 ms beat 0.5 and
#: 1 ms again (3 runs each; docs/benchmarks.md "Stop 57"). ``FUSIONLLM_SWITCH_S`` sets
#: another (for measuring).
SWITCH_INTERVAL_S = 0.0002


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.nargs == 0 or _unshown(action.default):
            return text
        return super()._get_help_string(action) or text


def _unshown(default: Any) -> bool:
    return any(default is d or (type(default) is type(d) and default == d) for d in _UNSHOWN)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)  # no abbreviations: '--run' is not '--run-dir'
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"fusionllm: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [
        child
        for a in p._actions
        if isinstance(a, argparse._SubParsersAction)
        for child in dict.fromkeys(a.choices.values())
    ]


def _innermost(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the deepest command named on the line (``fusionllm data prepare``'s)."""
    for token in argv:
        children = {
            name: child
            for a in p._actions
            if isinstance(a, argparse._SubParsersAction)
            for name, child in a.choices.items()
        }
        if token in children:
            p = children[token]
    return p


def _verbose_everywhere(p: argparse.ArgumentParser) -> None:
    """``-v`` after any command too (SUPPRESS: a command's parser leaves the top's value
    alone unless the flag is given there)."""
    for child in _subparsers(p):
        child.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages")
        _verbose_everywhere(child)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fusionllm", description="Decentralized training of LLMs on volunteers' GPUs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages (anywhere on the line)")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, required=True, metavar="COMMAND")
    add_swarm_commands(sub)
    add_plan_commands(sub)
    add_local_commands(sub)
    add_data_parser(sub)
    add_testbed_commands(sub)
    _verbose_everywhere(parser)
    return parser


def switch_interval() -> float:
    """``SWITCH_INTERVAL_S``, or ``FUSIONLLM_SWITCH_S`` where set to a positive number."""
    try:
        given = float(os.environ.get("FUSIONLLM_SWITCH_S", ""))
    except ValueError:
        return SWITCH_INTERVAL_S
    return given if 0 < given <= 1 else SWITCH_INTERVAL_S


def main(argv: Sequence[str] | None = None) -> int:
    sys.setswitchinterval(switch_interval())  # every command, and the peers the zygote forks
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:  # argparse would blame the top parser: point at the command's own --help
        _innermost(parser, argv).error(f"unrecognized arguments: {' '.join(extras)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # hivemind logs its own INFO lines (identity files, bootstrap) through its own handler
        logging.getLogger("hivemind").setLevel(logging.WARNING)
    # these import torch: only now that the arguments parsed
    handler = getattr(importlib.import_module(COMMANDS[args.command]), f"cmd_{args.command}")
    from protocol.model.graph import CutError, TraceFailure
    from protocol.model.job import ModelError, SpecError

    try:
        return int(handler(args) or 0)
    except (UsageError, SpecError, CutError, TraceFailure) as exc:
        print(f"fusionllm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelError as exc:
        print(f"fusionllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fusionllm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run() -> NoReturn:
    """The ``fusionllm`` command. Its objects are frozen out of the garbage collector
    before the interpreter ends: the collection it makes on the way out took 5-7 s after
    a demo's last line (hundreds of thousands of objects: the traced model, hivemind's,
    torch's), and the operating system frees the memory anyway."""
    code = main()
    gc.freeze()
    sys.exit(code)
