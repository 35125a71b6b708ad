"""torch.compile: compiled memory is named by the model code that ran it, never by generated files.

Hand-built stacks in each form torch writes generated code: Inductor's output code in its cache
folder (CUDA frames with lines; memdiff's CPU route, where the profiler names a function by its
first line), FX GraphModule code (`<eval_with_key>.N`, with or without `from FILE:LINE in FN`) and
FX code written for the profiler (`fx_generated__<hash>.py`, with `fx_original_trace` where
`augment_with_fx_traces` added it).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import missing_capture_dependency

from memdiff.read.frames import StackNormalizer, frames_lists, number_compiled_buffers

HASH_A = "czcopfae4wrbv3edcqap4z5wy5e5apiro6a6puhtdwjoll3yfn5u"
HASH_B = "cmrvtsv372agr5azeeezfrl7dbh7fb3g5beuq5rydhksvdzpftig"
# What no site or frame name may show: a hash-named file, the FX counter, the generated prefix.
HASHED = re.compile(r"c[a-z0-9]{40,}|eval_with_key|fx_generated|torchinductor")

USER = [
    {"name": "forward", "filename": "/home/a/proj/model.py", "line": 8},
    {"name": "_call_impl", "filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", "line": 1782},
    {"name": "step", "filename": "/home/a/proj/train.py", "line": 13},
]
RUNTIME = [
    {"name": "__call__", "filename": "/venv/lib/python3.12/site-packages/torch/_inductor/output_code.py", "line": 721},
    {"name": "forward", "filename": "/venv/lib/python3.12/site-packages/torch/_functorch/_aot_autograd/"
                                    "runtime_wrappers.py", "line": 3459},
    {"name": "apply", "filename": "/venv/lib/python3.12/site-packages/torch/autograd/function.py", "line": 609},
    {"name": "_fn", "filename": "/venv/lib/python3.12/site-packages/torch/_dynamo/eval_frame.py", "line": 1423},
]
OP = [{"name": "at::_ops::empty_strided::call(c10::ArrayRef<c10::SymInt>)", "filename": "??", "line": 0}]
ADDMM = [{"name": "at::_ops::addmm::call(at::Tensor const&)", "filename": "??", "line": 0}]


def inductor(path: str, line: int, ops=OP):
    """A CUDA stack (stacks='all') through Inductor's generated `call` at `line`."""
    return [*ops, {"name": "call", "filename": path, "line": line}, *RUNTIME, *USER]


def stacks_of(*frame_lists):
    """Each frames list's Stack, the normalizer having read them all first (as summarize does)."""
    n = StackNormalizer()
    n.learn_generated(frame_lists)
    return [n.stack(f) for f in frame_lists]


def test_inductor_cuda_buffers_are_numbered_by_their_place_and_align_across_shapes():
    # The graph compiled for two sequence lengths: another hash, another cache folder, lines shifted.
    a = [inductor(f"/tmp/torchinductor_root/zc/{HASH_A}.py", line) for line in (88, 93, 97)]
    b = [inductor(f"/home/ci/.cache/inductor/mr/{HASH_B}.py", line) for line in (90, 101, 107)]
    sa, sb = stacks_of(*a), stacks_of(*b)
    assert [s.site for s in sa] == [f"model.py:forward <- compiled buffer {k}" for k in (1, 2, 3)]
    assert [s.signature for s in sa] == [s.signature for s in sb]
    assert len({s.signature for s in sa}) == 3
    for s in sa + sb:
        assert not HASHED.search(s.site) and not any(HASHED.search(f.file + f.name) for f in s.frames)
        # the runtime that ran the graph is no part of the story
        assert not any("_inductor" in f.file or "_dynamo" in f.file for f in s.frames)


def test_a_fallback_op_inside_compiled_code_keeps_its_name():
    (s,) = stacks_of(inductor(f"/tmp/torchinductor_u/ab/{HASH_A}.py", 90, ops=ADDMM))
    assert s.site == "model.py:forward <- compiled buffer 1 <- addmm"


