"""`memdiff comment --report FILE`: post or update the sticky pull-request comment (the action's step)."""

from __future__ import annotations

import argparse
import os
import re

from memdiff.github import MODES, post_comment

DESCRIPTION = ("Post the markdown report as one pull-request comment, found again by a hidden marker and "
               "updated in place, through `gh api` with GH_TOKEN. Never fails the job: when the token cannot "
               "write (a fork's pull request), it says so in the job summary.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("--report", required=True, metavar="FILE", help="markdown report from `memdiff ... --github`")
    p.add_argument("--title", type=_title, default="memdiff",
                   help="comment title: several gates can share a pull request (letters, digits, spaces, . _ -)")
    p.add_argument("--mode", choices=MODES, default="on-regression",
                   help="post always, only on a regression (default), or never; an existing comment is "
                        "always updated")
    # An empty value (a compare step that never set its output) means unknown: the comment step
    # must not fail the job over it, so it is accepted without being offered as a choice.
    p.add_argument("--verdict", type=_verdict, default="", metavar="{pass,fail,no-baseline}",
                   help="the gate's verdict (a comment is posted on fail and no-baseline)")


TITLE = re.compile(r"[\w .-]{1,64}")


def _title(value: str) -> str:
    # The title goes into the HTML comment that finds the comment again: `-->` would end it.
    if not TITLE.fullmatch(value):
        raise argparse.ArgumentTypeError("a title is 1 to 64 letters, digits, spaces, '.', '_' or '-'")
    return value


def _verdict(value: str) -> str:
    if value not in ("pass", "fail", "no-baseline", ""):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from pass, fail, no-baseline)")
    return value


def run(args: argparse.Namespace) -> int:
    """Post or update the comment."""
    return post_comment(args.report, args.title, args.mode, args.verdict, os.environ)
