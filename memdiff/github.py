"""GitHub Actions: job summary, step outputs, annotations, and one sticky pull-request comment.

Everything the action does lives here, so it can be tested without GitHub: the action's YAML
only installs memdiff and calls `memdiff ... --github` and `memdiff comment`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from memdiff.atomic import append_text, write_output
from memdiff.compare.baseline import no_baseline, no_baseline_level
from memdiff.errors import InputError
from memdiff.inert import baseline_command, md_code, md_fence, md_text, shell, text
from memdiff.model import Finding
from memdiff.read.load import read_json
from memdiff.render.markdown import Options, render_diff
from memdiff.report.build import Report, largest_peak_delta

# GitHub's limit for a comment body; job summaries allow more, but one report serves both.
SIZE_LIMIT = 65_536
# Tried in order until the report fits: (rows per device, stacks, chart).
SHRINK_STEPS = ((None, True, True), (None, False, True), (10, False, True), (10, False, False), (5, False, False))


def escape_annotation(message: str) -> str:
    """A workflow command's message: one line (inert.text), then GitHub's own escaping of `%`."""
    return text(message).replace("%", "%25")


def say_bad_input(line: str, environ: Mapping[str, str], on_stderr: bool = False) -> None:
    """A run stopped on bad input (exit 2: a baseline edited wrong, a missing file) where the pull
    request reads it: an `::error` annotation and the job summary. Only the log held the line, and
    the check was red under an empty summary (or a sticky comment still saying the last verdict).
    `on_stderr` with --format json, whose stdout is the document alone."""
    print(f"::error title=memdiff::{escape_annotation(line)}", file=sys.stderr if on_stderr else sys.stdout)
    summary = environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            append_text(summary, f"### memdiff: nothing was gated: bad input\n\n{md_text(line)}\n")
        except InputError:  # the annotation says it; the exit status is already 2
            pass


def pull_request(environ: Mapping[str, str]) -> Dict[str, Any]:
    """The run's pull request from the Actions event payload; {} when there is none or the file
    cannot be read (too large, not JSON, not an object): every reader then treats the run as no
    pull request, and the report and the gate go on. Read through the bounded JSON reader."""
    path = environ.get("GITHUB_EVENT_PATH")
    if not path or not os.path.isfile(path):
        return {}
    try:
        event = read_json(path, "a GitHub event payload", allow_nan=True)
    except InputError:
        return {}
    pr = event.get("pull_request") if isinstance(event, dict) else None
    return pr if isinstance(pr, dict) else {}


def _sha(part: Any) -> Optional[str]:
    sha = part.get("sha") if isinstance(part, dict) else None
    return sha[:12] if isinstance(sha, str) and sha else None


def event_labels(environ: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """(base, head) commits of the run: a pull request's base and head SHAs, else GITHUB_SHA for head."""
    pr = pull_request(environ)
    return _sha(pr.get("base")), _sha(pr.get("head")) or _sha({"sha": environ.get("GITHUB_SHA")})


def fit(render: Callable[[Optional[int], bool, bool, Optional[str]], str], top: int,
        limit: int = SIZE_LIMIT) -> str:
    """The fullest report under `limit` bytes, saying what was left out when anything was."""
    text = ""
    for rows, details, chart in SHRINK_STEPS:
        rows = top if rows is None else min(rows, top)
        dropped = [what for what, kept in (("the stacks", details), ("the chart", chart)) if not kept]
        if rows < top:
            dropped.insert(0, f"rows past the top {rows}")
        note = (f"Folded to stay under GitHub's {limit:,}-byte limit: {', '.join(dropped)} left out; "
                f"run memdiff locally for the full report.") if dropped else None
        text = render(rows, details, chart, note)
        if len(text.encode("utf-8")) <= limit:
            return text
    return text.encode("utf-8")[: limit - 4].decode("utf-8", "ignore") + "\n...\n"


