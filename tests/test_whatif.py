"""memdiff whatif: each rule on a hand-built loop whose answer is worked out by hand, refusals and
the JSON contract; and the scenario suite's pairs (a run, and the same loop with the change really
made, captured on CPU) predicted within 2% of the head's measured peak (OPEN: the few still over
it, each held to what it measures), in its phase."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from conftest import alloc, free
from scenario_suite import TRAIN, WHATIF_PAIRS, whatif_rows

import memdiff
from memdiff.cli import main
from memdiff.errors import InputError
from memdiff.predict.whatif import parse_change
from memdiff.read.schema import validate
from memdiff.units import format_bytes


def frames(*names: str) -> List[Dict[str, Any]]:
    """Profiler-style frames, innermost first (the file and line are in the name)."""
    return [{"filename": "none", "line": 0, "name": n} for n in names]


PARAM = frames("torch/nn/parameter.py(1): __new__", "train.py(5): build")
BWD = frames("torch/autograd/__init__.py(1): backward", "train.py(9): step")
GRAD = frames("AccumulateGrad", "torch/autograd/__init__.py(1): backward", "train.py(9): step")
STATE = frames("torch/optim/adam.py(2): _init_group", "torch/optim/adam.py(1): step", "train.py(10): step")
UPDATE = frames("torch/optim/adam.py(3): _single_tensor_adam", "torch/optim/adam.py(1): step", "train.py(10): step")
ZERO = frames("torch/optim/optimizer.py(1): zero_grad", "train.py(11): step")

W, A, T, O, U = 1000, 3000, 500, 100, 1000  # a weight, a block's saved activation, transient, output; the update's temporary


def in_block(b: int, line: int) -> List[Dict[str, Any]]:
    return frames(f"model.py({line}): forward", f"nn.Module: Block_{b}", "model.py(30): forward", "nn.Module: Net_0",
                  "train.py(8): step")


def loop(steps: int = 2) -> Dict[str, Any]:
    """Two blocks, each with a weight of W bytes; per step a forward (each block: an activation A
    saved for the backward, a transient T, an output O saved too), a backward (block 1 then 0:
    the weight's gradient W, then the block's saved tensors freed), an Adam step (state 2 W per
    weight, made in the first step; a temporary U) and zero_grad(set_to_none=True)."""
    trace = [alloc(1, W, PARAM), alloc(2, W, PARAM)]
    addr = 100
    for step in range(steps):
        saved = {}
        for b in (0, 1):
            a, t, o = addr, addr + 1, addr + 2
            addr += 3
            trace += [alloc(a, A, in_block(b, 11)), alloc(t, T, in_block(b, 12)), free(t, T, in_block(b, 12)),
                      alloc(o, O, in_block(b, 13))]
            saved[b] = (a, o)
        grads = {}
        for b in (1, 0):
            grads[b] = addr
            addr += 1
            a, o = saved[b]
            trace += [alloc(grads[b], W, GRAD), free(a, A, BWD), free(o, O, BWD)]
        if step == 0:
            trace += [alloc(3, 2 * W, STATE), alloc(4, 2 * W, STATE)]
        trace += [alloc(addr, U, UPDATE), free(addr, U, UPDATE)]
        addr += 1
        trace += [free(grads[b], W, ZERO) for b in (0, 1)]
    return {"segments": [], "device_traces": [trace]}


# Worked out by hand from loop() (params 2 W and state 4 W live from step 1 on: 6 W = 6000).
BY_HAND = {
    # no change: step 1's backward, just after block 1's gradient: 6000 + A+O+A+O + W
    None: (13200, "backward"),
    # no state, no update temporary: 2000 + 6200 + 1000
    "optimizer=sgd": (9200, "backward"),
    # state 3 W per weight: 2000 + 6000 + 6200 + 1000
    "optimizer=adamw-amsgrad": (15200, "backward"),
    # each block keeps its output; its activation comes back (with its transient) just before the
    # backward frees it: at block 0's, 6000 + O + W + W + A + T
    "checkpoint": (11600, "backward"),
    # block 1 only (every other one): at its recomputation, 6000 + A+O+O + A+T + W
    "checkpoint=0.5": (13700, "backward"),
    # everything halves
    "weights=bf16": (6600, "backward"),
    # the gradients of step 0 kept: step 1's forward holds them: 6000 + 2000 + A+O+A+T
    "zero-grad=zeros": (14600, "forward"),
    # half the activations; the earlier micro-batch's gradients held until each weight's is made:
    # at block 1's gradient, 6000 + 2 W (held) + W + (A+O+A+O)/2
    "accumulate=2": (12100, "backward"),
}


@pytest.fixture
def run(write_snapshot) -> str:
    return write_snapshot(loop(), "loop.pickle")


@pytest.mark.parametrize("change", [c for c in BY_HAND if c is not None])
def test_each_rule_gives_the_peak_worked_out_by_hand(run, change):
    result = memdiff.whatif(run, change)
    d = result.devices[0]
    assert (d.base_peak_bytes, d.base_peak_phase) == BY_HAND[None]
    c = d.changes[0]
    assert c.applies, c.reason
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == BY_HAND[change]
    assert c.delta_bytes == BY_HAND[change][0] - BY_HAND[None][0]
    assert c.assumptions
    assert d.blocks == ["Block_0", "Block_1"]
    if change.startswith("optimizer="):  # Adam's stacks, which AdamW's are too: the run's is not named as one
        assert any("(the run's Adam or AdamW keeps 2)" in a for a in c.assumptions), c.assumptions


# A CNN's two conv -> relu -> max_pool2d layers at batch 32 (3x32x32 images, 32 then 64
# channels), with the profiler's frames and PyTorch's sizes in fp32 (measured with the profiler's
# record_shapes: max_pool2d_with_indices makes its values in the input's dtype and int64 indices
# twice their bytes; max_pool2d_with_indices_backward makes the input's gradient, in its dtype).
MiB = 2**20
STEP = ["train.py(390): one_step", "train.py(481): train"]
FWD = ["train.py(136): <lambda>", "train.py(134): forward", "nn.Module: CNN_0", *STEP]
ENGINE = ["<built-in method run_backward of torch._C._EngineBase object at 0x7f97>",
          "torch/autograd/graph.py(966): _engine_run_backward", "torch/autograd/__init__.py(255): backward",
          "torch/_tensor.py(566): backward", *STEP]
RELU = frames("<built-in method relu of type object at 0x7f97>", "torch/nn/functional.py(1760): relu", *FWD)
POOL = frames("<built-in method max_pool2d of type object at 0x7f97>", "torch/nn/functional.py(814): _max_pool2d",
              "torch/_jit_internal.py(627): fn", *FWD)
POOL_BWD = frames("aten::max_pool2d_with_indices_backward",
                  "autograd::engine::evaluate_function: MaxPool2DWithIndicesBackward0", *ENGINE)
RELU_BWD = frames("aten::threshold_backward", "autograd::engine::evaluate_function: ReluBackward0", *ENGINE)


def pooled_cnn() -> Dict[str, Any]:
    """The forward keeps each layer's relu output, pooled values and indices; the backward makes
    each pool's input gradient (2 MiB, then 4 MiB: the first layer's maps are twice as many
    bytes) and each relu's, freeing what it read."""
    return {"segments": [], "device_traces": [[
        alloc(1, 4 * MiB, RELU), alloc(2, 1 * MiB, POOL), alloc(3, 2 * MiB, POOL),  # 32x32x32x32
        alloc(4, 2 * MiB, RELU), alloc(5, MiB // 2, POOL), alloc(6, 1 * MiB, POOL),  # 32x64x16x16
        free(5, MiB // 2), alloc(7, 2 * MiB, POOL_BWD), free(6, 1 * MiB), alloc(8, 2 * MiB, RELU_BWD),
        free(7, 2 * MiB), free(4, 2 * MiB), free(8, 2 * MiB), free(2, 1 * MiB),
        alloc(9, 4 * MiB, POOL_BWD), free(3, 2 * MiB), alloc(10, 4 * MiB, RELU_BWD),
        free(9, 4 * MiB), free(1, 4 * MiB), free(10, 4 * MiB)]]}


def test_half_precision_keeps_max_pool_indices_and_halves_its_backward(write_snapshot):
    # In bf16 every float tensor halves and the indices stay int64: the peak is at the second
    # layer's relu gradient, relu 2 + values 0.5 + indices 2 + relu 1 + pool gradient 1 + relu
    # gradient 1 = 7.5 MiB. Kept whole, the first pool's 4 MiB gradient (twice the one before it
    # on the same stack, as indices are) would put 8 MiB at the first layer's backward instead.
    path = write_snapshot(pooled_cnn(), "cnn.pickle")
    d = memdiff.whatif(path, "weights=bf16").devices[0]
    assert d.base_peak_bytes == 13 * MiB
    c = d.changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == (15 * MiB // 2, "backward")


CONV = frames("<built-in method conv2d of type object at 0x7f97>", "torch/nn/modules/conv.py(546): _conv_forward",
              "torch/nn/modules/conv.py(564): forward", "nn.Module: Conv2d_0", *FWD)
CONV_BWD = frames("aten::empty", "aten::convolution_backward",
                  "autograd::engine::evaluate_function: ConvolutionBackward0", *ENGINE)


def conv_step() -> Dict[str, Any]:
    """One fp32 step of the CNN's first layer at batch 32 as the profiler records it: the batch
    (3x32x32 images, 393,216 bytes) and its labels made by the loop, conv2d's output and relu's
    (32 channels: 4 MiB each), then the backward: relu's gradient, the conv's bias and weight
    gradients (128 and 3,456 bytes)."""
    batch = frames("<built-in method randn of type object at 0x7f97>", "train.py(251): batch", *STEP)
    labels = frames("<built-in method randint of type object at 0x7f97>", "train.py(251): batch", *STEP)
    return {"segments": [], "device_traces": [[
        alloc(1, 3456, PARAM), alloc(2, 128, PARAM), alloc(10, 393216, batch), alloc(11, 256, labels),
        alloc(12, 4 * MiB, CONV), alloc(13, 4 * MiB, RELU), free(12, 4 * MiB, RELU),
        alloc(14, 4 * MiB, RELU_BWD), free(13, 4 * MiB, RELU_BWD),
        alloc(15, 128, CONV_BWD), alloc(16, 3456, CONV_BWD), free(14, 4 * MiB, CONV_BWD),
        free(10, 393216, frames(*STEP)), free(11, 256, frames(*STEP))]]}


def test_autocast_keeps_the_bf16_copy_of_the_batch_the_first_convolution_saves(write_snapshot):
    """The CNN under CPU autocast read 4.6% under the loop really run (issue 60): conv2d is on
    autocast's lower-precision list, so it casts the fp32 batch to bf16 and saves that copy for its
    weight's gradient (192 KiB at batch 32; the batch itself stays fp32, held by the loop). By hand,
    at relu's output in the forward and at its gradient in the backward: conv2d's and relu's bf16
    outputs, or relu's and its gradient, 2 MiB each; the batch's copy 196,608; the batch and labels
    393,472; the weights 3,584 and their casts 1,792: 4,789,760 in both phases (without the copy
    4,593,152)."""
    run = write_snapshot(conv_step(), "conv.pickle")
    predicted = memdiff.whatif(run, "autocast=bf16").devices[0].changes[0]
    assert predicted.phase_peaks == {"forward": 4789760, "backward": 4789760}
    assert predicted.categories["activation"] == 4 * MiB + 196608
    assert any("the float batch's bf16 copy" in a for a in predicted.assumptions), predicted.assumptions


def test_half_precision_weights_take_the_batch_their_first_convolution_reads_in_their_dtype(write_snapshot):
    """The MLP with bf16 weights read 2.0% over the loop really run (issue 60): a product of bf16
    weights refuses an fp32 input, so the script makes its float batch in bf16, where the rule kept it
    at its fp32 size. By hand, at relu's output in the forward and at its gradient in the backward:
    two bf16 activations of 2 MiB each; the batch in bf16, 196,608; the labels, int64, 256 (kept);
    the weights in bf16, 1,792: 4,392,960 in both phases (4,589,568 with the batch in fp32)."""
    run = write_snapshot(conv_step(), "conv.pickle")
    predicted = memdiff.whatif(run, "weights=bf16").devices[0].changes[0]
    assert predicted.phase_peaks == {"forward": 4392960, "backward": 4392960}
    assert predicted.categories["input"] == 196608 + 256
    assert any("the float batch the first product or convolution reads (1 made) in 2 bytes" in a
               for a in predicted.assumptions), predicted.assumptions


def test_a_product_of_bf16_weights_refuses_an_fp32_input(torch):
    """The fact the rule above rests on, from PyTorch itself: a model in bf16 takes no fp32 batch, so
    a script with half-precision weights makes its batch in their dtype."""
    for layer, x in ((torch.nn.Conv2d(3, 32, 3, padding=1), torch.randn(2, 3, 32, 32)),
                     (torch.nn.Linear(256, 64), torch.randn(4, 256))):
        layer.to(torch.bfloat16)
        with pytest.raises(RuntimeError):
            layer(x)
        assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_cpu_autocast_s_first_layers_save_a_bf16_copy_of_their_fp32_input(torch):
    """The fact conv_step's prediction rests on, from PyTorch itself: under CPU autocast, conv2d
    and linear save for the backward a bf16 copy of their fp32 input, half its bytes, and not the
    input itself."""
    def saved_by(layer: Any, x: Any) -> List[Any]:
        saved: List[Any] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
        return saved

    for layer, x in ((torch.nn.Conv2d(3, 32, 3, padding=1), torch.randn(32, 3, 32, 32)),
                     (torch.nn.Linear(256, 64), torch.randn(256, 256))):
        copy = [t for t in saved_by(layer, x) if t.shape == x.shape]
        assert [t.dtype for t in copy] == [torch.bfloat16], layer
        assert copy[0].untyped_storage().nbytes() == x.untyped_storage().nbytes() // 2
        assert copy[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_kept_gradients_keep_one_version_of_a_weight_used_twice(write_snapshot):
    """Issue 60, BART with zero_grad(set_to_none=False) (read +2.3% on the suite's CPU pair, now
    exact): a weight used twice (BART's embedding, tied to its output projection) gets its
    gradient as a first sum the backward replaces by the next one. Only the version the step
    leaves is kept from the first step on; the replaced one lives as it did. loop() with block 0's
    weight used twice: by hand as BY_HAND's zero-grad=zeros, 14600 in the forward (15600 with the
    replaced sum kept too)."""
    run = loop()
    trace = run["device_traces"][0]
    firsts = [k for k, e in enumerate(trace) if e["action"] == "alloc" and e["frames"] == GRAD]
    for n, k in enumerate(sorted(firsts[1::2], reverse=True)):  # block 0's gradient, in each step
        addr = 900 + n
        trace[k:k + 1] = [alloc(addr, W, GRAD), trace[k], free(addr, W, BWD)]
    c = memdiff.whatif(write_snapshot(run, "tied.pickle"), "zero-grad=zeros").devices[0].changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == BY_HAND["zero-grad=zeros"]


@pytest.mark.parametrize("other", ["optimizer=sgd", "optimizer=adamw-amsgrad", "checkpoint", "checkpoint=0.5",
                                   "zero-grad=zeros", "accumulate=2"])
def test_changes_joined_by_plus_apply_together(run, other):
    # Every size of the loop is even and every rule keeps proportions: in 2 bytes, each peak halves.
    c = memdiff.whatif(run, f"{other}+weights=bf16").devices[0].changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == (BY_HAND[other][0] // 2, BY_HAND[other][1])


def test_without_change_every_applicable_one_sorted_by_saving(run, capsys):
    result = memdiff.whatif(run, budget=10_000)
    applied = [c for c in result.devices[0].changes if c.applies]
    assert [c.delta_bytes for c in applied] == sorted(c.delta_bytes for c in applied)
    assert {"checkpoint", "weights=bf16", "optimizer=sgd", "accumulate=2"} <= {c.change for c in applied}
    assert all(c.fits_budget == (c.predicted_peak_bytes <= 10_000) for c in applied)
    skipped = [c for c in result.devices[0].changes if not c.applies]
    assert [c.change for c in skipped] == ["zero-grad=none"]  # the run already frees its gradients
    assert main(["whatif", run, "--budget", "10000B"]) == 0
    out = capsys.readouterr().out
    assert "zero-grad=none: does not apply: the run already frees its gradients" in out


def test_every_format_shows_every_finding_of_the_document(run, capsys, tmp_path):
    # W006 (what a what-if is) is the run's; W014 (zero-grad=none does not apply) the device's. The text said
    # both; the markdown and the page left the run's out.
    page = tmp_path / "w.html"
    assert main(["whatif", run, "--format", "json", "--html", str(page)]) == 0
    doc = json.loads(capsys.readouterr().out)
    codes = [f["code"] for f in doc["findings"]] + [f["code"] for d in doc["devices"] for f in d["findings"]]
    assert codes == ["W006", "W014"]
    assert main(["whatif", run, "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert main(["whatif", run]) == 0
    text = capsys.readouterr().out
    for out, shown in ((text, r"^(?:note|warning): (W\d{3}) "), (markdown, r"^> `(W\d{3})`"),
                       (page.read_text(), r"<p class=note>(W\d{3}) ")):
        assert re.findall(shown, out, re.M) == codes
    # Each its own line (a hard break), as the diff's alerts: markdown ran the two into one paragraph.
    assert all(line.endswith("  ") for line in markdown.splitlines() if line.startswith("> `W"))


def test_the_budget_holds_what_the_caching_allocator_reserves(capsys):
    """An H100 run of GPT-2 peaks at 4.76 GiB allocated, and PyTorch's own segments hold 5.05 GiB: under a
    5 GiB budget the run as it is does not fit, where `fits` said yes of any change that kept its peak (the
    budget was compared with allocated bytes). It is compared with the peak times the run's reserved over
    allocated now, as the forecast does, and every output says so."""
    import gzip
    import pickle

    run = str(Path(__file__).resolve().parent / "data" / "cuda" / "gpt2-base.pickle.gz")
    with gzip.open(run) as f:
        reserved = sum(s["total_size"] for s in pickle.load(f)["segments"])  # PyTorch's, at the dump
    budget = 5 * 2**30
    result = memdiff.whatif(run, ["step=fused", "checkpoint"], budget="5GiB")
    same, checkpoint = result.devices[0].changes
    assert same.predicted_peak_bytes == result.devices[0].base_peak_bytes < budget < reserved
    assert same.fits_budget is False and checkpoint.fits_budget is True
    assert result.overhead_ratio is not None and result.overhead_ratio * same.predicted_peak_bytes > budget
    said = "budget 5.00 GiB: the budget is compared with each predicted peak times "
    for fmt in ("text", "markdown"):
        assert main(["whatif", run, "--change", "step=fused", "--budget", "5GiB", "--format", fmt]) == 0
        assert said in capsys.readouterr().out


def test_a_run_out_of_memory_gives_lower_bounds_and_says_so(capsys):
    """A002 tells the user of a run that ran out of memory to ask `memdiff whatif`; its trace ends at the error
    (GPT-2 at batch 512 on an H100, in the first forward), so checkpointing read 8.75 GiB and fit a 10 GiB
    budget, of a step whose backward and optimizer step never ran."""
    import gzip
    import pickle

    run = str(Path(__file__).resolve().parent / "data" / "cuda" / "gpt2-oom.pickle.gz")
    with gzip.open(run) as f:
        trace = pickle.load(f)["device_traces"][0]
    oom = next(i for i, e in enumerate(trace) if e["action"] == "oom")  # PyTorch's own record of the error
    result = memdiff.whatif(run, ["checkpoint", "weights=bf16"], budget="10GiB")
    (d,) = result.devices
    checkpoint, bf16 = d.changes
    assert checkpoint.predicted_peak_bytes < 10 * 2**30 < bf16.predicted_peak_bytes
    assert checkpoint.fits_budget is None and bf16.fits_budget is False  # a lower bound only fails a budget
    (w017,) = [f for f in d.findings if f.code == "W017"]
    assert w017.severity == "warning" and w017.data["event"] == oom
    assert main(["whatif", run, "--change", "checkpoint", "--budget", "10GiB"]) == 0
    out = capsys.readouterr().out
    assert f"warning: W017 device 0: the run ran out of memory at event {oom}" in out and "not known (W017)" in out
    # The table's cells are the what-if's, so the JSON carries the words the text shows (it had only the booleans).
    changes = result.to_dict()["devices"][0]["changes"]
    assert [c["fits_text"] for c in changes] == ["not known (W017)", "no"]
    assert [c["delta_pct_text"] for c in changes] == [f"{c['delta_pct']:+.1f}%" for c in changes]
    row = next(line for line in out.splitlines() if line.startswith("checkpoint "))
    assert row.rstrip().endswith("not known (W017)")
    assert checkpoint.delta_pct_text in row.split()


def test_the_optimizer_phase_reads_as_the_optimizer_step_as_in_every_other_output():
    """GPT-2 with retain_graph=True peaks in the optimizer step (docs/diff.md, `memdiff peak`): the headline said
    `peak 4.92 GiB in the optimizer of step 0`, and the forecast `peaks in the optimizer`."""
    run = str(Path(__file__).resolve().parent / "data" / "cuda" / "gpt2-retain-graph.pickle.gz")
    (d,) = memdiff.whatif(run, ["optimizer=sgd"]).devices
    assert d.base_peak_phase == "optimizer" and "peak 4.92 GiB in the optimizer step of step 0;" in d.headline


def test_every_format_says_the_run_and_the_budget_alike(run, capsys, tmp_path):
    # The markdown said `budget: 9.77 KiB` where the text said `budget 9.77 KiB`, and the page left the budget
    # out; the what-if holds the sentences and every format shows them.
    page = tmp_path / "w.html"
    assert main(["whatif", run, "--budget", "10000B", "--html", str(page)]) == 0
    text = capsys.readouterr().out
    heading, budget = text.splitlines()[:2]
    assert heading == "memdiff whatif loop.pickle" and budget.startswith("budget 9.77 KiB: ")
    assert "<h1>memdiff whatif loop.pickle</h1>" in page.read_text()
    assert f"<p>{html.escape(budget)}</p>" in page.read_text()
    assert main(["whatif", run, "--budget", "10000B", "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert f"\n{budget}\n" in md
    # the markdown wrote `run: ` and the file in its own markup; it heads with the what-if's heading, as the others
    assert md.startswith(f"### {heading}\n\n{budget}\n")


def test_a_change_that_cannot_apply_is_one_line_not_a_guess(write_snapshot, capsys):
    bare = {"segments": [], "device_traces": [[alloc(1, 100, frames("model.py(1): forward")),
                                               free(1, 100, frames("model.py(1): forward"))]]}
    path = write_snapshot(bare, "bare.pickle")
    assert main(["whatif", path, "--change", "checkpoint", "--change", "optimizer=sgd"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "does not apply" in line]
    assert len(lines) == 2 and lines[0].startswith("note: W014 device 0: checkpoint: does not apply: no repeated blocks")
    assert "no change asked applies" in out


@pytest.mark.parametrize("change, says", [
    ("chekpoint", "unknown change 'chekpoint' (did you mean checkpoint?)"),
    ("optimiser=sgd", "(did you mean optimizer?)"),
    ("optimizer=adamx", "optimizer=adamx: unknown value (did you mean adam?)"),
    ("weights=fp8", "weights=fp8: unknown value"),
    ("checkpoint=2", "give a fraction of the blocks in (0, 1]"),
    ("checkpoint=half", "give a fraction of the blocks in (0, 1]"),
    ("checkpoint=٠.٥", "give a fraction of the blocks in (0, 1]"),  # float() reads it as 0.5
    ("accumulate=1", "a whole number from 2"),
    ("zero-grad", "zero-grad needs a value"),
    ("checkpoint+checkpoint=0.5", "checkpoint is given twice"),
])
def test_bad_changes_are_one_line_exit_2(run, capsys, change, says):
    assert main(["whatif", run, "--change", change]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    with pytest.raises(InputError):
        parse_change(change)



@pytest.mark.parametrize("change, says", [
    ("optimizer=sgd+step=fused", "the optimizer change keeps the run's update form; give step= alone"),
    ("autocast=bf16+weights=bf16", "autocast and half-precision weights together"),
])
def test_changes_the_replay_never_combines_are_refused_exit_2(run, capsys, change, says):
    # They read `no change asked applies to this run` and exit 0, as if the run could not show them.
    assert main(["whatif", run, "--change", change]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memdiff: --change: {change}: {says}") and err.count("\n") == 1, err

def test_bad_runs_are_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    assert main(["whatif", str(tmp_path / "junk.pickle")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_api_is_the_cli_json_and_matches_its_schema(run, capsys, tmp_path):
    result = memdiff.whatif(run, ["checkpoint", "optimizer=sgd+weights=bf16"], budget="12KiB")
    assert main(["whatif", run, "--change", "checkpoint", "--change", "optimizer=sgd+weights=bf16",
                 "--budget", "12KiB", "--format", "json", "--html", str(tmp_path / "w.html")]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads(json.dumps(result.to_dict()))
    validate("whatif", document, "whatif")
    validate("whatif", memdiff.whatif(run).to_dict(), "whatif")
    assert "<table>" in (tmp_path / "w.html").read_text()
    assert main(["whatif", run, "--format", "markdown"]) == 0
    assert "| change" in capsys.readouterr().out


# ---------------------------------------------------------------- captured pairs

@pytest.fixture(scope="module")
def rows(scenarios) -> Dict[Any, Dict[str, Any]]:
    names = sorted({n for base, _, head in WHATIF_PAIRS for n in (base, head)})
    return {(r["base"], r["change"]): r for r in whatif_rows(scenarios(*names))}


# Issue 60's target: every one-run what-if within 2% of the change really made. The pairs still
# over it, each held to what it measures now (rounded up), with what it misses: none left (the
# CNN in half precision was, until the capture said how its host runs bf16 convolutions).
OPEN: Dict[Tuple[str, str], float] = {}


@pytest.mark.slow
@pytest.mark.parametrize("base, change", [(base, change) for base, change, _ in WHATIF_PAIRS])
def test_predicted_within_2pct_of_the_change_really_made(rows, base, change):
    r = rows[(base, change)]
    assert r["predicted"] is not None, r["reason"]
    assert r["predicted_phase"] == r["measured_phase"]
    assert abs(r["error_pct"]) <= OPEN.get((base, change), 2.0), r


@pytest.mark.slow
def test_half_precision_rms_norms_keep_an_fp32_copy_in_their_input_s_place(rows):
    """Issue 42 item 4's upcasts, on Hugging Face Llama (CPU, the model really trained with bf16
    weights): LlamaRMSNorm computes the variance in fp32 (`hidden_states.to(torch.float32)`), and
    pow keeps that copy for the backward where the fp32 run kept the residual stream's tensor.
    Without the copy the prediction read 3.3% under the run really made; with it within 2%."""
    r = rows[("llama-base", "weights=bf16")]
    assert r["predicted_phase"] == r["measured_phase"]
    assert abs(r["error_pct"]) <= 2.0, r


@pytest.mark.slow
def test_t5_with_half_precision_weights_each_phase_within_2pct(scenarios):
    """Issue 42 item 4, on T5 really trained with bf16 weights (CPU): its forward and backward
    peaks are 1% apart, so each phase is checked against the real run's. The forward needs the
    fp32 copies half-precision runs make that the fp32 run never shows: T5LayerNorm's variance
    (`hidden_states.to(torch.float32).pow(2)`, kept by pow) and the loss's `logits.float()`;
    without them the forward read 4.5% under and the backward 3.8% under."""
    paths = scenarios("t5-base", "t5-bf16")
    predicted = memdiff.whatif(str(paths["t5-base"]), "weights=bf16").devices[0].changes[0]
    measured = {p.phase: p.peak_bytes for p in memdiff.summarize(str(paths["t5-bf16"])).devices[0].phase_peaks}
    for phase in ("forward", "backward"):
        assert abs(predicted.phase_peaks[phase] - measured[phase]) <= 0.02 * measured[phase], \
            (phase, predicted.phase_peaks, measured)


@pytest.mark.slow
@pytest.mark.parametrize("base, within", [("vit-base", 2.0), ("llama-base", 3.0)])
def test_autocast_on_the_cpu_keeps_the_residual_stream_and_each_projection_s_copy(rows, base, within):
    """Issue 42 item 3, on the profiler route (no ATen op names), against the model really trained
    under CPU autocast: the residual adds stay fp32 and each of the query, key and value
    projections keeps its own bf16 copy of the norm's fp32 output. Halving them read ViT 6.0% and
    Llama 5.1% under the runs really made."""
    r = rows[(base, "autocast=bf16")]
    assert r["predicted_phase"] == r["measured_phase"]
    assert abs(r["error_pct"]) <= within, r


@pytest.mark.slow
@pytest.mark.parametrize("script, change", [("train_adamw_to_rmsprop.py", "optimizer=rmsprop"),
                                            ("finetune_adafactor.py", "optimizer=adafactor")])
def test_the_optimizer_is_named_by_torch_never_by_the_user_s_script(scenarios, write_snapshot, script, change):
    """Issue 42 item 1, on the profiler route (the file in each frame's name): gpt2-base, an AdamW
    run, as if its script were named after another optimizer, reads as AdamW, and the change to
    that optimizer predicts the loop really run with it as from the run's own name."""
    head = f"gpt2-base-wi-{change.replace('=', '-')}"
    paths = scenarios("gpt2-base", head)
    snapshot = __import__("pickle").loads(paths["gpt2-base"].read_bytes())
    for trace in snapshot["device_traces"]:
        for e in trace:
            for f in e.get("frames") or []:
                f["name"] = f["name"].replace("train.py(", f"{script}(")
    d = memdiff.whatif(write_snapshot(snapshot, "renamed.pickle"), change).devices[0]
    # No scopes on the profiler route: AdamW runs Adam's update code (torch/optim/adam.py), the
    # same memory, and reads as "Adam or AdamW".
    assert d.optimizer == "adam"
    predicted = d.changes[0]
    assert predicted.applies, predicted.reason
    measured = memdiff.summarize(paths[head]).devices[0].peak_bytes
    assert abs(predicted.predicted_peak_bytes - measured) <= 0.10 * measured, (predicted.predicted_peak_bytes, measured)


def test_names_from_the_run_and_the_change_bend_no_output(tmp_path):
    from test_inert import assert_markdown_inert, assert_no_command_from_data, assert_plain, run

    path = tmp_path / "x\n::stop-commands::tok\x1b[2J @octocat #123.pickle"
    path.write_bytes(__import__("pickle").dumps(loop(), 4))
    for fmt in ("text", "markdown", "json"):
        code, out, err = run("whatif", path, "--change", "checkpoint", "--format", fmt)
        assert code == 0, err
        assert_plain(out)
        assert_no_command_from_data(out)
        if fmt == "markdown":
            assert_markdown_inert(out, headings=1)
    code, out, err = run("whatif", path, "--change", "chekpoint\n::error::x\x1b[2J")
    assert code == 2
    assert_plain(err)
    assert_no_command_from_data(err)


def without_modules(snapshot: Dict[str, Any]) -> Dict[str, Any]:
    """The snapshot as the caching allocator records it on CUDA: Python frames, no module instances."""
    for e in snapshot["device_traces"][0]:
        e["frames"] = [f for f in e.get("frames", []) if not f["name"].startswith("nn.Module: ")]
    return snapshot


def test_a_recomputation_rises_to_the_block_s_forward_peak_not_its_saved_plus_its_temporaries(write_snapshot):
    """loop() with each block's transient made and freed before what it saves: the forward of a
    block never holds its transient T with its saved activation A, and its recomputation does not
    either. At block 0's, by hand: 6000 + the kept outputs' O + two gradients 2 W + A, and the
    output the recomputation makes again, O: 11200 (all it saves with T on top read 11600)."""
    run = loop()
    trace = run["device_traces"][0]
    blocks = [k for k, e in enumerate(trace) if e["action"] == "alloc" and e["size"] == A]
    for k in blocks:  # each block's (alloc a, alloc t, free t) becomes (alloc t, free t, alloc a)
        trace[k:k + 3] = [trace[k + 1], trace[k + 2], trace[k]]
    c = memdiff.whatif(write_snapshot(run, "transient-first.pickle"), "checkpoint").devices[0].changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == (11200, "backward")


def post_norm_loop() -> Dict[str, Any]:
    """Two post-norm encoder layers as torch.nn.TransformerEncoderLayer runs them (weights of 100
    bytes here): each reads its input through a contiguous copy C that its projection saves (300),
    so its input is freed as soon as the copy is made; a transient T (500); then its layer norm's
    output O (100, the next layer's input), mean and rstd S (10 each, saved). The head saves the last
    output (H, 50). Backward: the head's, then each layer's gradient (100) and what it saved freed;
    Adam's state (2 weights per weight) made in step 0; zero_grad(set_to_none=True)."""
    w, c_, t, o, s, h = 100, 300, 500, 100, 10, 50
    head = frames("model.py(40): forward", "nn.Module: Net_0", "train.py(8): step")
    trace = [alloc(1, w, PARAM), alloc(2, w, PARAM)]
    addr = 100
    for step in range(2):
        saved: Dict[int, List[int]] = {}
        out = None
        for b in (0, 1):
            copy, tmp, norm, mean, rstd = range(addr, addr + 5)
            addr += 5
            trace.append(alloc(copy, c_, in_block(b, 11)))
            if out is not None:
                trace.append(free(out, o, in_block(b, 11)))
            trace += [alloc(tmp, t, in_block(b, 12)), free(tmp, t, in_block(b, 12)),
                      alloc(norm, o, in_block(b, 14)), alloc(mean, s, in_block(b, 14)), alloc(rstd, s, in_block(b, 14))]
            saved[b] = [copy, mean, rstd]
            out = norm
        trace += [alloc(addr, h, head), free(addr, h, BWD), free(out, o, BWD)]
        grads = {b: addr + 1 + b for b in (0, 1)}
        addr += 3
        for b in (1, 0):
            trace.append(alloc(grads[b], w, GRAD))
            trace += [free(k, size, BWD) for k, size in zip(saved[b], (c_, s, s))]
        if step == 0:
            trace += [alloc(3, 2 * w, STATE), alloc(4, 2 * w, STATE)]
        trace += [alloc(addr, w, UPDATE), free(addr, w, UPDATE)]
        addr += 1
        trace += [free(grads[b], w, ZERO) for b in (0, 1)]
    return {"segments": [], "device_traces": [trace]}


def test_a_checkpointed_layer_keeps_its_input_until_its_backward(write_snapshot):
    """Issue 60, torch.nn.TransformerEncoder checkpointed every other layer (read 1% under the run
    really made on CPU): checkpoint() holds the layer's input for the recomputation until the
    layer's backward is done, though the run freed it in the forward (read through a copy), and
    the layer's output is its layer norm's output, not the rstd made last. Layer 1 checkpointed, at
    its recomputation in step 1, by hand: weights and state 600, layer 0's copy, mean and rstd 320,
    layer 1's input held 100, its gradient 100 and its forward again (copy and transient) 800: 1920
    (without the input held, 1820)."""
    d = memdiff.whatif(write_snapshot(post_norm_loop(), "post-norm.pickle"), "checkpoint=0.5").devices[0]
    assert d.blocks == ["Block_0", "Block_1"]
    c = d.changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == (1920, "backward")


@pytest.mark.parametrize("change", ["checkpoint", "checkpoint=0.5"])
def test_without_module_frames_the_blocks_are_the_calls_the_forward_repeats(write_snapshot, change):
    # Both blocks are called from model.py line 30 and make the same allocations: the same answer
    # as with the module frames, worked out by hand above.
    d = memdiff.whatif(write_snapshot(without_modules(loop()), "cuda-like.pickle"), change).devices[0]
    assert d.blocks == ["call 1 at model.py:30", "call 2 at model.py:30"]
    c = d.changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == BY_HAND[change]


def test_calls_that_make_different_allocations_are_no_repeated_block(write_snapshot):
    # Block 1 makes no transient: its call is not the same sequence again, so no block is guessed.
    run = loop()
    names = [[f["name"] for f in e["frames"]] for e in run["device_traces"][0]]
    run["device_traces"][0] = [e for e, n in zip(run["device_traces"][0], names)
                               if not ("nn.Module: Block_1" in n and "model.py(12): forward" in n)]
    c = memdiff.whatif(write_snapshot(without_modules(run), "uneven.pickle"), "checkpoint").devices[0].changes[0]
    assert not c.applies and c.reason.startswith("no repeated blocks on the stacks")


def encoder_decoder(alike: bool = False) -> Dict[str, Any]:
    """Two stacks (an encoder, a decoder) of two layers each, as T5 is built: each layer saves an
    activation for the backward (the decoder's in a cross-attention module), each stack adds a
    small one of its own (its final norm). With `alike`, the decoder has no cross-attention."""
    trace = [alloc(1, W, PARAM)]
    addr = 100
    for _ in range(2):
        saved = []
        for s in (0, 1):
            for k in (2 * s, 2 * s + 1):
                # The decoder's layers attend to the encoder's output: a module the encoder's have not.
                inner = ("model.py(5): forward", f"nn.Module: Cross_{k}") if s and not alike else ()
                stack = frames(*inner, "model.py(11): forward", f"nn.Module: Layer_{k}", "model.py(20): forward",
                               f"nn.Module: Stack_{s}", "model.py(30): forward", "nn.Module: Net_0", "train.py(8): step")
                trace.append(alloc(addr, A, stack))
                saved.append((addr, A))
                addr += 1
            norm = frames("model.py(21): forward", f"nn.Module: Stack_{s}", "model.py(30): forward", "nn.Module: Net_0",
                          "train.py(8): step")
            trace.append(alloc(addr, O, norm))
            saved.append((addr, O))
            addr += 1
        trace += [alloc(addr, W, GRAD)] + [free(a, size, BWD) for a, size in saved[::-1]] + [free(addr, W, ZERO)]
        addr += 1
    return {"segments": [], "device_traces": [trace]}


def test_an_encoder_decoder_s_blocks_are_its_layers_inside_its_two_stacks(write_snapshot):
    """Issue 42 item 4: the two stacks repeat, and so do the layers inside them; checkpointing wraps
    the layers (Hugging Face's T5Block), so the blocks are the four layers, not the two stacks."""
    d = memdiff.whatif(write_snapshot(encoder_decoder(), "t5-like.pickle"), "checkpoint").devices[0]
    assert d.blocks == ["Layer_0", "Layer_1", "Layer_2", "Layer_3"]
    # Stacks alike inside (a Mixtral layer's experts inside its layers) stay the blocks.
    d = memdiff.whatif(write_snapshot(encoder_decoder(alike=True), "alike.pickle"), "checkpoint").devices[0]
    assert d.blocks == ["Stack_0", "Stack_1"]


def t5_like(layers: int = 3) -> Dict[str, Any]:
    """Two steps of an encoder-decoder built as Hugging Face's T5: each stack loops over its layers
    on one line (model.py 20), reached from the encoder's line (30) and the decoder's (31); the
    first layer of each stack also makes the relative position bias the later ones reuse; each
    layer saves two activations (the decoder's a third, its cross-attention's); each stack's final
    norm saves one more; an Adam step follows each backward. Module frames as the profiler records them: `without_modules` makes the
    caching allocator's stacks."""
    trace = [alloc(1, W, PARAM)]
    addr = 100
    for step in range(2):
        saved = []
        for s in (0, 1):
            stack = (f"nn.Module: Stack_{s}", f"model.py({30 + s}): forward", "nn.Module: Net_0", "train.py(8): step")
            for k in range(layers):
                layer = ("model.py(20): forward", *stack)
                made = [(A, frames("model.py(11): forward", f"nn.Module: Layer_{s * layers + k}", *layer)),
                        (A, frames("model.py(12): forward", f"nn.Module: Layer_{s * layers + k}", *layer))]
                if k == 0:
                    made.insert(0, (O, frames("model.py(15): compute_bias", "model.py(10): forward",
                                              f"nn.Module: Layer_{s * layers}", *layer)))
                if s:
                    made.append((A, frames("model.py(5): forward", f"nn.Module: Cross_{k}", "model.py(13): forward",
                                           f"nn.Module: Layer_{s * layers + k}", *layer)))
                for size, stack_frames in made:
                    trace.append(alloc(addr, size, stack_frames))
                    saved.append((addr, size))
                    addr += 1
            trace.append(alloc(addr, O, frames("model.py(21): forward", *stack)))
            saved.append((addr, O))
            addr += 1
        grad = addr
        trace += [alloc(grad, W, GRAD)] + [free(a, size, BWD) for a, size in saved[::-1]]
        if step == 0:
            trace.append(alloc(2, 2 * W, STATE))
        trace += [alloc(grad + 1, U, UPDATE), free(grad + 1, U, UPDATE), free(grad, W, ZERO)]
        addr += 2
    return {"segments": [], "device_traces": [trace]}


@pytest.mark.parametrize("change", ["checkpoint", "checkpoint=0.5"])
def test_on_cuda_stacks_an_encoder_decoder_s_blocks_are_both_stacks_layers(write_snapshot, change):
    """Issue 60, T5 on an H200 (+77% with `checkpoint`): on the caching allocator's stacks T5's layers
    are one call, the loop in its stack's forward, reached from the encoder and from the decoder, and
    each stack's first layer makes more than the others (the relative position bias). The blocks
    are every layer of both stacks, in the order the forward runs them, and the answer is the one
    the module frames give."""
    with_modules = memdiff.whatif(write_snapshot(t5_like(), "t5-like.pickle"), change).devices[0]
    d = memdiff.whatif(write_snapshot(without_modules(t5_like()), "t5-cuda-like.pickle"), change).devices[0]
    assert with_modules.blocks == [f"Layer_{k}" for k in range(6)]
    assert d.blocks == [f"call {k} at model.py:20" for k in range(1, 7)]
    got, want = d.changes[0], with_modules.changes[0]
    assert got.applies and (got.predicted_peak_bytes, got.predicted_peak_phase) == (want.predicted_peak_bytes,
                                                                                     want.predicted_peak_phase)
    assert got.predicted_peak_bytes < d.base_peak_bytes


# The repeated blocks of each real H100 window of ../shared/cuda-truth, from the models families.py
# builds: T5's 6 encoder and 6 decoder layers; ResNet-50's 3 + 4 + 6 + 3 bottlenecks, each stage's
# first with its downsample and without the others' copy of its input.
LAYERS = {"t5-base": (12, "modeling_layers.py:109"), "resnet50-sgdm": (16, "container.py:253"),
          "vit-base": (12, "modeling_layers.py:109"), "llama-base": (8, "modeling_layers.py:109"),
          "bert-base": (6, "modeling_layers.py:109"), "llama1b-bf16": (16, "modeling_layers.py:109")}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_real_cuda_run_s_blocks_are_its_model_s_layers(shared, name):
    """Issue 60, T5 on an H200 (+77% with `checkpoint`): on the real windows the blocks are every
    layer of the model. Six were found on T5 before (a call of attention in the encoder's layers,
    which left the decoder out of checkpointing), and three on ResNet-50 (a call in libtorch)."""
    count, where = LAYERS[name]
    d = memdiff.whatif(str(shared.parent / "cuda-truth" / f"{name}.pickle.gz"), "checkpoint").devices[0]
    assert d.blocks == [f"call {k} at {where}" for k in range(1, count + 1)]


# Issue 60's held-back real H200 run of families.py's T5-base with bf16 weights (`m.to(torch.bfloat16)`):
# its peak, as PyTorch's snapshot gives it.
T5_BF16_REAL_PEAK = 1918 * 2**20


def test_t5_with_bf16_weights_keeps_its_math_attention_in_fp32(shared):
    """Issue 60, T5-base on an H200 with bf16 weights (1,608 MiB predicted, -16%): T5's position bias
    (a mask that requires grad, last stride 8) leaves SDPA only its math backend in bf16 as in fp32
    (the emulator's selection, PyTorch's checks), and the math backend computes bf16 in fp32. Each
    step runs 12 such calls (the 6 encoder and 6 decoder self-attentions; the 6 cross-attentions,
    with a bias of zeros, take the memory-efficient kernel) and 32 T5 RMS norms (2 a layer of the
    encoder, 3 of the decoder, and each stack's last), which compute their variance in fp32; the
    model's own CrossEntropyLoss runs in the logits' bf16. That read 1,854.2 MiB (-3.3%): each norm
    multiplies its bf16 input itself, which its product keeps, where Llama's multiplies its fp32
    copy, and the fp32 run shows the two alike; read from the norm's source (transformers' file on
    this machine), the 31 inputs it keeps at the peak (29 of the residual stream's adds, 53 MiB; the
    two stacks' embeddings after dropout, 4 MiB) make it 1,911.2 MiB (-0.4%)."""
    pytest.importorskip("transformers")  # the norm's source, which tells T5's idiom from Llama's
    d = memdiff.whatif(str(shared.parent / "cuda-truth" / "t5-base.pickle.gz"), "weights=bf16").devices[0]
    got = d.changes[0]
    said = got.assumptions[0]
    assert "36 scaled_dot_product_attention calls run PyTorch's math backend" in said, said
    assert "each of the 96 RMS norms" in said and "the loss too" in said, said
    assert "beside the input, which the product after it multiplies and keeps" in said, said
    assert abs(got.predicted_peak_bytes - T5_BF16_REAL_PEAK) <= 0.01 * T5_BF16_REAL_PEAK, got.predicted_peak_bytes


# The RMS norms of Hugging Face T5 (T5LayerNorm) and Llama (LlamaRMSNorm), line for line, as their
# files hold them: T5's variance upcasts inline and its product multiplies the input itself.
RMS_NORMS = {
    "t5": ("    def forward(self, hidden_states):\n"
           "        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)\n"
           "        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)\n"
           "        if self.weight.dtype in [torch.float16, torch.bfloat16]:\n"
           "            hidden_states = hidden_states.to(self.weight.dtype)\n"
           "        return self.weight * hidden_states\n"),
    "llama": ("    def forward(self, hidden_states):\n"
              "        input_dtype = hidden_states.dtype\n"
              "        hidden_states = hidden_states.to(torch.float32)\n"
              "        variance = hidden_states.pow(2).mean(-1, keepdim=True)\n"
              "        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)\n"
              "        return self.weight * hidden_states.to(input_dtype)\n"),
}


def rms_norm_loop(norm: str) -> Dict[str, Any]:
    """One fp32 step of an embedding and two layers, each an RMS norm (`norms/NORM.py`, installed
    in site-packages, read by a real GPU's snapshot: RMS_NORMS), a product and the residual add, as
    CUDA records them; then the backward makes the weight's gradient while all the forward saved is
    live. Each norm: pow (400) and mean (16) on the variance's line, pow freed; the add (16) and
    rsqrt (16, saved) and the product (400, saved) on the next, the add freed; the weight's
    product (400, the output, saved) on the last; the layer's product (400) freed by the residual
    add (400). The residual stream's tensors (the embedding's, the first add's) are saved by each
    norm's pow and product."""
    lines = RMS_NORMS[norm].splitlines()
    var, prod, out = (next(n for n, text in enumerate(lines, 1) if key in text)
                      for key in (".pow(2)", "torch.rsqrt", "return"))
    site = f"{LIBTORCH.split('torch/lib')[0]}norms/{norm}.py"

    def at(op: str, where: str) -> List[Dict[str, Any]]:
        return cuda_stack(op, where, "model.py:4:forward", "train.py:8:step", library=LIBTORCH)

    def norm_line(op: str, line: int) -> List[Dict[str, Any]]:
        return at(op, f"{site}:{line}:forward")
    trace = [alloc(1, W, PARAM), alloc(10, 400, at("embedding", "model.py:3:forward"))]
    for layer, x in ((0, 10), (1, 20)):
        a = 11 + 10 * layer
        trace += [alloc(a, 400, norm_line("pow_Tensor_Scalar", var)), alloc(a + 1, 16, norm_line("mean_dim", var)),
                  free(a, 400, norm_line("mean_dim", var)),
                  alloc(a + 2, 16, norm_line("add_Tensor", prod)), free(a + 1, 16, norm_line("add_Tensor", prod)),
                  alloc(a + 3, 16, norm_line("rsqrt", prod)), free(a + 2, 16, norm_line("rsqrt", prod)),
                  alloc(a + 4, 400, norm_line("mul_Tensor", prod)), alloc(a + 5, 400, norm_line("mul_Tensor", out)),
                  alloc(a + 6, 400, at("addmm", "model.py:5:forward")),
                  alloc(x + 10, 400, at("add_Tensor", "model.py:6:forward")),
                  free(a + 6, 400, at("add_Tensor", "model.py:6:forward"))]
    grad = [{"filename": LIBTORCH, "line": 0, "name": "torch::autograd::AccumulateGrad::apply"},
            {"filename": "torch/autograd/__init__.py", "line": 1, "name": "backward"},
            {"filename": "train.py", "line": 9, "name": "step"}]
    trace.append(alloc(2, W, grad))
    trace += [free(a, size, grad) for a, size in ((30, 400), (26, 400), (25, 400), (24, 16), (20, 400), (16, 400),
                                                  (15, 400), (14, 16), (10, 400))]
    return {"segments": [], "device_traces": [trace]}


@pytest.mark.parametrize("norm, peak", [("t5", 3216), ("llama", 3016)])
def test_an_rms_norm_that_upcasts_inline_keeps_its_half_precision_input(write_snapshot, tmp_path, monkeypatch,
                                                                       norm, peak):
    """Issue 60, T5-base on an H200 with bf16 weights (-3.3%): T5's norm takes its variance of an
    inline `.to(torch.float32)` and multiplies the input itself, which the product keeps for the
    backward beside pow's fp32 copy (PyTorch's saved tensors: the bf16 input, the fp32 copy, the
    rsqrt, the bf16 normalised copy, the weight); Llama's multiplies the fp32 copy it made on the
    line before, and its input is kept by nothing. The fp32 runs allocate alike: only the line's
    source tells them apart. Worked out by hand when the weight's gradient is made: the weight and
    its gradient 500 each; per norm the fp32 copy 400, rsqrt 8, the product and the output 200 each
    (808 a norm); the first add's and the second's outputs 200 each (the second norm's input is
    kept to its copy's end, the rule's horizon for a last norm): 3016; with T5's norm the
    embedding's output too, kept by the first norm's product: 3216."""
    (tmp_path / "norms").mkdir()
    (tmp_path / "norms" / f"{norm}.py").write_text(RMS_NORMS[norm])
    monkeypatch.syspath_prepend(str(tmp_path))
    run = write_snapshot(rms_norm_loop(norm), "norm.pickle")
    # fp32: the weight and its gradient, 7 tensors of 400, 2 of 16
    assert memdiff.summarize(run).devices[0].peak_bytes == 4832
    predicted = memdiff.whatif(run, "weights=bf16").devices[0].changes[0]
    assert (predicted.predicted_peak_bytes, predicted.predicted_peak_phase) == (peak, "backward")
    assert ("upcasts inline" in predicted.assumptions[0]) == (norm == "t5"), predicted.assumptions[0]


# Issue 60's held-back real H200 run of families.py's ViT-base with its forward under
# torch.autocast("cuda", torch.bfloat16): its peak, as PyTorch's snapshot gives it.
VIT_AUTOCAST_REAL_PEAK = 3591 * 2**20


def test_vit_under_autocast_keeps_its_reductions_staging_at_fp32_size(shared):
    """Issue 60, ViT-base on an H200 under bf16 autocast (3,961 MiB predicted, +10%): the real
    window's C++ frames name libtorch_cpu.so, which hid every ATen op from the rules (all 369
    allocations of the residual width were read as fp32 residual adds); and a bias gradient's sum
    over the 32 x 197 tokens splits over blocks whose staging buffer holds the fp32 accumulator
    whatever the input's dtype (the 3072-wide one: 132 MiB, at the peak). ViT-Base has 73 bias sums
    a step (12 layers of 6 linears, and the classifier), each with a staging buffer and semaphores:
    438 in the 3 steps."""
    d = memdiff.whatif(str(shared.parent / "cuda-truth" / "vit-base.pickle.gz"), "autocast=bf16").devices[0]
    got = d.changes[0]
    said = got.assumptions[0]
    assert "the 438 staging buffers and semaphores of CUDA reductions" in said, said
    assert "the residual stream's 75 adds" in said, said  # 2 a layer and the embeddings' add, 3 times
    assert abs(got.predicted_peak_bytes - VIT_AUTOCAST_REAL_PEAK) <= 0.02 * VIT_AUTOCAST_REAL_PEAK, \
        got.predicted_peak_bytes


# Where a real GPU's snapshot says its C++ frames are (torch's symbolizer: the library and the offset in it);
# memdiff's own recordings leave the file empty.
LIBTORCH = "/opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"


def cuda_stack(op: str, *python: str, library: str = "") -> List[Dict[str, Any]]:
    """A caching-allocator stack: the ATen op's C++ frame innermost (in `library`), then Python frames."""
    return [{"filename": library, "line": 107658604 if library else 0, "name": f"at::_ops::{op}::call"},
            *({"filename": f.split(":")[0], "line": int(f.split(":")[1]), "name": f.split(":")[2]} for f in python)]


def gelu_loop(library: str = "") -> Dict[str, Any]:
    """One fp32 step of a layer norm, a product, Hugging Face GPT-2's GELU on one line (`0.5 * x *
    (1 + tanh(c * (x + 0.044715 * pow(x, 3))))`) and a second product, as CUDA records it, then
    the backward."""
    line = ("act.py:10:forward", "model.py:6:forward", "train.py:8:step")
    trace = [alloc(1, W, frames("torch/nn/parameter.py(1): __new__", "train.py(5): build"))]
    norm = ("functional.py:2900:layer_norm", "model.py:4:forward", "train.py:8:step")

    def cuda_frames(op: str, *python: str) -> List[Dict[str, Any]]:
        return cuda_stack(op, *python, library=library)
    made = [(7, 400, cuda_frames("layer_norm", *norm)),  # its output, saved by the product after it
            (8, 16, cuda_frames("layer_norm", *norm)),  # its mean and rstd, saved by its backward
            (9, 16, cuda_frames("layer_norm", *norm)),
            (10, 400, cuda_frames("addmm", "model.py:5:forward", "train.py:8:step")),
            (11, 400, cuda_frames("mul_Tensor", *line)),  # 0.5 * x, saved
            (12, 400, cuda_frames("pow_Tensor_Scalar", *line)),
            (13, 400, cuda_frames("mul_Tensor", *line)),
            (14, 400, cuda_frames("add_Tensor", *line)),
            (15, 400, cuda_frames("tanh", *line)),  # saved by tanh's backward
            (16, 400, cuda_frames("add_Tensor", *line)),  # 1 + tanh, saved
            (17, 400, cuda_frames("mul_Tensor", *line)),  # the GELU's result, saved by the next product
            (18, 100, cuda_frames("addmm", "model.py:7:forward", "train.py:8:step"))]
    transient = {12: 13, 13: 14, 14: 15}  # freed once the next result is made
    sizes = {a: s for a, s, _ in made}
    for a, size, stack in made:
        trace.append(alloc(a, size, stack))
        for t, after in transient.items():
            if after == a:
                trace.append(free(t, sizes[t], stack))
    grad = [{"filename": library, "line": 0, "name": "torch::autograd::AccumulateGrad::apply"},
            {"filename": "torch/autograd/__init__.py", "line": 1, "name": "backward"},
            {"filename": "train.py", "line": 9, "name": "step"}]
    trace += [free(a, size, grad) for a, size, _ in made[::-1][:4] if a not in transient]  # 18, 17, 16, 15
    trace += [alloc(2, W, grad)]  # the weight's gradient, once the backward reaches it
    trace += [free(a, size, grad) for a, size, _ in made[::-1][4:] if a not in transient]
    return {"segments": [], "device_traces": [trace]}


@pytest.mark.parametrize("library", ["", LIBTORCH], ids=["memdiff-recording", "real-gpu-snapshot"])
def test_autocast_keeps_what_cuda_runs_in_fp32_and_the_copy_it_saves(write_snapshot, library):
    """Issue 42 item 3: from the ATen ops on CUDA stacks, the layer norm and the pow autocast runs
    in fp32 and what the pow's line computes after it stay fp32 (the add, tanh, product), each
    line's result halves (the product after it saves a bf16 copy of it: the norm's output, not its
    mean and rstd), pow keeps an fp32 copy of its bf16 input, and the bf16 product it read is then
    kept by nothing: freed when the line ends. Worked out by hand when the GELU's result is made:
    the weight 1000 and its bf16 cast 500; the norm's output 200, its mean and rstd 16 each; the
    first product and 0.5 * x halved, 200 each; tanh and 1 + tanh, 400 each; the GELU's result 200;
    pow's fp32 input 400: 3532. At the second product (50) the first one is gone: 3382 (kept to
    the backward, as before this rule, it made the peak 3582 there). The same whether the C++ frames
    name no file (memdiff's recordings) or their library, as a real GPU's snapshot does (issue 60:
    ViT-base's real window then read no op at all, and autocast=bf16 said +10.3% against the real
    change)."""
    run = write_snapshot(gelu_loop(library), "gelu.pickle")
    assert memdiff.summarize(run).devices[0].peak_bytes == 3532
    predicted = memdiff.whatif(run, "autocast=bf16").devices[0].changes[0]
    assert (predicted.predicted_peak_bytes, predicted.predicted_peak_phase) == (3532, "forward")


def embedding_loop(library: str = "") -> Dict[str, Any]:
    """One fp32 step of an embedding lookup and a product, as CUDA records it: the table's
    gradient made by `embedding_backward`, the product's weight's by `mm`."""
    weight = frames("torch/nn/parameter.py(1): __new__", "train.py(5): build")
    lookup = cuda_stack("embedding", "functional.py:2500:embedding", "model.py:4:forward", "train.py:8:step",
                        library=library)
    product = cuda_stack("addmm", "model.py:5:forward", "train.py:8:step", library=library)

    def grad(op: str) -> List[Dict[str, Any]]:
        return [{"filename": library, "line": 0, "name": f"at::_ops::{op}::call"},
                {"filename": library, "line": 0, "name": "torch::autograd::AccumulateGrad::apply"},
                {"filename": "torch/autograd/__init__.py", "line": 1, "name": "backward"},
                {"filename": "train.py", "line": 9, "name": "step"}]
    trace = [alloc(1, 1000, weight), alloc(2, 1000, weight),  # the table, the product's weight
             alloc(7, 4000, lookup), alloc(8, 4000, product),
             free(8, 4000, grad("mm")), alloc(3, 1000, grad("mm")),
             free(7, 4000, grad("embedding_backward")), alloc(4, 1000, grad("embedding_backward"))]
    return {"segments": [], "device_traces": [trace]}


@pytest.mark.parametrize("library", ["", LIBTORCH], ids=["memdiff-recording", "real-gpu-snapshot"])
def test_autocast_casts_no_embedding_table_and_its_lookup_stays_fp32(write_snapshot, library):
    """Issue 60, BERT-base on an H100 under bf16 autocast (+2.0%): an embedding is on none of
    autocast's lists, so its table gets no bf16 copy and its rows stay fp32 (the rule cast the
    table, 45 MiB of BERT's word embeddings, and halved the rows). Worked out by hand at the
    forward's end: the table and the weight 1000 each, the weight's cast 500, the fp32 rows 4000,
    the product's bf16 output 2000: 8500 (the fp32 run: 10000)."""
    run = write_snapshot(embedding_loop(library), "embedding.pickle")
    assert memdiff.summarize(run).devices[0].peak_bytes == 10000
    predicted = memdiff.whatif(run, "autocast=bf16").devices[0].changes[0]
    assert (predicted.predicted_peak_bytes, predicted.predicted_peak_phase) == (8500, "forward")
    assert "embeddings and norms excepted" in predicted.assumptions[0]


LLAMA_FWD = ["model.py(9): forward", "nn.Module: Tiny_0", *STEP]


def cpu_lookup_norm_product() -> Dict[str, Any]:
    """One fp32 step as the CPU route (the profiler) records it, Llama's layout cut to its three
    kinds of weight: an embedding lookup (rows 4000), an RMS norm's `weight * x` (4000) and a
    product (4000), then the backward: the product's weight's gradient by MmBackward0's mm, the
    norm weight's by MulBackward0's sum, the table's by EmbeddingBackward0. The profiler's stacks
    name no ATen op as CUDA's do: the nodes and the built-ins called are what they show."""
    lookup = frames("<built-in method embedding of type object at 0x7f97>",
                    "torch/nn/functional.py(2503): embedding", *LLAMA_FWD)
    norm = frames("model.py(61): forward", "nn.Module: RMSNorm_0", *LLAMA_FWD)
    product = frames("<built-in function linear>", "torch/nn/modules/linear.py(130): forward", *LLAMA_FWD)

    def grad(op: str, node: str) -> List[Dict[str, Any]]:
        return frames(*op.split(" < "), f"autograd::engine::evaluate_function: {node}", *ENGINE)
    mm, mul = grad("aten::mm", "MmBackward0"), grad("aten::sum", "MulBackward0")
    emb = grad("aten::empty < aten::zeros < aten::embedding_dense_backward", "EmbeddingBackward0")
    return {"segments": [], "device_traces": [[
        alloc(1, 1000, PARAM), alloc(2, 100, PARAM), alloc(3, 1000, PARAM),  # the table, the norm's, the product's
        alloc(7, 4000, lookup), alloc(8, 4000, norm), alloc(9, 4000, product),
        free(9, 4000, mm), alloc(4, 1000, mm), free(8, 4000, mul), alloc(5, 100, mul),
        free(7, 4000, emb), alloc(6, 1000, emb)]]}


def test_cpu_autocast_casts_only_the_product_s_weight_and_keeps_the_lookup(write_snapshot):
    """Issue 60, Llama on the CPU under bf16 autocast (+2.3% over the run really made): where the
    stacks name no ATen op, every weight got a bf16 cast (the embedding's 250 KB table, each RMS
    norm's weight) and the looked-up rows halved. Autocast casts a weight only for an op of its
    lists (the product's), and the lookup gives fp32 rows (PyTorch holds it below); the nodes that
    made each gradient tell the weights apart. By hand at the forward's end: the weights 2100, the
    product's weight's cast 500, the rows 4000, the norm's output and the product's 2000 each:
    10,600 (casting every weight and halving the rows made it 9,150)."""
    run = write_snapshot(cpu_lookup_norm_product(), "lookup.pickle")
    assert memdiff.summarize(run).devices[0].peak_bytes == 14100
    predicted = memdiff.whatif(run, "autocast=bf16").devices[0].changes[0]
    assert (predicted.predicted_peak_bytes, predicted.predicted_peak_phase) == (10600, "forward")
    assert predicted.categories["autocast_weights"] == 500


def test_cpu_autocast_casts_no_table_nor_a_weight_it_multiplies(torch):
    """The facts the rule above rests on, from PyTorch itself: under CPU autocast, an embedding's
    rows and a weight's elementwise product with fp32 input stay fp32, and nothing saved for the
    backward is a bf16 copy of their weights; a linear layer saves a bf16 copy of its weight."""
    table, scale, layer = torch.nn.Embedding(100, 16), torch.nn.Parameter(torch.ones(16)), torch.nn.Linear(16, 16)
    saved: List[Any] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        rows = table(torch.randint(0, 100, (4, 8)))
        scaled = scale * rows
        layer(scaled)
    assert rows.dtype == scaled.dtype == torch.float32
    copies = [t for t in saved if t.dtype == torch.bfloat16]
    assert [tuple(t.shape) for t in copies if t.dim() == 2 and t.shape[0] == 16] == [(16, 16)]  # the linear's weight
    assert not any(t.shape in (table.weight.shape, scale.shape) for t in copies)


MOE = ".venv/lib/python3.12/site-packages/transformers/integrations/moe.py"
EXPERTS = [f"{MOE}(631): forward", "nn.Module: MixtralExperts_0", *LLAMA_FWD]


def cpu_grouped_experts() -> Dict[str, Any]:
    """One fp32 step of transformers' grouped-mm experts (`grouped_mm_experts_forward`, Mixtral's
    default) as the CPU route records it, at its sizes' proportions: the norm's output (4000) the
    experts gather their tokens from (4000), the gate-and-up product (8000), the activation and
    the gated product (4000 each), the down product (4000); the backward mirrors it, each grouped
    product's node (GroupedMmBackward0) making its input's and its weights' gradients, the
    gating's nodes between them."""
    def moe(*inner: str) -> List[Dict[str, Any]]:
        return frames(*inner, f"{MOE}(495): grouped_mm_experts_forward", *EXPERTS)
    grouped = ("<built-in method _grouped_mm of type object at 0x7f97>", "torch/nn/functional.py(7096): grouped_mm",
               f"{MOE}(381): _grouped_mm", f"{MOE}(412): _grouped_linear")
    norm = frames("model.py(142): forward", "nn.Module: RMSNorm_0", *LLAMA_FWD)

    def node(name: str, *ops: str) -> List[Dict[str, Any]]:
        return frames(*ops, f"autograd::engine::evaluate_function: {name}", *ENGINE)
    mm = node("GroupedMmBackward0", "aten::empty_strided", "aten::_grouped_mm")
    return {"segments": [], "device_traces": [[
        alloc(2, 2000, PARAM), alloc(3, 1000, PARAM),  # the experts' gate-and-up and down weights
        alloc(10, 4000, norm), alloc(11, 4000, moe(f"{MOE}(445): grouped_mm_experts_forward")), free(10, 4000, norm),
        alloc(12, 8000, moe(*grouped)), alloc(13, 4000, moe("<built-in function silu>")),
        alloc(14, 4000, moe(f"{MOE}(568): _default_apply_gate")), alloc(15, 4000, moe(*grouped)),
        alloc(20, 4000, mm), alloc(21, 1000, mm), free(14, 4000, mm), free(15, 4000, mm),
        alloc(22, 4000, node("MulBackward0", "aten::mul")), alloc(23, 4000, node("MulBackward0", "aten::mul")),
        free(20, 4000, mm), free(13, 4000, mm),
        alloc(24, 4000, node("SiluBackward0", "aten::silu_backward")), free(22, 4000, mm),
        alloc(25, 8000, node("SplitBackward0", "aten::cat")), free(24, 4000, mm), free(23, 4000, mm),
        free(12, 8000, mm), alloc(26, 4000, mm), alloc(27, 2000, mm), free(25, 8000, mm), free(11, 4000, mm),
        free(26, 4000, mm)]]}


def test_autocast_leaves_grouped_mm_experts_in_fp32(write_snapshot):
    """Issue 60, Mixtral on the CPU under bf16 autocast (-2.3% under the run really made):
    transformers casts the tokens to the experts' fp32 weights and runs them through grouped_mm,
    which autocast does not cast (PyTorch holds it below), so the experts run in fp32, and their
    gradients are fp32 too: their activations, the backward of the grouped products and of the
    gating between them keep their size, and their weights get no bf16 copy. By hand the run
    peaks where it did, when the down product's weight gradient is made: the weights 3000, the
    gathered tokens, the activation, the gated and down products 4000 each, the gate-and-up 8000,
    the down product's input gradient 4000 and weight gradient 1000: 32,000."""
    run = write_snapshot(cpu_grouped_experts(), "experts.pickle")
    assert memdiff.summarize(run).devices[0].peak_bytes == 32000
    predicted = memdiff.whatif(run, "autocast=bf16").devices[0].changes[0]
    assert (predicted.predicted_peak_bytes, predicted.predicted_peak_phase) == (32000, "backward")
    assert "autocast_weights" not in predicted.categories


def test_cpu_autocast_leaves_grouped_mm_alone(torch):
    """The facts the rule above rests on, from PyTorch itself: no autocast kernel is registered for
    aten::_grouped_mm (on the CPU or CUDA), so under autocast fp32 tokens and fp32 experts' weights
    give an fp32 product and fp32 gradients, as transformers' `input.to(weight.dtype)` feeds it."""
    for key in ("AutocastCPU", "AutocastCUDA"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", key)
        assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", key)
    weight = torch.randn(2, 8, 16, requires_grad=True)  # (experts, out, in), as Mixtral's
    tokens = torch.randn(6, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.nn.functional.grouped_mm(tokens, weight.transpose(-2, -1), offs=torch.tensor([2, 6]).int())
    out.backward(torch.ones_like(out))  # a dense gradient: the CPU kernel refuses sum()'s expanded one
    assert out.dtype == tokens.grad.dtype == weight.grad.dtype == torch.float32


def test_autocast_of_a_forward_alone_matches_the_real_gpu_run(shared, expected):
    """Issue 42 item 3, on a GPU run nobody here wrote (the cs336 2.7B transformer, context 128,
    one forward with grad and no backward, fp32 then under torch.autocast(bf16) on the GPU).
    Truth is the mixed run's own trace peak (expected.json). What the rules must see: autocast
    caches every weight's bf16 cast until it exits, though no backward follows (6.25 GiB: without
    it the prediction read 15.48 GiB, -30%); the attention mask is bool and keeps its size; the
    residual stream's adds stay fp32; `exp` (autocast's fp32 list) keeps its size."""
    predicted = memdiff.whatif(str(shared / "cs336-ctx128-fwd-fp32.pickle"), "autocast=bf16").devices[0].changes[0]
    measured = expected["cs336-ctx128-fwd-mixed.pickle"]["0"]["peak_bytes"]
    assert predicted.predicted_peak_phase == "forward"
    assert abs(predicted.predicted_peak_bytes - measured) <= 0.02 * measured, (predicted.predicted_peak_bytes, measured)
    assert any("no backward follows" in a for a in predicted.assumptions), predicted.assumptions


def attention_loop(calls: Dict[str, int]) -> Dict[str, Any]:
    """A forward of CPU `scaled_dot_product_attention` calls as the profiler records them, `calls`
    naming each call's allocations (each 100 bytes, kept for the backward), then a backward
    that frees them."""
    trace = []
    addr = 10
    for name, count in calls.items():
        for _ in range(count):
            trace.append(alloc(addr, 100, frames("<built-in function scaled_dot_product_attention>",
                                                 f"model.py(5): {name}", "train.py(8): step")))
            addr += 1
        trace.append(alloc(addr, 100, frames("<built-in function linear>", "model.py(6): forward",
                                             "train.py(8): step")))
        addr += 1
    grad = frames("<built-in method run_backward of torch._C._EngineBase object>",
                  "torch/autograd/graph.py(1): _engine_run_backward", "train.py(9): step")
    trace.append(alloc(addr, 8 * 100, grad))
    trace += [free(a, 100, grad) for a in range(10, addr)]
    return {"segments": [], "device_traces": [trace]}


def test_cpu_math_attention_keeps_its_fp32_size_in_half_precision(write_snapshot):
    """CPU attention's math backend (many allocations a call: scores, softmax, dropout mask,
    products) computes half-precision inputs in fp32, so its allocations keep their size; CPU flash
    attention (its output and logsumexp: 2) halves, as the products after each call and the
    gradient do. At the gradient, by hand: math 5 x 100, flash 2 x 50, the two products 2 x 50, the
    gradient 400: 1100 (fp32: 900 + 800; halving everything: 850)."""
    run = write_snapshot(attention_loop({"math": 5, "flash": 2}), "attention.pickle")
    assert memdiff.summarize(run).devices[0].peak_bytes == 1700
    predicted = memdiff.whatif(run, "weights=bf16").devices[0].changes[0]
    assert predicted.predicted_peak_bytes == 1100


@pytest.mark.slow
def test_bf16_grouped_query_attention_leaves_the_math_path_for_cudnn(tmp_path, torch):
    """Issue 60, Qwen2 with bf16 weights (+5.5% filed; families.py's Qwen2-0.5B at 4 x 1024 on an
    emulated H100 read +19.3%): its grouped-query attention runs PyTorch's math backend in fp32 (the
    memory-efficient kernel takes one number of heads only) and cuDNN in bf16 (PyTorch's selection,
    as the emulator runs it). cuDNN makes none of the math path's scores, softmax or repeated key and
    value, and keeps the query, key and value the math path had copied. The scenario suite's Qwen2,
    sequence 512, run twice on the emulated H100 (the bf16 run is the change really made): +14.9%
    before, +0.4% now."""
    runs = {}
    for name, flags in (("fp32", []), ("bf16", ["--bf16"])):
        runs[name] = tmp_path / f"{name}.pickle"
        done = subprocess.run(
            [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(runs[name]), "--", "python",
             str(TRAIN), "--model", "qwen2", "--device", "cuda", "--seq", "512", "--positions", "512", "--steps", "2",
             "--out", str(tmp_path / f"{name}.own.pickle"), *flags],
            capture_output=True, text=True, cwd=tmp_path,
            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error",
                 "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
        assert done.returncode == 0, done.stderr[-2000:]
    c = memdiff.whatif(str(runs["fp32"]), "weights=bf16").devices[0].changes[0]
    measured = memdiff.summarize(str(runs["bf16"])).devices[0]
    assert "take a fused kernel in half precision" in c.assumptions[0], c.assumptions[0]
    assert c.predicted_peak_phase == measured.phase_at_peak
    assert abs(c.predicted_peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes, (
        c.predicted_peak_bytes, measured.peak_bytes)


# ---------------------------------------------------------------- the CPU host's convolutions

CONV = frames("<built-in method conv2d of type object at 0x7f97>", "torch/nn/modules/conv.py(543): _conv_forward",
              "nn.Module: Conv2d_1", *FWD)
CONV_BWD = frames("aten::empty", "aten::convolution_backward",
                  "autograd::engine::evaluate_function: ConvolutionBackward0", *ENGINE)
ACCUMULATE = frames("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", *ENGINE)


def conv_with_bias(host: Any = None) -> Dict[str, Any]:
    """The CNN's second conv as an fp32 CPU run records it (oneDNN, which sums the bias gradient in
    place): its weight 72 KiB and bias; the forward keeps its relu output (2 MiB); the backward makes
    the conv output's gradient (ReluBackward0, 2 MiB), then the conv's node its input's gradient
    (1 MiB), its bias's and its weight's, and frees what it read. `host`: the capture's
    memdiff_cpu_host, where given."""
    snapshot: Dict[str, Any] = {"segments": [], "device_traces": [[
        alloc(1, 72 * 1024, PARAM), alloc(2, 256, PARAM), alloc(3, 2 * MiB, CONV), alloc(4, 2 * MiB, RELU),
        free(3, 2 * MiB), alloc(5, 2 * MiB, RELU_BWD), free(4, 2 * MiB),
        alloc(6, MiB, CONV_BWD), alloc(7, 256, CONV_BWD), alloc(8, 72 * 1024, CONV_BWD),
        free(5, 2 * MiB, ACCUMULATE), free(6, MiB)]]}
    if host is not None:
        snapshot["memdiff_cpu_host"] = host
    return snapshot


SLOW_HOST = {"torch": "2.13.0+cpu", "cpu_capability": "AVX2", "onednn_bf16_convolutions": False,
             "onednn_fp16_convolutions": False}


@pytest.mark.parametrize("change", ["weights=bf16", "autocast=bf16"])
def test_a_host_without_onednn_bf16_sums_each_bias_gradient_through_an_fp32_copy(write_snapshot, change):
    """Issue 60, the CNN on this x86 CPU without AVX-512 (-2.9% with bf16 weights, -2.6% under
    autocast): bf16 convolutions there run ATen's _slow_conv2d, whose bias gradient sums the bf16
    output gradient through an fp32 copy of it (PyTorch shows it below). The capture says which
    path its host takes (memdiff_cpu_host); where it says oneDNN, or says nothing (an older
    capture, a GPU), the prediction is what it was. By hand, at the conv node's first allocation:
    the output's gradient 1 MiB (bf16), the input's 0.5 MiB, the copy 2 MiB, and the weights
    (36 KiB and 128 B in bf16; under autocast 72 KiB and 256 B fp32 plus their bf16 casts, kept
    to their gradients). Without the copy the peak is 2 MiB over the weights: the forward's conv
    and relu outputs, or the relu's output and its gradient, 1 MiB each in bf16."""
    weights = 36 * 1024 + 128 if change == "weights=bf16" else 72 * 1024 + 256 + 36 * 1024 + 128
    without = memdiff.whatif(write_snapshot(conv_with_bias(), "old.pickle"), change).devices[0].changes[0]
    assert without.predicted_peak_bytes == weights + 2 * MiB
    onednn = {**SLOW_HOST, "onednn_bf16_convolutions": True}
    for host in (onednn, {"onednn_bf16_convolutions": "false"}, ["onednn_bf16_convolutions"]):
        assert memdiff.whatif(write_snapshot(conv_with_bias(host), "other.pickle"), change) \
            .devices[0].changes[0].predicted_peak_bytes == without.predicted_peak_bytes
    c = memdiff.whatif(write_snapshot(conv_with_bias(SLOW_HOST), "slow.pickle"), change).devices[0].changes[0]
    assert (c.predicted_peak_bytes, c.predicted_peak_phase) == (weights + MiB + MiB // 2 + 2 * MiB, "backward")
    assert "bias gradient sums an fp32 copy of its output's gradient (1 made)" in c.assumptions[0]


def test_a_bf16_convolution_without_onednn_sums_its_bias_gradient_through_an_fp32_copy(torch):
    """The fact the rule above rests on, from PyTorch on this host: where torch says oneDNN has no
    bf16 here, a bf16 conv2d's backward runs _slow_conv2d_backward, and its bias gradient's sum
    makes an fp32 copy of the whole output gradient (4 bytes an element)."""
    from memdiff.recording.capture import cpu_host

    if cpu_host(torch).get("onednn_bf16_convolutions") is not False:
        pytest.skip("this host's bf16 convolutions take oneDNN")
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).to(torch.bfloat16)
    out = conv(torch.randn(2, 4, 8, 8, dtype=torch.bfloat16, requires_grad=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(torch.ones_like(out))
    names = {e.name for e in prof.events()}
    copies = [e for e in prof.events() if e.name == "aten::_to_copy" and e.cpu_memory_usage == out.numel() * 4]
    assert "aten::_slow_conv2d_backward" in names and copies


# ---------------------------------------------------------------- a run without a trace

def test_a_change_to_an_untraced_snapshot_says_its_category_is_a_guess(shared, expected, tmp_path, capsys):
    # A snapshot dumped with no trace holds only segments: every block is live before the trace, no stack
    # says what it is, and memdiff reads it as weights by a guess (C001). weights=bf16 halves it; before,
    # every output gave the -50% as if the category were known.
    path = str(shared / "empty-trace.pickle")
    assert expected["empty-trace.pickle"]["0"]["trace_events"] == 0
    every_byte = expected["empty-trace.pickle"]["0"]["peak_bytes"]
    assert main(["whatif", path, "--change", "weights=bf16", "--format", "json",
                 "--html", str(tmp_path / "w.html")]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("whatif", doc, "whatif")
    (device,) = doc["devices"]
    (change,) = device["changes"]
    assert change["guessed_bytes"] == every_byte and change["guessed_categories"]
    (w016,) = [f for f in device["findings"] if f["code"] == "W016"]
    assert w016["data"]["amount_bytes"] == every_byte and w016["data"]["change"] == "weights=bf16"
    assert "on a guess" in device["headline"] and "on a guess" in change["line"]
    # Every output shows it: the table's column, the headline, the finding.
    assert main(["whatif", path, "--change", "weights=bf16"]) == 0
    text = capsys.readouterr().out
    assert main(["whatif", path, "--change", "weights=bf16", "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    page = (tmp_path / "w.html").read_text()
    for shown in (text, markdown, page):
        assert "W016" in shown and "on a guess" in shown and "on a guessed category" in shown


def test_state_known_by_the_stack_that_updated_it_in_place_is_a_guess_too(write_snapshot, capsys):
    # A CPU capture recorded after Adagrad's constructor made its sum (test_edges.adagrad_run): the sum and the
    # step counter, older than the trace, are optimizer_state by the stack of the step's in-place update, the
    # weight parameter by the order of the step's updates (a weight's is the last of its turn); neither is read
    # from the stack it was made with. Adagrad keeps one sum
    # per weight (the weight's 4,096 B) and a one-element fp32 step counter (4 B). W016 named neither before.
    from test_edges import SIZE, adagrad_run

    path = write_snapshot(adagrad_run())
    assert main(["whatif", path, "--change", "optimizer=sgd", "--change", "weights=bf16", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("whatif", doc, "whatif")
    (device,) = doc["devices"]
    sgd, bf16 = device["changes"]
    updated = "by the stack that updated it in place"
    assert (sgd["guessed_bytes"], bf16["guessed_bytes"]) == (SIZE, 2 * SIZE)
    # SGD keeps no state: the sum goes, known only by its update (the rule leaves one-element tensors as they are).
    assert sgd["guessed_by"] == [{"category": "optimizer_state", "inference": updated, "bytes": SIZE}]
    # bf16 halves the sum and the weight (the counter keeps its size); the weight's three versions (two
    # steps' updates) are one tensor, counted once.
    assert bf16["guessed_by"] == [{"category": "optimizer_state", "inference": updated, "bytes": SIZE},
                                  {"category": "parameter", "inference": "by the order of its in-place updates",
                                   "bytes": SIZE}]
    w016 = {f["data"]["change"]: f for f in device["findings"] if f["code"] == "W016"}
    assert set(w016) == {"optimizer=sgd", "weights=bf16"}
    assert "optimizer_state (4.00 KiB, by the stack that updated it in place)" in w016["optimizer=sgd"]["message"]
    assert "on a guess: 8.00 KiB it changes is optimizer_state by the stack that updated it in place and " \
           "parameter by the order of its in-place updates" in bf16["line"]


# The cs336 assignment's "medium" Transformer LM (d_model 1024, d_ff 4096 in a SwiGLU of three matrices, 24
# layers, vocabulary 10,000, untied embeddings, RMSNorm weights): its parameters, and AdamW's two moments of each.
CS336_MEDIUM_PARAMS = 2 * 10_000 * 1024 + 24 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024) + 1024
CS336_MEDIUM_ADAMW_STATE = 2 * 4 * CS336_MEDIUM_PARAMS


def test_state_known_by_the_stack_that_freed_it_is_a_guess_too(shared, capsys):
    # A real CUDA capture whose ring buffer lost the first steps (cs336-medium-ctx128-train): AdamW's moments
    # are older than the trace, and the assignment's optimizer replaces them each step, so the trace sees them
    # freed ("freed at optimizer.py:step"): optimizer_state by the stack that freed it, never by their own.
    # optimizer=sgd drops every one of them, and W016 was silent; C001 named only the weights.
    from memdiff.analyse.classify import load_rules
    from memdiff.analyse.peak import device_findings
    from memdiff.read.inputs import read_summary

    path = str(shared / "cs336-medium-ctx128-train.pickle")
    freed = {"category": "optimizer_state", "inference": "by the stack that freed it",
             "bytes": CS336_MEDIUM_ADAMW_STATE}
    assert main(["whatif", path, "--change", "optimizer=sgd", "--change", "weights=bf16", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    sgd, bf16 = doc["devices"][0]["changes"]
    assert sgd["guessed_bytes"] == CS336_MEDIUM_ADAMW_STATE and sgd["guessed_by"] == [freed]
    assert freed in bf16["guessed_by"]
    assert [f["data"]["guessed_by"] for f in doc["devices"][0]["findings"] if f["code"] == "W016"][0] == [freed]
    (c001,) = [f for f in device_findings(read_summary(path, load_rules()).devices[0]) if f.code == "C001"]
    assert freed in c001.data["by_inference"]
    assert "optimizer_state (3.15 GiB, by the stack that freed it)" in c001.message


def test_a_change_to_memory_the_trace_made_rests_on_no_guess(run, capsys):
    # The hand-built loop's every allocation is made in the trace, with its stack: nothing is guessed.
    assert main(["whatif", run, "--format", "json"]) == 0
    device = json.loads(capsys.readouterr().out)["devices"][0]
    assert all(c["guessed_bytes"] == 0 for c in device["changes"])
    assert not [f for f in device["findings"] if f["code"] == "W016"] and "on a guess" not in device["headline"]


def test_whatif_and_forecast_take_the_allocator_overhead_at_the_peak_moment(capsys):
    """With retain_graph=True GPT-2's caching allocator reserves 5.87 GiB at its highest (after the peak,
    the kept graph's blocks cached) but 5.11 GiB at the 4.92 GiB peak itself: the overhead a predicted
    peak is scaled by is reserved over allocated at the peak (1.037), not the reserved peak over it
    (1.193, whatif's) nor reserved at the dump over it (forecast's), and both commands take it from one
    function and say where it was measured."""
    from conftest import reserved_after

    cuda = Path(__file__).resolve().parent / "data" / "cuda"
    run = cuda / "gpt2-retain-graph.pickle.gz"
    device = memdiff.summarize(str(run)).devices[0]
    at_peak = reserved_after(run, 0, device.peak_event_index)  # PyTorch's segments, at the peak's event
    assert at_peak / device.peak_bytes < 1.04 < 1.19 < device.reserved_peak_bytes / device.peak_bytes
    result = memdiff.whatif(str(run), ["checkpoint"], budget="80GiB")
    assert result.overhead_ratio == round(at_peak / device.peak_bytes, 4)
    assert result.overhead_note is not None and "at the peak of gpt2-retain-graph.pickle.gz device 0" in \
        result.overhead_note and format_bytes(at_peak) in result.overhead_note
    # The forecast's largest: of the base run (1.0603) and the batch-8 run (1.0819, measured alike).
    base, batch8 = cuda / "gpt2-base.pickle.gz", cuda / "gpt2-batch8.pickle.gz"
    assert main(["forecast", f"{base}=4", f"{batch8}=8", "--budget", "80GiB", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    eight = memdiff.summarize(str(batch8)).devices[0]
    assert doc["overhead_ratio"] == round(reserved_after(batch8, 0, eight.peak_event_index) / eight.peak_bytes, 4)
    assert "at the peak of gpt2-batch8.pickle.gz device 0" in doc["overhead_note"]


def test_the_repeated_blocks_read_as_a_person_says_them_in_every_output(tmp_path, capsys):
    """GPT-2's 12 layers on CUDA stacks are 12 calls of one line of Hugging Face's loop. The headline read
    `repeated blocks call 1 at modeling_layers.py:109 .. call 12 at modeling_layers.py:109 (12)`; it is the
    report's sentence, the same in every output, and the checkpoint row names the calls once."""
    from memdiff.predict.whatif.engine import blocks_text

    run = str(Path(__file__).resolve().parent / "data" / "cuda" / "gpt2-base.pickle.gz")
    said = "; 12 repeated blocks, called at modeling_layers.py:109; "
    page = tmp_path / "w.html"
    assert main(["whatif", run, "--change", "checkpoint=0.5", "--format", "json", "--html", str(page)]) == 0
    device = json.loads(capsys.readouterr().out)["devices"][0]
    assert len(device["blocks"]) == 12 and said in device["headline"]
    assert "(calls 2, 4, 6, 8, 10 and 12 at modeling_layers.py:109)" in device["changes"][0]["assumptions"][0]
    for fmt in ("text", "markdown"):
        assert main(["whatif", run, "--change", "checkpoint=0.5", "--format", fmt]) == 0
        assert said in capsys.readouterr().out
    assert said in page.read_text()
    # Module instances, as the profiler's frames name them.
    assert blocks_text([f"GPT2Block_{k}" for k in range(12)]) == "12 repeated blocks, GPT2Block_0 to GPT2Block_11"
    assert blocks_text(["T5Stack_0", "T5Stack_1"]) == "2 repeated blocks, T5Stack_0 and T5Stack_1"


@pytest.mark.parametrize("command", ["whatif", "forecast"])
def test_a_budget_of_nothing_is_a_usage_error(command, capsys):
    # every change read 'no' (whatif) or 'over budget at 1' (forecast) for a typo's sake
    run = Path(__file__).parent / "data" / "cuda" / "gpt2-base.pickle.gz"
    with pytest.raises(SystemExit) as stopped:
        main([command, f"{run}=4" if command == "forecast" else str(run), "--budget", "0GiB"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--budget: '0GiB' is 0 B: a budget is the memory a run may use" in err
