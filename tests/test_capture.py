"""Capture on CPU with the example workload, and memdiff's categories against PyTorch's own."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from collections import Counter
from typing import Dict

import pytest
from tabulate import tabulate

from memdiff.analyse.classify import load_rules
from memdiff.compare.differ import GONE, GREW, NEW, SHRANK, diff
from memdiff.read.inputs import read_summary
from memdiff.read.load import decode
from memdiff.recording.capture import CaptureError, record

# Slow (the fast loop, -m "not slow", leaves it out): records with torch.
pytestmark = pytest.mark.slow

# PyTorch's profiler categories in memdiff's terms (the mapping).
PYTORCH_TO_MEMDIFF = {"temporary": "autograd", "autograd_detail": "autograd", "unknown": "other", None: "other"}


def record_example(path, *flags: str) -> subprocess.CompletedProcess:
    """`memdiff record` of the example GPT on CPU, in a fresh process as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "memdiff", "record", "-o", str(path), "--", "python", "-m", "memdiff.examples.gpt",
         "--device", "cpu", "--steps", "2", "--batch", "8", "--seq", "128", *flags],
        capture_output=True, text=True, check=True)


@pytest.fixture(scope="module")
def captured(torch, tmp_path_factory):
    """The example GPT recorded on CPU: plain (False), with activation checkpointing (True), and
    with the abandoned debug projections ("debug")."""
    folder = tmp_path_factory.mktemp("capture")
    out = {}
    for key, flags in ((False, []), (True, ["--checkpoint"]), ("debug", ["--debug-projections"])):
        out[key] = str(folder / f"gpt-{key}.pickle")
        record_example(out[key], *flags)
    return out


def pytorch_categories_at(path: str, peak_index: int) -> Dict[str, int]:
    """Bytes per PyTorch category among allocations live after event `peak_index`."""
    live = {}
    for e in decode(path)[0]["device_traces"][0][: peak_index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    totals: Counter = Counter()
    for e in live.values():
        cat = e.get("category")
        totals[PYTORCH_TO_MEMDIFF.get(cat, cat)] += e["size"]
    return dict(totals)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "activation-checkpointing"])
def test_categories_agree_with_pytorch(captured, ckpt):
    summary = read_summary(captured[ckpt], load_rules())
    assert summary.source.generation == "profiler"
    d = summary.devices[0]
    from scenario_suite import PYTORCH_CATEGORY  # recomputed_activation is PyTorch's autograd

    theirs = pytorch_categories_at(captured[ckpt], d.peak_event_index)
    assert sum(theirs.values()) == d.peak_bytes  # the same live set, so the comparison is fair
    ours: Counter = Counter()
    for c, b in d.categories.items():
        ours[PYTORCH_CATEGORY.get(c, c)] += b
    names = sorted(set(theirs) | set(ours))
    agreement = sum(min(theirs.get(c, 0), ours.get(c, 0)) for c in names) / d.peak_bytes
    print(f"\nagreement with PyTorch's categories ({'with' if ckpt else 'without'} checkpointing): {agreement:.1%}")
    print(tabulate([[c, theirs.get(c, 0), ours.get(c, 0)] for c in names],
                   headers=["category", "pytorch bytes", "memdiff bytes"]))
    assert agreement >= 0.99


def test_checkpointing_lowers_the_peak_and_the_top_rows_are_activations(captured):
    rules = load_rules()
    plain, ckpt = (read_summary(captured[k], rules) for k in (False, True))
    p, c = plain.devices[0], ckpt.devices[0]
    assert c.peak_bytes < p.peak_bytes
    assert c.categories["activation"] < p.categories["activation"]
    assert c.categories["optimizer_state"] == p.categories["optimizer_state"]
    rows = diff(plain, ckpt).devices[0].rows
    changed = [r for r in rows if r.delta_bytes][:5]
    assert changed and all(r.status in (SHRANK, GONE) and r.category == "activation" for r in changed)