def test_fx_graph_module_code_is_named_by_place_whatever_its_counter():
    def fx(key: str, line: int):
        return [*ADDMM, {"name": "forward", "filename": key, "line": line},
                {"name": "_wrapped_call", "filename": "/venv/lib/python3.12/site-packages/torch/fx/graph_module.py",
                 "line": 400}, *RUNTIME, *USER]
    a = stacks_of(fx("<eval_with_key>.3", 5), fx("<eval_with_key>.3", 9))
    b = stacks_of(fx("<eval_with_key>.12 from /home/a/proj/model.py:8 in forward", 6),
                  fx("<eval_with_key>.12 from /home/a/proj/model.py:8 in forward", 11))
    assert [s.site for s in a] == ["model.py:forward <- compiled buffer 1 <- addmm",
                                   "model.py:forward <- compiled buffer 2 <- addmm"]
    assert [s.signature for s in a] == [s.signature for s in b]


def test_fx_generated_code_reads_its_original_source_lines_when_the_snapshot_has_them():
    plain = [*ADDMM, {"name": "forward", "filename": "fx_generated__3f9a0b1c2d.py", "line": 14}, *RUNTIME, *USER]
    (s,) = stacks_of(plain)
    assert s.site == "model.py:forward <- compiled buffer 1 <- addmm"
    augmented = copy.deepcopy(plain)
    augmented[1].update({
        "fx_node_op": "call_function", "fx_node_name": "addmm_1", "fx_node_target": "aten.addmm.default",
        "fx_original_trace": '  File "/home/a/proj/model.py", line 8, in forward\n    return self.b(self.a(x))\n'
                             '  File "/home/a/proj/layers.py", line 21, in forward\n    return F.linear(x, self.w)\n'})
    (s,) = stacks_of(augmented)
    assert s.site == "layers.py:forward <- compiled aten.addmm.default <- addmm"
    assert ("layers.py", 21) in [(f.file.rsplit("/", 1)[-1], f.line) for f in s.frames]
    assert not any(HASHED.search(f.file + f.name) for f in s.frames)


def test_a_hostile_fx_original_trace_is_read_as_far_as_it_makes_sense():
    frames = [{"name": "forward", "filename": "fx_generated__ab.py", "line": 3, "fx_original_trace": 7},
              *USER]
    assert stacks_of(frames)[0].site == "model.py:forward <- compiled buffer 1"
    long = 'File "/x/m.py", line 1, in f\n' * 10_000
    frames[0] = {**frames[0], "fx_original_trace": long}
    assert len(stacks_of(frames)[0].frames) < 80
    # a run of line breaks is read once, not once from each of them (minutes, were it so)
    frames[0] = {**frames[0], "fx_original_trace": "\n" * 60_000 + " " * 60_000}
    assert stacks_of(frames)[0].site == "model.py:forward <- compiled buffer 1"


def test_stacks_without_generated_code_keep_their_torch_frames():
    # torch.optim steps run through torch/_dynamo/eval_frame.py (dynamo.disable): no compiled code.
    frames = [*OP, RUNTIME[3], {"name": "step", "filename": "/venv/lib/python3.12/site-packages/torch/optim/adam.py",
                                "line": 214}, *USER[2:]]
    (s,) = stacks_of(frames)
    assert "torch/_dynamo/eval_frame.py" in [f.file for f in s.frames]


def profiler_entry(action: str, addr: int, frames):
    return {"action": action, "addr": addr, "size": 16, "stream": 0, "frames": frames}


def cpu_stack(path: str):
    """memdiff's CPU route: the profiler names each frame by its function's first line."""
    return [{"filename": "none", "line": 0, "name": "<built-in function _empty_strided_cpu>"},
            {"filename": "none", "line": 0, "name": f"{path}(82): call"},
            {"filename": "none", "line": 0, "name": "torch/_inductor/output_code.py(721): __call__"},
            {"filename": "none", "line": 0, "name": "model.py(8): forward"},
            {"filename": "none", "line": 0, "name": "train.py(12): step"}]