@dataclass
class Publisher:
    """Collects each diff of a command run, then writes what GitHub reads."""

    environ: Mapping[str, str]
    report_path: Optional[str]
    base_label: Optional[str] = None
    head_label: Optional[str] = None
    expected: int = 1  # reports to come: each gets an equal share of the size limit
    annotate: bool = True
    # With --format json stdout is a document a program reads: workflow commands go to stderr,
    # which the runner reads for them too.
    annotate_on_stderr: bool = False
    sections: List[str] = field(default_factory=list)
    passed: List[bool] = field(default_factory=list)
    deltas: List[Optional[int]] = field(default_factory=list)  # each report's Report.peak_delta_bytes
    without_baseline: List[str] = field(default_factory=list)
    findings: List[str] = field(default_factory=list)  # the codes of the findings shown, each once
    failed_findings: List[str] = field(default_factory=list)  # the codes that failed the gate, each once

    def add(self, report: Report) -> None:
        """Render one report for the summary and print its annotations."""
        base, head = event_labels(self.environ)

        def render(rows: Optional[int], details: bool, chart: bool, note: Optional[str]) -> str:
            options = Options(base_label=self.base_label or report.base_label or base,
                              head_label=self.head_label or report.head_label or head,
                              details=details, chart=chart, note=note)
            return render_diff(report.refolded(rows or report.top), options)

        self.sections.append(fit(render, report.top, SIZE_LIMIT // max(1, self.expected) - 16))
        self.passed.append(report.passed is not False)
        self.deltas.append(report.peak_delta_bytes)
        self.findings += [c for c in dict.fromkeys(f.code for f in report.every_finding) if c not in self.findings]
        self.failed_findings += [c for c in report.failed_codes if c not in self.failed_findings]
        if not self.annotate:
            return
        for message in report.annotations:
            self._say(f"::error title=memdiff::{escape_annotation(message)}")
        for level, f in report.finding_annotations:
            self._say(f"::{level} title=memdiff {f.code} {f.name}::"
                      f"{escape_annotation(f'{f.text} (memdiff rule {f.code})')}")

    def add_missing(self, run: str, path: str, required: bool, compared: bool = True) -> None:
        """Say that `run` has no baseline at `path`, how to make one, and whether that fails the gate
        (`required`, or no run `compared`)."""
        command = baseline_command(run, path)
        folder = os.path.dirname(path)
        make = f"mkdir -p {shell(folder)} && " if folder and not os.path.isdir(folder) else ""
        fence = "\n".join(md_fence([f"{make}{command}", f"git add {shell(path)}"], info="sh"))
        self.sections.append(
            f"### memdiff: no baseline for {md_code(run)}\n\n"
            f"Nothing was compared for this run: there is no baseline at {md_code(path)}. Make it from this run and "
            f"commit it:\n\n{fence}\n\n"
            + ("This fails the gate (`--require-baseline`; in the Action, `require-baseline: false` reports such "
               "runs and gates the others).\n" if required else
               "Not gated: without `--require-baseline` such a run is reported and the others are gated; when no "
               "run has its baseline, nothing was compared and the gate fails.\n"))
        self.without_baseline.append(run)
        self.annotation(no_baseline(run, path, required, compared), no_baseline_level(required, compared))

    def annotation(self, f: Finding, level: str) -> None:
        """A finding outside any report (a run without its baseline, a history not there yet) as a
        workflow annotation, when annotating."""
        if self.annotate:
            said = escape_annotation(f"{f.text} (memdiff rule {f.code})")
            self._say(f"::{level} title=memdiff {f.code} {f.name}::{said}")

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr if self.annotate_on_stderr else sys.stdout)

    def verdict(self) -> str:
        """fail on any failed check; else no-baseline when a run had none; else pass."""
        if not all(self.passed):
            return "fail"
        return "no-baseline" if self.without_baseline else "pass"

    def finish(self) -> str:
        """Write the report file, the job summary and the step outputs; the report's path."""
        report = "\n---\n\n".join(self.sections) if self.sections else "memdiff: nothing was compared.\n"
        path = self.report_path or _new_report_path(self.environ)
        write_output(path, report)
        summary = self.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            append_text(summary, report + "\n")
        outputs = self.environ.get("GITHUB_OUTPUT")
        if outputs:
            # Nothing compared, no delta: empty rather than a 0 that reads as "unchanged".
            delta = largest_peak_delta(self.deltas)
            append_text(outputs, f"verdict={self.verdict()}\npeak-delta-bytes={'' if delta is None else delta}\n"
                                 f"report={path}\n"
                                 f"findings={' '.join(self.findings)}\n"
                                 f"failed-findings={' '.join(self.failed_findings)}\n")
        return path


def _new_report_path(environ: Mapping[str, str]) -> str:
    """A report file of this run's own: in $RUNNER_TEMP, else (outside Actions) the temporary
    folder, never the working tree where it would end up committed; a new name each time, so two
    runs at once (two jobs on one self-hosted runner) never read each other's report."""
    fd, path = tempfile.mkstemp(prefix="memdiff-report-", suffix=".md",
                                dir=environ.get("RUNNER_TEMP") or tempfile.gettempdir())
    os.close(fd)
    return path


# --- the sticky comment ----------------------------------------------------------------------

MODES = ("always", "on-regression", "never")


def marker(title: str) -> str:
    """The hidden line that finds memdiff's comment again (one per title)."""
    return f"<!-- memdiff:{title} -->"


# The identity GITHUB_TOKEN comments as; a personal or app token names its own (_author).
ACTIONS_BOT = "github-actions[bot]"


def _author(call: Callable[..., "_Reply"], environ: Mapping[str, str]) -> str:
    """The login the token comments as: MEMDIFF_COMMENT_AUTHOR when set (a GitHub App's
    `NAME[bot]`), else the token's user when it has one (a personal token), else the Actions bot
    (GITHUB_TOKEN, whose installation cannot read /user)."""
    named = environ.get("MEMDIFF_COMMENT_AUTHOR")
    if named:
        return named
    me = call("GET", "user", None, environ)
    login = me.values[0].get("login") if not me.error and me.values and isinstance(me.values[0], dict) else None
    return login if isinstance(login, str) and login else ACTIONS_BOT


def _ours(comment: Dict[str, Any], title: str, author: str) -> bool:
    """Whether a comment is this gate's: written by the token's own identity, with the marker as
    its first line. A marker elsewhere (quoted by a person, planted in a report by a name from a
    snapshot) or in anyone else's comment is not ours, so memdiff never overwrites it."""
    user = comment.get("user")
    login = user.get("login") if isinstance(user, dict) else None
    body = comment.get("body")
    return (login == author and isinstance(body, str) and body.startswith(marker(title) + "\n")
            and isinstance(comment.get("id"), int))


@dataclass
class _Reply:
    """What the GitHub API answered: the JSON values (one per page), or why it could not."""

    values: List[Any]
    error: Optional[str] = None


def _gh(method: str, path: str, payload: Optional[Dict[str, Any]], environ: Mapping[str, str]) -> _Reply:
    """A call through the `gh` command (GitHub-hosted runners have it)."""
    args = ["--paginate", path] if method == "GET" else ["--method", method, path, "--input", "-"]
    done = subprocess.run(["gh", "api", *args], input=json.dumps(payload) if payload is not None else None,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return _Reply([], ((done.stderr or done.stdout).strip().splitlines()[-1:] or ["unknown error"])[0])
    return _Reply(_json_values(done.stdout))


NEXT_PAGE = re.compile(r'<([^>]+)>;\s*rel="next"')
MAX_PAGES = 100
API_TIMEOUT_S = 30


def _rest(method: str, path: str, payload: Optional[Dict[str, Any]], environ: Mapping[str, str]) -> _Reply:
    """The same call over the REST API with the standard library, for runners without `gh`
    (self-hosted GPU machines): the token from GH_TOKEN or GITHUB_TOKEN, GITHUB_API_URL's server."""
    token = environ.get("GH_TOKEN") or environ.get("GITHUB_TOKEN")
    if not token:
        return _Reply([], "neither the gh command nor a GH_TOKEN or GITHUB_TOKEN is available")
    url: Optional[str] = f"{environ.get('GITHUB_API_URL', 'https://api.github.com').rstrip('/')}/{path}"
    data = json.dumps(payload).encode("utf-8") if payload is not None else None
    values = []
    for _ in range(MAX_PAGES):
        if url is None:
            break
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {token}", "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28", "Content-Type": "application/json", "User-Agent": "memdiff"})
        try:
            with urllib.request.urlopen(request, timeout=API_TIMEOUT_S) as answer:
                values.append(json.loads(answer.read().decode("utf-8") or "null"))
                found = NEXT_PAGE.search(answer.headers.get("Link") or "") if method == "GET" else None
        except urllib.error.HTTPError as exc:
            return _Reply([], f"HTTP {exc.code} {exc.reason}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return _Reply([], f"cannot reach the GitHub API: {getattr(exc, 'reason', exc)}")
        url = found.group(1) if found else None
    return _Reply(values)


def _json_values(printed: str) -> List[Any]:
    """Every JSON value in `printed`: `gh api --paginate` prints one array per page. InputError
    when it is not JSON (a wrapper script, a proxy's page): what gh printed is not shown."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(printed):
        if printed[i].isspace():
            i += 1
            continue
        try:
            value, i = decoder.raw_decode(printed, i)
        except ValueError as exc:
            raise InputError("gh api", f"printed output that is not JSON (at character {i:,}: "
                                       f"{getattr(exc, 'msg', 'malformed')}); no comment was posted") from None
        values.append(value)
    return values


def _note(environ: Mapping[str, str], text: str) -> None:
    print(f"::warning title=memdiff::{escape_annotation(text)}")
    summary = environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            append_text(summary, f"\n> [!NOTE]\n> {text}\n")
        except InputError:  # the warning above says it in the log; commenting never fails the job
            pass


def post_comment(report: str, title: str, mode: str, verdict: str, environ: Mapping[str, str]) -> int:
    """Create or update the pull request's memdiff comment; never fails the job (always 0)."""
    if mode == "never":
        return 0
    number = pull_request(environ).get("number")
    repo = environ.get("GITHUB_REPOSITORY")
    if not number or not repo:
        print("memdiff: not a pull request run: no comment to post", file=sys.stderr)
        return 0
    reported = bool(report) and os.path.isfile(report)
    if reported:
        with open(report, encoding="utf-8") as f:
            body = f"{marker(title)}\n{f.read()}"
    else:
        # An earlier run's comment would go on showing its verdict (a green "no regression") beside
        # this run's red check: it is updated to say so, and no new comment is posted.
        body = (f"{marker(title)}\n### ⚠️ memdiff: no report for this run\n\nThe memdiff step stopped before it "
                "compared anything (bad input: its `::error` annotation and the job summary say why), so the "
                "verdict this comment showed for an earlier run no longer holds.\n")
    call = _gh if shutil.which("gh") else _rest
    listed = call("GET", f"repos/{repo}/issues/{number}/comments", None, environ)
    if listed.error:
        return _refused(listed.error, environ)
    comments = [c for page in listed.values for c in (page if isinstance(page, list) else [page])
                if isinstance(c, dict)]
    marked = [c for c in comments if isinstance(c.get("body"), str) and c["body"].startswith(marker(title) + "\n")]
    # Whose comment it is matters only when one is marked: no lookup on a pull request's first run.
    author = _author(call, environ) if marked else ACTIONS_BOT
    mine = next((c for c in marked if _ours(c, title, author)), None)
    if not reported:
        _note(environ, "memdiff produced no report (see the step above), so no comment was posted"
                       + ("; the earlier comment now says its verdict no longer holds." if mine else "."))
    if mine is not None:  # an existing comment is always brought up to date, even when all is well now
        done = call("PATCH", f"repos/{repo}/issues/comments/{mine['id']}", {"body": body}, environ)
    elif not reported:
        return 0
    elif mode == "always" or verdict in ("fail", "no-baseline"):
        done = call("POST", f"repos/{repo}/issues/{number}/comments", {"body": body}, environ)
    else:
        print("memdiff: no regression and no earlier comment: nothing to post", file=sys.stderr)
        return 0
    if done.error:
        return _refused(done.error, environ)
    print(f"memdiff: {'updated' if mine else 'posted'} the pull request comment", file=sys.stderr)
    return 0


def _refused(reason: str, environ: Mapping[str, str]) -> int:
    if "403" in reason or "Resource not accessible" in reason:
        _note(environ, "memdiff could not comment on this pull request: the token cannot write here (a pull "
                       "request from a fork gets a read-only token). The report is in this job's summary.")
    else:
        _note(environ, f"memdiff could not comment on this pull request: {reason}. The report is in this "
                       f"job's summary.")
    return 0