def test_debug_projections_read_as_new_forward_rows_and_more_optimizer_state(captured):
    from memdiff.examples.gpt import Config

    rules = load_rules()
    clean, debug = (read_summary(captured[k], rules) for k in (False, "debug"))
    rows = diff(clean, debug).devices[0].rows
    c = Config()
    new_params = c.n_layer * (c.n_embd * 4 * c.n_embd + 4 * c.n_embd)  # one Linear(n_embd, 4 n_embd) per layer
    state = next(r for r in rows if r.site == "adam.py:_init_group <- zeros_like")
    assert (state.status, state.delta_bytes) == (GREW, 2 * new_params * 4)  # two fp32 AdamW moments
    assert state.head_count - state.base_count == 2 * 2 * c.n_layer  # (weight, bias) x 2 moments per layer
    top = rows[0]
    assert (top.status, top.site, top.category, top.head_count) == (NEW, "linear.py:forward <- linear", "activation",
                                                                     c.n_layer)
    assert [r for r in rows if r.status == GONE] == []


def test_the_gate_fails_the_debug_projections_against_the_clean_baseline(captured, tmp_path):
    from memdiff.cli import main

    assert main(["baseline", captured[False], "-o", str(tmp_path / "gpt.json"), "--fail-over", "1MiB"]) == 0
    assert main(["gate", captured["debug"], "--baseline", str(tmp_path / "gpt.json")]) == 1
    assert main(["gate", captured[True], "--baseline", str(tmp_path / "gpt.json")]) == 0


def test_the_cuda_route_on_a_torch_without_annotations_still_records(torch, monkeypatch, tmp_path):
    calls = []

    def record_memory_history(enabled="all", context="all", stacks="all", max_entries=1):  # torch 2.1's signature
        calls.append((enabled, stacks))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_memory_history, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [[]]}, raising=False)
    with record(str(tmp_path / "old.pickle"), stacks="python"):
        pass
    assert calls == [("all", "python"), (None, "all")]


def test_record_writes_the_snapshot_even_when_the_block_raises(torch, tmp_path):
    path = tmp_path / "oom.pickle"
    with pytest.raises(RuntimeError, match="simulated OOM"):
        with record(str(path)):
            x = torch.ones(1024, 1024)
            raise RuntimeError("simulated OOM")
    assert read_summary(str(path), load_rules()).devices[0].peak_bytes >= x.numel() * 4