def test_cpu_route_buffers_are_numbered_by_their_order_in_each_run_of_the_graph():
    path = f"/tmp/torchinductor_root/zc/{HASH_A}.py"
    other = [{"filename": "none", "line": 0, "name": "<built-in method randn of type object at 0x7f>"},
             {"filename": "none", "line": 0, "name": "train.py(12): step"}]
    trace = []
    for step in range(2):  # two runs of the graph, the batch made between them
        trace.append(profiler_entry("alloc", 1000 * step, other))
        for k in range(3):
            trace.append(profiler_entry("alloc", 1000 * step + k + 1, cpu_stack(path)))
        trace.append(profiler_entry("free_requested", 1000 * step + 2, trace[-2]["frames"]))
    number_compiled_buffers([trace])
    n = StackNormalizer()
    n.learn_generated(frames_lists([trace], []))
    sites = [n.stack(e["frames"]).site for e in trace if e["action"] == "alloc"]
    assert sites == ["train.py:step <- randn"] + [f"model.py:forward <- compiled buffer {k}" for k in (1, 2, 3)] * 1 \
        + ["train.py:step <- randn"] + [f"model.py:forward <- compiled buffer {k}" for k in (1, 2, 3)]
    # a free reads the stack of the allocation it frees
    assert trace[4]["frames"] is trace[2]["frames"]
    number_compiled_buffers([trace])  # summarizing the same snapshot again numbers it the same
    assert [n.stack(e["frames"]).site for e in trace if e["action"] == "alloc"] == sites


