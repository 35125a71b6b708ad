"""The `memdiff` command: parse arguments, run one subcommand, map failures to exit codes.

Exit codes: 0 no regression, 1 regression, 2 bad input or usage, 3 internal error (a bug).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import traceback
from typing import List, NoReturn, Optional, Tuple

from memdiff import __version__
from memdiff.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, InputError
from memdiff.inert import text as text_line

COMMANDS = {  # name: (module, one-line help); a module gives DESCRIPTION, add_arguments, run
    "diff": ("memdiff.commands.diff", "compare two runs (the default: memdiff BASE HEAD)"),
    "gate": ("memdiff.commands.gate", "compare runs with stored baselines and exit 1 on a regression"),
    "baseline": ("memdiff.commands.baseline", "create or update a stored baseline, or --check a folder of them"),
    "history": ("memdiff.commands.history", "append a main-branch run's peaks to a history file (the gate's trend)"),
    "summarize": ("memdiff.commands.summarize", "reduce a snapshot to its peak summary (JSON or text)"),
    "peak": ("memdiff.commands.peak", "show the peak, static memory and the top stacks live at the peak"),
    "slice": ("memdiff.commands.slice",
              "write one window of a big snapshot (steps, events or a time range) as a small snapshot"),
    "ranks": ("memdiff.commands.ranks",
              "compare the ranks of a distributed job: spread, roles, the heaviest rank's extra"),
    "forecast": ("memdiff.commands.forecast",
                 "forecast the peak at a batch size or length not run, from runs that differ in that knob"),
    "whatif": ("memdiff.commands.whatif",
               "predict the peak after a change not made (checkpointing, bf16, another optimizer, accumulation)"),
    "fit": ("memdiff.commands.fit",
            "the largest batch size (or length) whose emulated run trains on each GPU: memdiff fit --emulate h100,l4"),
    "record": ("memdiff.commands.record", "run a Python script with memory recording on and write the snapshot"),
    "rule": ("memdiff.commands.rule", "explain a finding code (P001, K004, ...), or list them all with --all"),
    "demo": ("memdiff.commands.demo", "record a small GPT with and without activation checkpointing and diff them"),
    "comment": ("memdiff.commands.comment",
                "post or update the sticky pull-request comment (the GitHub Action's step)"),
}
DEFAULT_COMMAND = "diff"
TOP_LEVEL_FLAGS = {"--debug", "--version", "-h", "--help"}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, as every other memdiff error is (argparse
    prints the usage block first): `memdiff: COMMAND: what is wrong (see ... --help)`, exit 2."""

    command: Optional[argparse.ArgumentParser] = None  # the selected command's parser, on the top one
    # A command's words for a script after `--` that argparse had no positional left for (LEFT_AFTER_DASHES)
    left_after_dashes: Optional[str] = None
    argv: List[str] = []  # what main() parses, for the error below

    def error(self, message: str) -> NoReturn:
        """Print the one line and exit 2 (argparse's contract for error())."""
        if message.startswith("the following arguments are required"):
            # A command that runs a script takes every word from the first one that is no option on as
            # the script (`fit --batch 1:8 -o runs/ -- ...`: `1:8 -o runs/ ...`), and then misses -o:
            # the option it did not know is the mistake.
            unknown = _unknown_option(self, self.argv)
            message = f"unrecognized arguments: {unknown}" if unknown else message
        if message.endswith(": expected one argument"):
            # argparse takes a value that starts with - (`--budget -5GiB`) for an option and says only this.
            option = message[len("argument "):-len(": expected one argument")].split("/")[-1]
            after = self.argv[self.argv.index(option) + 1:self.argv.index(option) + 2] if option in self.argv else []
            if after and after[0].startswith("-") and after[0][1:2].isdigit():
                message = _value_said(self, option, after[0]) or message
        # argparse reports options no parser knew from the top parser: name the command they went to.
        owner = self.command if self.command is not None and message.startswith("unrecognized") else self
        where = owner.prog[len("memdiff "):] if owner.prog.startswith("memdiff ") else "usage"
        # The message can quote an argument, and argv can be megabytes.
        text = text_line(message)
        text = text if len(text) <= 300 else text[:300] + "..."
        self.exit(EXIT_BAD_INPUT, f"memdiff: {where}: {text}{_suggestion(owner, message)} "
                                  f"(see `{owner.prog} --help`)\n")


def _unknown_option(parser: argparse.ArgumentParser, argv: List[str]) -> Optional[str]:
    """The first option among the command's own words in `argv` (before the script's) that `parser` has
    none of (nor one it abbreviates), when `parser` takes a script's words (argparse.REMAINDER)."""
    if not any(a.nargs == argparse.REMAINDER for a in parser._actions):  # noqa: SLF001 - argparse's own list
        return None
    command = parser.prog.split()[-1]
    words = argv[argv.index(command) + 1:] if command in argv else argv
    i = 0
    while i < len(words):
        name = words[i].split("=")[0]
        if name == "--" or not name.startswith("-") or name[1:2].isdigit():
            return None  # the script's words begin: what follows is the script's own
        actions = [a for a in parser._actions if any(o.startswith(name) for o in a.option_strings)]  # noqa: SLF001
        if not actions:
            return words[i]
        # A known option's value is its next word (unless given as --opt=VALUE, or the option takes none).
        takes = actions[0].nargs != 0 and "=" not in words[i]
        i += 2 if takes else 1
    return None