def test_a_cpu_capture_says_whether_its_host_s_half_precision_convolutions_take_onednn(torch, tmp_path):
    """The fp32 run cannot show which path a bf16 or fp16 convolution takes on its host (oneDNN, or
    ATen's _slow_conv2d, whose bias gradient sums through an fp32 copy): the CPU capture writes
    PyTorch's own answers (Convolution.cpp's use_mkldnn: oneDNN built and enabled, and the CPU's
    instructions for it) under memdiff_cpu_host."""
    path = tmp_path / "cpu.pickle"
    with record(str(path)):
        torch.ones(256)
    host = pickle.loads(path.read_bytes())["memdiff_cpu_host"]
    mkldnn = torch.backends.mkldnn
    assert host["onednn_bf16_convolutions"] == (mkldnn.is_available() and mkldnn.enabled
                                                and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert host["onednn_fp16_convolutions"] == (mkldnn.is_available() and mkldnn.enabled
                                                and torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert host["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_record_without_torch_says_how_to_install_it(no_torch, tmp_path):
    with pytest.raises(CaptureError, match=r"capturing needs PyTorch: pip install torch \(without a GPU, its CPU build"):
        with record(str(tmp_path / "x.pickle")):
            pass


def test_record_on_a_torch_without_the_private_api_names_the_version(torch, monkeypatch, tmp_path):
    from torch.cuda import _memory_viz

    monkeypatch.delattr(_memory_viz, "_profile_to_snapshot")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(CaptureError, match=re.escape(f"torch {torch.__version__} lacks torch.cuda._memory_viz._profile_to_snapshot")):
        with record(str(tmp_path / "x.pickle")):
            pass
    assert not (tmp_path / "x.pickle").exists()


def test_memdiff_record_runs_a_script_with_its_arguments(torch, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text("import sys, torch\nkeep = torch.zeros(int(sys.argv[1]))\nprint('ran', sys.argv[1:])\n"
                      "print('the script speaks', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", str(tmp_path / "t.pickle"), "--",
                           "python", str(script), "4096"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ran ['4096']" in done.stdout
    # stderr holds the script's line and memdiff's, not the profiler's own (`USDT:... profiler_start`)
    lines = done.stderr.splitlines()
    assert lines[0] == "the script speaks" and len(lines) == 2, done.stderr
    assert f"wrote {tmp_path / 't.pickle'}" in lines[1]
    d = read_summary(str(tmp_path / "t.pickle"), load_rules()).devices[0]
    assert d.peak_bytes >= 4096 * 4


def test_memdiff_record_passes_on_the_scripts_failure(torch, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torch\nx = torch.ones(10)\nraise SystemExit(7)\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", str(tmp_path / "f.pickle"), "--",
                           "python", str(script)], capture_output=True, text=True)
    assert done.returncode == 7
    assert (tmp_path / "f.pickle").exists()


def test_the_cuda_route_keeps_the_users_symbolizer(torch, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_SYMBOLIZE_MODE", "addr2line")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **_: None, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [[]]}, raising=False)
    with record(str(tmp_path / "mine.pickle")):
        assert os.environ["TORCH_SYMBOLIZE_MODE"] == "addr2line"


def test_the_cuda_route_records_dumps_on_failure_and_stops(torch, monkeypatch, tmp_path):
    # No GPU here: stand in for the allocator-history API to check the calls memdiff makes.
    calls = []
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "stream": 0,
                                                     "frames": [{"filename": "train.py", "line": 3, "name": "f"}]}]]}

    def record_memory_history(enabled="all", context="all", stacks="all", max_entries=1, compile_context=False,
                              global_record_annotations=False, skip_actions=None):  # torch 2.13's signature
        calls.append((enabled, stacks, max_entries, global_record_annotations))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_memory_history, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot, raising=False)
    monkeypatch.delenv("TORCH_SYMBOLIZE_MODE", raising=False)  # and this test's setting goes with it
    from torch.utils import checkpoint

    path = tmp_path / "oom.pickle"
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        with record(str(path), max_entries=5000):
            # Checkpointing's early stop breaks under the allocator's history (torch 2.11): off while recording.
            assert checkpoint._enable_checkpoint_early_stop is False
            # C++ frames named in this process, not by addr2line children a launcher's SIGTERM kills.
            assert os.environ["TORCH_SYMBOLIZE_MODE"] == "fast"
            raise RuntimeError("CUDA out of memory")
    assert checkpoint._enable_checkpoint_early_stop is None  # the user's setting is back
    # stacks="all" by default, and record_function scopes recorded for steps and phases.
    assert calls == [("all", "all", 5000, True), (None, "all", 1, False)]
    assert read_summary(str(path), load_rules()).devices[0].peak_bytes == 512
    assert open(path, "rb").read(2) == b"\x80\x04"  # protocol 4, as pytorch.org/memory_viz reads


def _free_elsewhere(torch, rounds: int) -> None:
    """Tensors made here and dropped on another thread, which the profiler does not follow (as a
    gloo worker drops DDP's broadcast bucket): their frees are never recorded."""
    import queue
    import threading

    inbox: queue.Queue = queue.Queue()

    def worker() -> None:
        while inbox.get() is not None:
            inbox.task_done()
    thread = threading.Thread(target=worker)
    thread.start()
    for _ in range(rounds):
        inbox.put(torch.ones(256, 256) * 2)
        inbox.join()
        y = torch.zeros(256, 256) + 1
        del y
    inbox.put(None)
    thread.join()