@pytest.mark.slow
def test_a_compiled_model_at_two_sequence_lengths_aligns_row_for_row_and_names_no_hash(scenarios, tmp_path):
    runs = scenarios("gpt-compile", "gpt-compile-seq128")
    out = tmp_path / "diff.json"
    done = subprocess.run([sys.executable, "-m", "memdiff", "diff", str(runs["gpt-compile"]),
                           str(runs["gpt-compile-seq128"]), "--format", "json"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    out.write_text(done.stdout)
    report = json.loads(done.stdout)
    assert not HASHED.search(json.dumps(report["headline"]))
    rows = report["devices"][0]["rows"]
    compiled = [r for r in rows if "compiled buffer" in r["site"]]
    # Inductor's code for seq 64 and seq 128 lives in two hash-named files; the buffers align.
    assert len(compiled) >= 5
    assert {r["status"] for r in compiled} <= {"GREW", "SAME"}
    # named by the model code that ran them: the forward of the compiled model, or its backward's node
    ran_by = ("gpt.py:forward <- compiled buffer ", "CompiledFunctionBackward <- compiled buffer ")
    assert all(r["site"].startswith(ran_by) for r in compiled)
    for r in rows:
        assert not HASHED.search(r["site"])
        assert not any(HASHED.search(f"{f['file']} {f['name']}") for f in r.get("frames") or [])
    # the model's own facts: its weights are the same in both runs, and read as parameter
    facts = json.loads(Path(str(runs["gpt-compile"]) + ".facts.json").read_text())
    categories = report["devices"][0]["categories"]
    parameter = next(c for c in categories if c["category"] == "parameter")
    assert parameter["base_bytes"] == parameter["head_bytes"] == facts["parameter_bytes"]


def test_cpu_route_fx_graph_code_reads_as_the_model_code_that_ran_it():
    """aot_eager on memdiff's CPU route: FX code calls each aten op through an OpOverload, which the
    profiler names without a name, inside FX's own GraphModule."""
    def stack(key: str, module: str):
        return [{"filename": "none", "line": 0, "name": "<built-in method  of pybind11_builtins.pybind11_detail_"
                                                        "function_record_v1 object at 0x55d>"},
                {"filename": "none", "line": 0, "name": "torch/_ops.py(874): __call__"},
                {"filename": "none", "line": 0, "name": f"{key}(4): forward"},
                {"filename": "none", "line": 0, "name": f"nn.Module: {module}"},
                {"filename": "none", "line": 0, "name": "torch/fx/graph_module.py(488): __call__"},
                {"filename": "none", "line": 0, "name": "<built-in method apply of FunctionMeta object at 0x5e>"},
                {"filename": "none", "line": 0, "name": "torch/_dynamo/eval_frame.py(1423): _fn"},
                {"filename": "none", "line": 0, "name": "model.py(8): forward"},
                {"filename": "none", "line": 0, "name": "train.py(12): step"}]
    trace = [profiler_entry("alloc", 1, stack("<eval_with_key>.3", "GraphModule_0")),
             profiler_entry("alloc", 2, stack("<eval_with_key>.3", "GraphModule_0"))]
    other = [profiler_entry("alloc", 1, stack("<eval_with_key>.11", "GraphModule_4")),
             profiler_entry("alloc", 2, stack("<eval_with_key>.11", "GraphModule_4"))]
    sites = []
    for t in (trace, other):
        number_compiled_buffers([t])
        n = StackNormalizer()
        n.learn_generated(frames_lists([t], []))
        sites.append([(n.stack(e["frames"]).site, n.stack(e["frames"]).signature) for e in t])
    assert [site for site, _ in sites[0]] == [f"model.py:forward <- compiled buffer {k}" for k in (1, 2)]
    assert sites[0] == sites[1]


def compiled_live_at_peak(snapshot: Path):
    """From the raw trace, never from memdiff: the compiled buffers (allocated by Inductor's generated
    code) live at the trace's peak (the first highest running total of allocations less completed
    frees), as (graph, PyTorch's category, bytes) each; graph is "backward" where the stack runs
    through the compiled backward's autograd node."""
    with open(snapshot, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    live, total, best, at_peak = {}, 0, None, []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            total -= e["size"]
        else:
            continue
        if best is None or total > best:
            best, at_peak = total, list(live.values())
    out = []
    for e in at_peak:
        names = [f["name"] for f in e.get("frames") or []]
        if any("torchinductor_" in n for n in names):
            graph = "backward" if any("CompiledFunctionBackward" in n for n in names) else "forward"
            out.append((graph, e.get("category"), e["size"]))
    return out


def compiled_members(row):
    """(side, graph, bytes, count) of each compiled buffer group a diff row holds."""
    members = row.get("members") or [
        {"side": side, "bytes": row[f"{side}_bytes"], "count": row[f"{side}_count"], "frames": row["frames"]}
        for side in ("base", "head") if row[f"{side}_count"]]
    out = []
    for m in members:
        names = [f["name"] for f in m["frames"]]
        if any(n.startswith("compiled buffer ") for n in names):
            graph = "backward" if any("CompiledFunctionBackward" in n for n in names) else "forward"
            out.append((m["side"], graph, m["bytes"], m["count"]))
    return out


@pytest.mark.slow
def test_a_compiled_graph_that_allocates_differently_at_another_length_pairs_its_buffers(scenarios):
    """Llama compiled at sequence 32 and 64: Inductor's backward graph reuses a freed buffer at one
    length where it allocates at the other and allocates two gradients in the other order, so a
    buffer's number differs between the runs. Truth from each run's raw trace: the compiled buffers
    live at its peak, by graph and PyTorch's category."""
    runs = scenarios("llama-compile-seq32", "llama-compile-seq64")
    truth = {side: compiled_live_at_peak(runs[name])
             for side, name in (("base", "llama-compile-seq32"), ("head", "llama-compile-seq64"))}
    done = subprocess.run([sys.executable, "-m", "memdiff", "diff", str(runs["llama-compile-seq32"]),
                           str(runs["llama-compile-seq64"]), "--format", "json"], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    rows = json.loads(done.stdout)["devices"][0]["rows"]
    held = [(r, compiled_members(r)) for r in rows]
    # every compiled byte live at each run's peak is in a row, and nothing else is read as compiled
    for side in ("base", "head"):
        assert sum(b for r, ms in held for s, _, b, _ in ms if s == side) == sum(b for _, _, b in truth[side])
    # A compiled buffer reads as NEW (or GONE) only where its run holds more buffers of that graph and
    # category at its peak than the other run does.
    for graph in ("forward", "backward"):
        counts = {side: Counter((c for g, c, _ in truth[side] if g == graph)) for side in truth}
        for status, side, other in (("NEW", "head", "base"), ("GONE", "base", "head")):
            more = sum(max(0, n - counts[other][c]) for c, n in counts[side].items())
            unpaired = sum(n for r, ms in held if r["status"] == status for s, g, _, n in ms if g == graph)
            assert unpaired <= more, (status, graph, unpaired, more)
    # A weight's gradient is of one size at any length: each gradient the backward graph holds at both
    # peaks, of a size no other buffer of its run has, is in one row with itself (its delta 0).
    for size in {b for g, c, b in truth["base"] if c == "gradient"}:
        once = all([b for _, _, b in truth[side]].count(size) == 1 for side in truth)
        if not once or size not in [b for g, c, b in truth["head"] if c == "gradient"]:
            continue
        (row,) = [r for r, ms in held if any(s == "base" and b == size and n == 1 for s, _, b, n in ms)]
        assert any(s == "head" and b == size for s, _, b, _ in compiled_members(row)), row["site"]
        assert not any(s == "head" and b != size for s, _, b, _ in compiled_members(row)), row["site"]


@pytest.fixture(scope="module")
def warm_llama(torch, tmp_path_factory):
    """tests/scenarios/llama_compile_warm.py under `memdiff record --emulate h200 --steps 1:3`: a
    compiled Llama recorded once warm, its weights, AdamW moments, workspaces and graphs all older
    than the trace. (snapshot, the script's own facts)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        missing_capture_dependency("transformers is not installed (pip install -e '.[test]')")
    folder = tmp_path_factory.mktemp("warm-llama")
    snapshot, kept = folder / "run.pickle", folder / "writes"
    facts = folder / "facts.json"
    script = Path(__file__).resolve().parent / "scenarios" / "llama_compile_warm.py"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h200", "--steps", "1:3",
                           "-o", str(snapshot), "--keep-writes", str(kept), "--", sys.executable, str(script),
                           str(facts)], capture_output=True, text=True, cwd=folder,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert done.returncode == 0, done.stderr[-3000:]
    # the facts file is one of the run's writes, kept in its overlay (an emulated run writes no user file)
    written = kept / "upper" / str(facts).lstrip(os.sep)
    return snapshot, json.loads(written.read_text())


@pytest.mark.slow
def test_a_compiled_llamas_rotary_backward_is_planned_by_inductor_on_the_emulated_gpu(warm_llama):
    """The rotary embedding's `rotate_half` leaves a slice scatter in the backward graph, which
    Inductor's reinplace pass ran on the emulated GPU's tensors with a copy a CPU build cannot take
    (`PyTorch is not linked with support for cuda devices`): every Hugging Face Llama ran eagerly."""
    with open(warm_llama[0], "rb") as f:
        snapshot = pickle.load(f)
    notes = snapshot["emulated"]["notes"]
    assert any("Inductor's memory plan" in n for n in notes), notes
    assert not any("runs eagerly" in n for n in notes), notes
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    # The backward is Inductor's wrapper code (a `call` in a hash-named file) under the compiled
    # graph's autograd node, not the eager model's nodes (on the fallback: 116 allocations in MmBackward0).
    generated = re.compile(r"(^|/)c[a-z0-9]{51}\.py$")
    compiled = [e for e in allocs if any("CompiledFunctionBackward" in f["name"] for f in e["frames"])
                and any(f["name"] == "call" and generated.search(f["filename"]) for f in e["frames"])]
    assert len(compiled) > 50
    assert not [e for e in allocs if any("MmBackward0" in f["name"] for f in e["frames"])]


@pytest.mark.slow
def test_a_warm_compiled_runs_categories_are_the_models_own_bytes(warm_llama):
    """Issue 60: recorded warm, everything the model and AdamW hold is older than the trace and
    frameless, its category guessed by sizes. Its 512 x 512 attention weights are a cuBLASLt
    workspace's 1 MiB, and a model without biases never makes one: the workspace guess took one of
    their moments, the 1 MiB size no longer held three blocks per weight, and AdamW's two moments
    per weight read as one (parameter 297.27 MiB, optimizer state 149.14 MiB). At the peak and at
    each phase's peak, parameter is the weights and optimizer state the optimizer's tensors, to the byte."""
    from memdiff import api

    snapshot, facts = warm_llama
    assert not facts["tied"]
    device = api.summarize(snapshot).devices[0]
    assert device.categories["parameter"] == facts["weights_bytes"]
    assert device.categories["optimizer_state"] == facts["state_bytes_on_device"]
    assert device.categories["workspace"] == 2 * 32 << 20  # the forward's and the backward's cuBLAS handles
    for phase in device.phase_peaks:
        if phase.groups is None:  # the phase's peak is the peak
            continue
        held = Counter()
        for g in phase.groups:
            held[g.category] += g.bytes
        assert (phase.phase, held["parameter"], held["optimizer_state"]) == \
            (phase.phase, facts["weights_bytes"], facts["state_bytes_on_device"])