def _value_said(parser: argparse.ArgumentParser, option: str, value: str) -> Optional[str]:
    """What the option's own reader says of `value` (`'-5GiB' is not a size: it is negative`), or how to
    pass it when it reads it (`--opt=-5`); None for an option `parser` does not have."""
    action = next((a for a in parser._actions if option in a.option_strings), None)  # noqa: SLF001
    if action is None:
        return None
    try:
        if callable(action.type):
            action.type(value)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        return f"argument {option}: {exc}"
    return f"argument {option}: expected one argument ({value!r} starts with - and reads as an option: " \
           f"write {option}={value})"


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """`; did you mean --category-fail-over?` for an option that is one typo away from one the parser has."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    hint = getattr(parser, "left_after_dashes", None)
    if message.startswith("unrecognized arguments: -- ") and hint:
        return f"; {hint}"
    known = [o for action in parser._actions for o in action.option_strings]  # noqa: SLF001 - argparse's own list
    for arg in message[len("unrecognized arguments: "):].split()[:5]:
        close = difflib.get_close_matches(arg.split("=")[0][:100], known, n=1, cutoff=0.8)
        if close and arg.startswith("-"):
            return f"; did you mean {close[0]}?"
    return ""


def build_parser(selected: Optional[str] = None) -> argparse.ArgumentParser:
    """The argument parser; only the `selected` command's module is imported and given its arguments.

    Importing one command instead of all keeps start-up to what that command needs (summarize
    does not pay for tabulate or the gate), which matters for a tool run on every PR.
    """
    # SUPPRESS: a subcommand's default must not overwrite `memdiff --debug COMMAND`.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors")
    parser = _Parser(
        prog="memdiff", usage="memdiff [--debug] {BASE HEAD | COMMAND ...}",
        description="Peak summaries, diffs and CI gates for PyTorch GPU-memory snapshots. "
                    "`memdiff BASE HEAD` is `memdiff diff BASE HEAD`.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"memdiff {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        if name != selected:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.DESCRIPTION, parents=[common],
                           prog=f"memdiff {name}")
        module.add_arguments(p)
        setattr(p, "left_after_dashes", getattr(module, "LEFT_AFTER_DASHES", None))  # noqa: B010 - a _Parser
        p.set_defaults(run=module.run)
        parser.command = p
    return parser


def with_default_command(argv: List[str]) -> Tuple[List[str], Optional[str]]:
    """(argv, the command it runs), `diff` inserted where a command name is expected but something
    else stands (memdiff BASE HEAD)."""
    for i, arg in enumerate(argv):
        if arg in TOP_LEVEL_FLAGS:
            continue
        if arg not in COMMANDS:
            return argv[:i] + [DEFAULT_COMMAND] + argv[i:], DEFAULT_COMMAND
        return argv, arg
    return argv, None


# Words people try for what a command does: `memdiff explain P001` is `memdiff rule P001`.
ALIASES = {"explain": "rule", "compare": "diff", "show": "peak", "predict": "whatif", "check": "gate"}


def _mistyped_command(argv: List[str]) -> Optional[Tuple[str, str]]:
    """(word, what to say) when the word taken for a file to diff is no file and reads like a command:
    `did you mean ...` one typo away (`memdiff pek run.pickle`) or for a word people try, else the list
    of commands where the word is a bare name (no folder, suffix or glob: `memdiff frobnicate`)."""
    words = [a for a in argv if a not in TOP_LEVEL_FLAGS]
    if not words or words[0] in COMMANDS or words[0].startswith("-") or os.path.exists(words[0]):
        return None
    word = words[0]
    close = [ALIASES[word.lower()]] if word.lower() in ALIASES else \
        difflib.get_close_matches(word, COMMANDS, n=1, cutoff=0.6)
    if close:
        return word, f"did you mean `memdiff {close[0]}`?"
    if word.isidentifier():
        return word, f"the commands are {', '.join(COMMANDS)} (`memdiff --help`)"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Run memdiff with `argv` (default: sys.argv[1:]) and return the exit code."""
    for stream in (sys.stdout, sys.stderr):  # a lone surrogate in a frame name must not end the run
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    argv = list(sys.argv[1:] if argv is None else argv)
    mistyped = _mistyped_command(argv)
    if mistyped:
        print(f"memdiff: {text_line(mistyped[0])}: no such file or command; {mistyped[1]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    argv, selected = with_default_command(argv)
    _Parser.argv = argv
    args = build_parser(selected).parse_args(argv)
    from memdiff import progress

    # JSON on stdout may be read from the terminal by a person or by a program: no line between.
    json_out = getattr(args, "format", None) == "json" and not getattr(args, "output", None)
    progress.enable(None if json_out else sys.stderr)
    from memdiff.recording.stopping import exit_status, terminating_as_interrupt

    try:
        # SIGTERM and SIGHUP unwind as Ctrl-C does: a run's snapshot written, its children stopped (stopping.py)
        with terminating_as_interrupt():
            return args.run(args)
    except InputError as exc:
        if args.debug:
            traceback.print_exc()
        said = f"{text_line(exc.path)}: {text_line(exc.message)}"
        print(f"memdiff: {said}", file=sys.stderr)
        if getattr(args, "github", False):
            from memdiff.github import say_bad_input

            say_bad_input(said, os.environ, on_stderr=getattr(args, "format", None) == "json")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # Ctrl-C 130, SIGTERM 143, SIGHUP 129, as a shell says
        return exit_status(exc)
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; nothing left to say.
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug in memdiff: say so in one line unless --debug
        if args.debug:
            traceback.print_exc()
        print(f"memdiff: internal error: {type(exc).__name__}: {text_line(exc)} (run with --debug for the traceback; "
              f"please report it)", file=sys.stderr)
        return EXIT_INTERNAL