@pytest.mark.parametrize("error", [AssertionError("duplicate outputs: aten::ones {...}"),
                                   KeyError("(id=495: 0x7f0c36cb1040 (557) (cpu), 0)")])
def test_frees_on_a_thread_the_profiler_does_not_follow_still_leave_a_snapshot(torch, monkeypatch, tmp_path, capfd,
                                                                             error):
    from torch.cuda import _memory_viz

    # Once an unseen free's address is handed out again, torch's converter finds two allocations
    # and no free and refuses the run, as here (AssertionError); under FSDP2's gloo threads it
    # looks up a tensor version it never saw (KeyError, rank 0 of a 2-rank CPU run). Whether
    # either happens is up to malloc and the threads, so the refusal is made certain here.
    def refuses(profile):
        raise error
    monkeypatch.setattr(_memory_viz, "_profile_to_snapshot", refuses)
    path = tmp_path / "elsewhere.pickle"
    with record(str(path)):
        _free_elsewhere(torch, 20)
    assert "torch's memory profiler refused this run's records" in capfd.readouterr().err
    trace = decode(str(path))[0]["device_traces"][-1]
    made = [e for e in trace if e["action"] == "alloc" and e["size"] == 256 * 256 * 4]
    assert len(made) == 20 * 4  # ones, *2, zeros, +1: every allocation, each with its Python stack
    assert all(any("_free_elsewhere" in f["name"] for f in e["frames"]) for e in made)
    assert read_summary(str(path), load_rules()).devices[0].peak_bytes >= 2 * 256 * 256 * 4


def test_the_allocation_events_give_the_numbers_torchs_converter_gives(torch, tmp_path):
    from torch.cuda import _memory_viz

    from memdiff.examples.gpt import Config, train
    from memdiff.recording.capture import from_allocations

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                      record_shapes=True, with_stack=True)
    with profiler:
        train(Config(n_layer=2, n_embd=64, vocab_size=512, block_size=64), steps=2, batch=4, seq=32, device="cpu")
    summaries = []
    for name, snapshot in (("torch", _memory_viz._profile_to_snapshot(profiler)),
                           ("events", from_allocations(torch, profiler))):
        with open(tmp_path / f"{name}.pickle", "wb") as f:
            pickle.dump(snapshot, f, protocol=4)
        summaries.append(read_summary(str(tmp_path / f"{name}.pickle"), load_rules()).devices[0])
    ours, theirs = summaries[1], summaries[0]
    assert (ours.peak_bytes, ours.static_bytes) == (theirs.peak_bytes, theirs.static_bytes)
    assert ours.allocated_bytes_at_dump == theirs.allocated_bytes_at_dump


