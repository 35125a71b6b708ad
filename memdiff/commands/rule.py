"""`memdiff rule CODE` and `memdiff rule --all`: a finding code's documentation, or the catalogue."""

from __future__ import annotations

import argparse
import sys

from memdiff.compare.findings import BY_CODE, docs_page, parse_codes, rule_section, rules_list
from memdiff.errors import EXIT_OK, InputError
from memdiff.lists import ListOption

DESCRIPTION = ("Print the documentation of a finding code (what it means, why it matters, an example, what to "
               "do: the code's section of docs/findings.md), or with --all every code with its severity and "
               "name (--markdown: the whole page).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("codes", action=ListOption, nargs="*", metavar="CODE",
                   help="finding codes (P001, k004), or a family letter (K); several: P001 K004, or P001,K004")
    p.add_argument("--all", action="store_true", help="list every code: code, severity, name")
    p.add_argument("--markdown", action="store_true",
                   help="with --all, the whole documentation page in markdown (docs/findings.md)")


def run(args: argparse.Namespace) -> int:
    """Print what was asked; exit 2 for an unknown code or nothing asked."""
    if args.all:
        if args.codes:
            raise InputError("rule", "give codes or --all, not both")
        sys.stdout.write(docs_page() if args.markdown else rules_list())
        return EXIT_OK
    if args.markdown:
        raise InputError("rule", "--markdown goes with --all (a code's section is markdown already)")
    if not args.codes:
        raise InputError("rule", "give a finding code (memdiff rule P001) or --all")
    sys.stdout.write("\n".join(rule_section(BY_CODE[c]) for c in parse_codes("rule", args.codes)))
    return EXIT_OK
