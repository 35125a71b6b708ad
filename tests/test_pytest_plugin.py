"""The pytest plugin: @pytest.mark.memdiff gates a test's memory, as a team's own suite runs it."""

from __future__ import annotations

import json
import textwrap
from typing import Dict

import pytest
from conftest import INNER_PYTEST

# Slow (the fast loop, -m "not slow", leaves it out): each test runs a suite that records.
pytestmark = pytest.mark.slow

# A training-step stand-in whose memory the environment sets: one tensor of MEMDIFF_TEST_FLOATS floats.
TESTS = textwrap.dedent("""
    import os
    import pytest
    import torch

    def work():
        keep = torch.zeros(int(os.environ.get("MEMDIFF_TEST_FLOATS", "65536")))
        return keep.sum()

    @pytest.mark.memdiff(fail_over="16KiB", fail_over_pct=1)
    def test_step():
        work()
""")


@pytest.fixture
def suite(pytester, torch):
    pytester.makepyfile(test_model=TESTS)
    return pytester


def run(pytester, *args, floats=65536):
    pytester._monkeypatch.setenv("MEMDIFF_TEST_FLOATS", str(floats))  # noqa: SLF001 - pytester's own
    return pytester.runpytest_subprocess(*INNER_PYTEST, *args)


def baseline_of(pytester):
    return json.loads((pytester.path / "baselines" / "test_model.py-test_step.json").read_text())


# What the first `pytest --memdiff-update` of TESTS wrote. The tests that start from that baseline get
# its bytes in their own folder: the same file the update writes (stacks are keyed by file name, not
# folder), without a suite run each.
FIRST_UPDATE: Dict[str, bytes] = {}


def updated(pytester) -> None:
    """Leave baselines/ as `pytest --memdiff-update` of TESTS does: run it once, copy it after."""
    stored = pytester.path / "baselines" / "test_model.py-test_step.json"
    if "baseline" not in FIRST_UPDATE:
        run(pytester, "--memdiff-update").assert_outcomes(passed=1)
        FIRST_UPDATE["baseline"] = stored.read_bytes()
        return
    stored.parent.mkdir(exist_ok=True)
    stored.write_bytes(FIRST_UPDATE["baseline"])


def test_update_creates_the_baseline_then_the_gate_passes_and_fails(suite):
    updated(suite)
    stored = baseline_of(suite)
    assert stored["name"] == "test_model.py::test_step"
    assert stored["source"]["file"] == "test_model.py-test_step.pickle"  # the test's run, not "test.pickle"
    assert stored["devices"][0]["peak_bytes"] >= 65536 * 4
    assert stored["thresholds"]["peak"] == {"fail-over": "16KiB", "fail-over-pct": 1}

    run(suite).assert_outcomes(passed=1)

    result = run(suite, floats=65536 + 8192)  # 32 KiB more: over 16 KiB and 1%
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "memdiff: device memory regressed against baselines/test_model.py-test_step.json: peak +32.00 KiB" in out
    assert "FAIL  device 0 peak: " in out and "limit: more than 1% and by more than 16.00 KiB" in out
    assert "category" in out and "TOTAL" in out  # the diff's first screen, not a bare number
    assert "memdiff: regression: peak +32.00 KiB" in out  # opening with the report's headline
    assert "head  test_model.py-test_step.pickle  (" in out
    assert "Traceback" not in out
    assert result.ret == 1  # a regression, as the CLI says it


def test_update_writes_exactly_the_markers_limits(suite):
    updated(suite)
    suite.makepyfile(test_model=TESTS.replace('fail_over="16KiB", fail_over_pct=1', "fail_over_pct=5"))
    run(suite, "--memdiff-update").assert_outcomes(passed=1)
    assert baseline_of(suite)["thresholds"]["peak"] == {"fail-over-pct": 5}  # no 16 KiB left from before
    result = run(suite, floats=4 * 65536)
    result.assert_outcomes(failed=1)
    assert "limit: more than 5%\n" in result.stdout.str()