def test_backward_memory_is_named_by_its_autograd_node_and_nothing_else_changes(torch, monkeypatch, tmp_path):
    """torch's converter ends every backward stack at run_backward; memdiff's CPU route names the
    node and its op there (as CUDA stacks do) and leaves every other entry as torch wrote it."""
    import copy

    from torch.cuda import _memory_viz

    real = _memory_viz._profile_to_snapshot
    theirs = {}

    def keep(profile):
        snapshot = real(profile)
        theirs.update(copy.deepcopy(snapshot))
        return snapshot
    monkeypatch.setattr(_memory_viz, "_profile_to_snapshot", keep)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "mlp.pickle"
    with record(str(path)):
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    ours = decode(str(path))[0]
    theirs_trace, ours_trace = theirs["device_traces"][-1], ours["device_traces"][-1]
    assert len(ours_trace) == len(theirs_trace)
    named = 0
    for t, o in zip(theirs_trace, ours_trace):
        assert {k: v for k, v in o.items() if k != "frames"} == {k: v for k, v in t.items() if k != "frames"}
        nodes = [f["name"] for f in o["frames"] if f["name"].startswith("autograd::engine::evaluate_function: ")]
        if not nodes:
            assert o["frames"] == t["frames"]
            continue
        named += o["action"] == "alloc"
        assert "run_backward" in t["frames"][0]["name"]  # where torch's stack stops
        assert [f for f in o["frames"] if f in t["frames"]] == t["frames"]
    gradients = [e for e in ours_trace if e["action"] == "alloc" and e.get("category") == "gradient" and e["frames"]]
    # The weights' gradients come out of the matrix products' backward; the biases' out of its sum.
    assert {e["size"] for e in gradients} == {p.numel() * 4 for p in model.parameters()}
    assert all(e["frames"][1]["name"] == "autograd::engine::evaluate_function: AddmmBackward0" and
               e["frames"][0]["name"] in ("aten::mm", "aten::sum") for e in gradients)
    assert named >= len(gradients)
    device = read_summary(str(path), load_rules()).devices[0]
    assert {g.site for g in device.groups if g.category == "gradient"} == {"AddmmBackward0 <- mm", "AddmmBackward0 <- sum"}
    backward = next(p for p in device.phase_peaks if p.phase == "backward")
    assert "LogSoftmaxBackward0 <- _log_softmax_backward_data" in {g.site for g in backward.groups}


def test_frames_of_code_that_ended_before_the_recording_keep_their_names(torch, tmp_path):
    """A module imported inside the recording allocates as it loads, from its cached bytecode, as a
    user's package does on any machine that has run it before. Its module code is freed once the
    import ends; torch's profiler keeps only pointers to that code's names and reads them when the
    recording stops. Strings made after the import take over the freed memory."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tables.py").write_text("import torch\n\nTABLE = torch.ones(1024, 1024)\n")
    (package / "train.py").write_text(
        "from mypkg import tables\n"
        "junk = ['j%07d' % i for i in range(300_000)]  # strings the size of '<module>'\n"
        "print(float(tables.TABLE.sum()))\n")
    subprocess.run([sys.executable, "-m", "compileall", "-q", "mypkg"], cwd=tmp_path, check=True)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", "t.pickle", "--", "python", "-m",
                           "mypkg.train"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1048576.0" in done.stdout
    trace = decode(str(tmp_path / "t.pickle"))[0]["device_traces"][-1]
    table = [e for e in trace if e["action"] == "alloc" and e["size"] == 4 * 1024 * 1024]
    assert table, "the table's allocation was not recorded"
    names = [f["name"] for f in table[0]["frames"]]
    assert any(re.search(r"mypkg/tables\.py\(\d+\): <module>$", n) for n in names), names
    assert any(re.search(r"mypkg/train\.py\(\d+\): <module>$", n) for n in names), names


def test_a_frame_name_torch_can_no_longer_read_is_marked_and_the_stack_kept(torch):
    """Code freed during a recording without passing through exec leaves torch's profiler reading
    its names from freed memory; the allocation's stack keeps that frame, marked, and its others."""
    from torch._C._profiler import _EventType

    from memdiff.recording.capture import UNREADABLE, _stack

    class Event:
        def __init__(self, tag, name, parent=None):
            self.tag, self._name, self.parent = tag, name, parent

        @property
        def name(self):
            if self._name is None:
                raise UnicodeDecodeError("utf-8", b"\x96", 0, 1, "invalid start byte")
            return self._name

    script = Event(_EventType.PyCall, "train.py(3): <module>")
    freed = Event(_EventType.PyCall, None, script)
    forward = Event(_EventType.PyCall, "model.py(9): forward", freed)
    op = Event(_EventType.TorchOp, "aten::empty", forward)
    allocation = Event(_EventType.Allocation, "[memory]", op)
    assert [f["name"] for f in _stack(allocation, _EventType)] == [
        "model.py(9): forward", UNREADABLE, "train.py(3): <module>"]
