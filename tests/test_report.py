"""One report, computed once: every output opens with the same headline, the API's documents are
the CLI's, and a passing gate lists only what changed."""

from __future__ import annotations

import json
import re

import pytest

from memdiff.analyse.classify import load_rules
from memdiff.cli import main
from memdiff.read.inputs import read_summary
from memdiff.units import format_bytes

CTX128, CTX256 = "cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle"


def _out(capsys, *argv) -> str:
    main([str(a) for a in argv])
    return capsys.readouterr().out


def test_the_headline_names_the_moved_peak_and_its_cause_like_for_like(shared, capsys):
    base, head = shared / CTX128, shared / CTX256
    doc = json.loads(_out(capsys, base, head, "--format", "json"))
    headline = doc["headline"]
    # Ground truth from the summaries' own phase peaks, not from the diff: activations at the
    # forward peak of each run, and the optimizer step's peak in each.
    rules = load_rules()
    b, h = read_summary(str(base), rules), read_summary(str(head), rules)
    fwd_b, fwd_h = b.devices[0].at("forward"), h.devices[0].at("forward")
    act = fwd_h.categories["activation"] - fwd_b.categories["activation"]
    assert headline.startswith(f"peak +{format_bytes(h.devices[0].peak_bytes - b.devices[0].peak_bytes)[:-4]}")
    assert "now in the forward (it was in the optimizer step)" in headline
    assert f"at the forward peak of both, activation {format_bytes(act, signed=True)}" in headline
    opt = {p.phase: p.peak_bytes for p in h.devices[0].phase_peaks}["optimizer"] - \
        {p.phase: p.peak_bytes for p in b.devices[0].phase_peaks}["optimizer"]
    assert f"the optimizer step ({format_bytes(opt, signed=True)}) is within 1%" in headline


def test_every_output_opens_with_the_same_headline(shared, capsys, tmp_path):
    base, head = shared / CTX128, shared / CTX256
    headline = json.loads(_out(capsys, base, head, "--format", "json"))["headline"]
    text = _out(capsys, base, head)
    assert text.splitlines()[0] == f"memdiff: regression: {headline}"
    markdown = _out(capsys, base, head, "--format", "markdown")
    assert markdown.splitlines()[2] == f"**{headline}**"
    page = tmp_path / "r.html"
    _out(capsys, base, head, "--html", page)
    found = re.search(r'<p class="headline">(.*?)</p>', page.read_text())
    assert found and found.group(1) == headline.replace("<", "&lt;").replace(">", "&gt;")
    # The comparison the warning asks for is one click away on the page.
    assert ('<details class="like-for-like"><summary>Compare like with like: device 0: forward peak 6.42 GiB -&gt; '
            '8.48 GiB (+2.05 GiB, +32.0%)') in page.read_text()


def test_a_peak_that_went_down_is_explained_where_it_went_down(shared, capsys):
    # ctx256 -> ctx128: the peak leaves the forward for the optimizer step. The forward is what
    # shrank, so the cause is read at the forward peak of both, not at the new peak.
    doc = json.loads(_out(capsys, shared / CTX256, shared / CTX128, "--format", "json"))
    assert doc["verdict"] == "pass"
    assert doc["headline"].startswith("peak -1.95 GiB (-23.0%), now in the optimizer step (it was in the forward): "
                                      "at the forward peak of both, activation -2.05 GiB (-55.0%)")


def test_the_api_returns_the_cli_documents(shared, tmp_path, capsys):
    import memdiff

    base, head = shared / "linear-nograd.pickle", shared / "linear-grad.pickle"
    stored = tmp_path / "b.json"
    assert main(["baseline", str(base), "-o", str(stored)]) == 0
    capsys.readouterr()
    main(["gate", str(head), "--baseline", str(stored), "--format", "json"])
    cli = json.loads(capsys.readouterr().out)
    assert len(cli) == 1
    assert json.loads(json.dumps(memdiff.gate(str(head), str(stored)).to_dict())) == cli[0]

    main([str(base), str(head), "--format", "json"])
    cli_diff = json.loads(capsys.readouterr().out)
    compared = memdiff.diff(base, head)
    assert compared.passed is None and compared.checks == []  # compared, not judged: never "passed"
    api_diff = json.loads(json.dumps(compared.to_dict()))
    assert set(api_diff) == set(cli_diff) - {"verdict", "rule", "checks", "notes", "finding_rules", "finding_checks"}
    # the CLI's findings add the judge's (G002), which the API's diff, not judged, has none of
    cli_diff["findings"] = [f for f in cli_diff["findings"] if not f["code"].startswith("G")]
    assert api_diff == {k: cli_diff[k] for k in api_diff}


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_a_passing_gate_lists_only_what_changed(shared, tmp_path, capsys, fmt):
    run = shared / "linear-grad.pickle"
    stored = tmp_path / "b.json"
    assert main(["baseline", str(run), "-o", str(stored)]) == 0
    capsys.readouterr()
    assert main(["gate", str(run), "--baseline", str(stored), "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "no group changed" in out.splitlines()[0 if fmt == "text" else 2]
    assert "SAME" not in out and "TOTAL" in out



def test_a_phase_one_run_lacks_shows_no_delta(shared, capsys):
    # Inference has no backward or optimizer step: the table must not read their memory as gone.
    out = _out(capsys, shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx128-infer.pickle")
    rows = {line.split()[0]: line.split() for line in out[out.index("phase peak"):].splitlines()[2:5]}
    assert rows["optimizer"] == ["optimizer", "6.53", "GiB", "none", "in", "head"]
    assert rows["backward"] == ["backward", "6.44", "GiB", "none", "in", "head"]


@pytest.mark.slow  # records on CPU
def test_a_wider_model_is_explained_by_its_weights(torch, tmp_path):
    # AdamW's state is twice the weights, so it moves most; the reviewer needs "the weights grew",
    # with gradients and state following them. Ground truth: the models' parameter bytes.
    import memdiff

    def step(width: int, path) -> int:
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
        opt = torch.optim.AdamW(model.parameters())
        with memdiff.record(str(path)):
            model(torch.randn(4, width)).sum().backward()
            opt.step()
        return sum(p.numel() * p.element_size() for p in model.parameters())

    small, wide = step(256, tmp_path / "a.pickle"), step(512, tmp_path / "b.pickle")
    headline = memdiff.diff(tmp_path / "a.pickle", tmp_path / "b.pickle").headline
    assert f": parameter {format_bytes(wide - small, signed=True)} " in headline
    assert "and with the weights" in headline and "optimizer_state +" in headline and "gradient +" in headline


@pytest.mark.parametrize("top", ["1", "5", "40"])
def test_a_row_reads_the_same_in_the_table_the_headline_and_the_notes(shared, capsys, top):
    # Two _to_copy rows share a site; the one shown must carry the same label in every place,
    # whatever --top leaves in the table (a label worked out per subset read differently).
    out = _out(capsys, shared / "cs336-ctx128-fwd-fp32.pickle", shared / "cs336-ctx128-fwd-mixed.pickle",
               "--top", top)
    label = "functional.py:einsum <- einsum <- _to_copy [transformer.py:22]"
    assert f"({label} +6.64 GiB new" in out.splitlines()[0]
    assert any(line.startswith("NEW") and line.rstrip().endswith(label) for line in out.splitlines())
    assert f"top growth: {label} +6.64 GiB" in out