def test_update_refreshes_a_baseline_and_keeps_its_name(suite):
    updated(suite)
    before = baseline_of(suite)["devices"][0]["peak_bytes"]
    result = run(suite, "--memdiff-update", floats=4 * 65536)
    result.assert_outcomes(passed=1)
    # The update wrote into the repository: it says which file (it said nothing), for `git add`.
    result.stdout.fnmatch_lines(["memdiff: wrote 1 baseline (0 new): baselines/test_model.py-test_step.json; "
                                 "review and commit them"])
    after = baseline_of(suite)
    assert after["devices"][0]["peak_bytes"] - before == 3 * 65536 * 4
    assert after["name"] == "test_model.py::test_step"
    run(suite, floats=4 * 65536).assert_outcomes(passed=1)


def test_a_missing_baseline_fails_with_the_command_that_makes_it(suite):
    result = run(suite)
    result.assert_outcomes(failed=1)
    assert result.ret == 2  # nothing was compared: bad input, as the CLI's --require-baseline; never a regression
    result.stdout.fnmatch_lines(["*no baseline for this test at baselines/test_model.py-test_step.json*",
                                 "*pytest 'test_model.py::test_step' --memdiff-update*"])


def test_a_renamed_tests_missing_baseline_names_the_stale_one_and_only_that(suite):
    # A renamed test left its old baseline behind, and nothing ever said so. A test beside one that
    # is still collected (a new case next to test_step) is not told that test_step's file is stale.
    updated(suite)
    suite.makepyfile(test_model=TESTS + "\n\n@pytest.mark.memdiff\ndef test_steps():\n    work()\n")
    result = run(suite)
    result.assert_outcomes(passed=1, failed=1)
    assert "is there, of no test collected" not in result.stdout.str()
    suite.makepyfile(test_model=TESTS.replace("def test_step(", "def test_stepz("))
    result = run(suite)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no baseline for this test at baselines/test_model.py-test_stepz.json*",
                                 "    (baselines/test_model.py-test_step.json is there, of no test collected in this "
                                 "session: if this test was renamed from that one, that file is stale)"])


def test_verbose_adds_the_stacks_and_report_folders_get_the_markdown_and_html(suite):
    updated(suite)
    result = run(suite, "-v", "--memdiff-report", "reports", "--memdiff-html", "pages", floats=4 * 65536)
    result.assert_outcomes(failed=1)
    assert "test_model.py:" in result.stdout.str() and "work" in result.stdout.str()  # a frame of the stack
    report = (suite.path / "reports" / "test_model.py-test_step.md").read_text()
    assert report.startswith("### ❌ memdiff: regression")
    page = (suite.path / "pages" / "test_model.py-test_step.html").read_text()
    assert 'class="verdict fail"' in page and '"history":{"events"' in page  # the run's timeline is drawn


def test_a_ceiling_needs_no_baseline(pytester, torch):
    pytester.makepyfile(test_ceiling=textwrap.dedent("""
        import pytest
        import torch

        @pytest.mark.memdiff(limit="1MiB")
        def test_small():
            torch.zeros(1024).sum()

        @pytest.mark.memdiff(limit="1MiB")
        def test_big():
            torch.zeros(1024 * 1024).sum()
    """))
    result = pytester.runpytest_subprocess(*INNER_PYTEST)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*device 0 peak 4.00 MiB* is over the limit of 1.00 MiB; largest live at the peak:*"])
    assert not (pytester.path / "baselines").exists()


def test_two_xdist_workers_record_their_own_tests(pytester, torch):
    pytester.makepyfile(test_many=textwrap.dedent("""
        import pytest
        import torch

        @pytest.mark.memdiff
        @pytest.mark.parametrize("n", [1, 2, 3, 4])
        def test_step(n):
            torch.zeros(n * 4096).sum()
    """))
    pytester.runpytest_subprocess(*INNER_PYTEST, "-n", "2", "--memdiff-update").assert_outcomes(passed=4)
    stored = sorted(p.name for p in (pytester.path / "baselines").iterdir())
    assert stored == [f"test_many.py-test_step[{n}].json" for n in (1, 2, 3, 4)]
    peaks = [json.loads((pytester.path / "baselines" / name).read_text())["devices"][0]["peak_bytes"]
             for name in stored]
    assert peaks == sorted(peaks) and peaks[0] >= 4096 * 4
    pytester.runpytest_subprocess(*INNER_PYTEST, "-n", "2").assert_outcomes(passed=4)


def test_an_unmarked_suite_records_nothing_and_never_imports_torch(pytester):
    pytester.makeconftest(textwrap.dedent("""
        import sys

        def pytest_sessionfinish(session):
            loaded = [m for m in ("torch", "memdiff.recording.capture", "memdiff.api") if m in sys.modules]
            session.config.rootpath.joinpath("loaded.txt").write_text(",".join(loaded))
    """))
    pytester.makepyfile(test_plain="def test_one():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest_subprocess(*INNER_PYTEST)
    result.assert_outcomes(passed=1)
    assert (pytester.path / "loaded.txt").read_text() == ""
    assert "memdiff" in pytester.runpytest_subprocess(*INNER_PYTEST, "--markers").stdout.str()


def test_the_record_fixture_gives_the_summary_of_a_block(pytester, torch):
    pytester.makepyfile(test_fixture=textwrap.dedent("""
        import torch

        def test_block(memdiff_record):
            with memdiff_record() as run:
                x = torch.randn(1 << 20)
                y = x * 2
            d = run.summary.devices[0]
            assert d.peak_bytes >= 4 * (1 << 20)  # at least one of the two tensors
    """))
    pytester.runpytest_subprocess(*INNER_PYTEST).assert_outcomes(passed=1)


def test_bad_input_fails_in_one_line_and_the_session_exits_2(pytester, torch):
    """A marker that would check nothing and a test that records nothing are bad input, not
    regressions: each fails with one line, and the session exits 2, as the CLI does."""
    pytester.makepyfile(test_bad=textwrap.dedent("""
        import pytest
        import torch

        @pytest.mark.memdiff
        def test_nothing():
            pass

        @pytest.mark.memdiff(limit="1GiB", fail_over_pct=5)
        def test_both():
            torch.zeros(1024).sum()

        # Values of the wrong type or range: a TypeError (exit 1, as a regression) or a baseline
        # memdiff cannot read back (fail_over=-5), said before the body runs.
        @pytest.mark.parametrize("case", [
            pytest.param(1, marks=pytest.mark.memdiff(fail_over=-5)),
            pytest.param(2, marks=pytest.mark.memdiff(fail_on=5)),
            pytest.param(3, marks=pytest.mark.memdiff(limit=float("nan"))),
            pytest.param(4, marks=pytest.mark.memdiff(fail_over_pct=True, categories={"activation": None})),
            pytest.param(5, marks=pytest.mark.memdiff(limt="1GiB")),
            pytest.param(6, marks=pytest.mark.memdiff(categories={"activations": "10%"}))])
        def test_wrong(case):
            open("body-ran", "w").close()
    """))
    result = pytester.runpytest_subprocess(*INNER_PYTEST, "--memdiff-update")
    result.assert_outcomes(failed=8)
    assert result.ret == 2
    out = result.stdout.str()
    assert "memdiff: the test recorded no device memory, so there is nothing to gate" in out
    assert "; got limt (did you mean limit?)" in out
    assert "categories: no rule gives the category 'activations' (did you mean 'activation'?)" in out
    assert "limit is a ceiling with no baseline, so fail_over_pct would check nothing" in out
    for said in ("fail_over: -5 bytes is not a size: it is negative", "fail_on: a value of type int is not a list",
                 "limit: 'nan' is not a size", "fail_over_pct: 'True' is not a percentage"):
        assert f"@pytest.mark.memdiff: {said}" in out
    assert not (pytester.path / "body-ran").exists()
    assert "During handling" not in out and "Traceback" not in out
    assert not (pytester.path / "baselines").exists()  # no baseline of nothing


def test_a_corrupt_baseline_is_bad_input_and_update_replaces_it(suite):
    (suite.path / "baselines").mkdir()
    stored = suite.path / "baselines" / "test_model.py-test_step.json"
    stored.write_text('{"name": ')
    result = run(suite)
    result.assert_outcomes(failed=1)
    assert result.ret == 2
    out = result.stdout.str()
    assert "memdiff: baselines/test_model.py-test_step.json: invalid JSON at line 1" in out  # relative, as elsewhere
    assert "refresh it: pytest 'test_model.py::test_step' --memdiff-update" in out
    assert "During handling" not in out
    result = run(suite, "--memdiff-update")
    result.assert_outcomes(passed=1, warnings=1)
    assert "memdiff: warning: G009 " in result.stdout.str() and "replaced by --memdiff-update" in result.stdout.str()
    assert baseline_of(suite)["name"] == "test_model.py::test_step"
    run(suite).assert_outcomes(passed=1)


def test_another_tests_baseline_is_bad_input_and_update_makes_this_ones(suite):
    # An eval test's baseline copied under a training test's name was gated as the training test's
    # own: it failed on P002 (or, from a twin, passed) where the file is simply the wrong one.
    updated(suite)
    stored = suite.path / "baselines" / "test_model.py-test_step.json"
    stored.write_text(stored.read_text().replace('"test_model.py::test_step"', '"test_model.py::test_eval"', 1))
    result = run(suite)
    result.assert_outcomes(failed=1)
    assert result.ret == 2
    result.stdout.fnmatch_lines(["*memdiff: baselines/test_model.py-test_step.json is the baseline of "
                                 "'test_model.py::test_eval', not of this test (copied from another test, or the test "
                                 "renamed?); make this test's: pytest 'test_model.py::test_step' --memdiff-update"])
    run(suite, "--memdiff-update").assert_outcomes(passed=1)
    assert baseline_of(suite)["name"] == "test_model.py::test_step"


# Four SGD steps; with MEMDIFF_TEST_KEEP=1 each step keeps an output with its graph (a loss logged
# as a tensor), so every step peaks higher than the last while the peak stays within its rule.
TRAINING = textwrap.dedent("""
    import os
    import pytest
    import torch

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        keep = os.environ.get("MEMDIFF_TEST_KEEP") == "1"
        losses = []
        for _ in range(4):
            x = torch.randn(64, 256)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(model(x).sum() if keep else loss.item())

    @pytest.mark.memdiff(fail_over_pct=1000)
    def test_train():
        train()

    @pytest.mark.memdiff(fail_over_pct=1000, ignore=["K004"])
    def test_train_knowing_it_keeps():
        train()
""")


def test_a_leak_growing_step_over_step_fails_the_test_unless_its_code_is_ignored(pytester, torch):
    pytester.makepyfile(test_model=TRAINING)
    run(pytester, "--memdiff-update").assert_outcomes(passed=2)
    stored = json.loads((pytester.path / "baselines" / "test_model.py-test_train_knowing_it_keeps.json").read_text())
    assert stored["thresholds"]["findings"] == {"ignore": ["K004"]}
    run(pytester).assert_outcomes(passed=2)
    pytester._monkeypatch.setenv("MEMDIFF_TEST_KEEP", "1")  # noqa: SLF001 - pytester's own
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "PASS  device 0 peak" in out  # the peak is within its rule: the finding fails the test
    assert "FAIL  finding K004 kept-grows-per-step: device 0: memory kept from earlier steps grows step over step" \
        in out and "(fails on K004: default)" in out
    assert "FAILED test_model.py::test_train " in out and result.ret == 1


def test_the_marker_takes_the_flags_list_forms_and_refuses_a_contradiction(pytester, torch):
    pytester.makepyfile(test_lists=textwrap.dedent("""
        import pytest
        import torch

        @pytest.mark.memdiff(fail_on="K002, T003", ignore=["P001", "T004,T005"],
                             categories={"activation": "256MiB,10%"})
        def test_lists():
            torch.zeros(65536).sum()

        @pytest.mark.memdiff(fail_on="K004", ignore="K002,K004")
        def test_both():
            torch.zeros(65536).sum()
    """))
    result = run(pytester, "--memdiff-update")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == 2  # bad input, as the CLI's exit 2
    assert "memdiff: ignore: K004 also given to fail_on" in result.stdout.str()
    stored = json.loads((pytester.path / "baselines" / "test_lists.py-test_lists.json").read_text())["thresholds"]
    assert stored["findings"] == {"fail-on": ["K002", "T003"], "ignore": ["P001", "T004", "T005"]}
    assert stored["categories"] == {"activation": {"fail-over": "256MiB", "fail-over-pct": 10.0}}
