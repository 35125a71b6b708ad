"""Categories: built-in rules on realistic stacks, user rules, and the real snapshots."""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import replace

import pytest
from conftest import alloc, py_frames

from memdiff.analyse.classify import category_of, load_rules
from memdiff.cli import main
from memdiff.errors import InputError
from memdiff.model import Frame, Group
from memdiff.read.frames import StackNormalizer
from memdiff.read.inputs import read_summary

SP = "/venv/lib/python3.12/site-packages/"
NATIVE_TAIL = [{"name": "__clone", "filename": "??", "line": 0}]


def native(*names):
    return [{"name": n, "filename": "??", "line": 0} for n in names]


def group_for(raw_frames, freed=False, before_trace=False) -> Group:
    """A group as the normalizer makes it from raw snapshot frames."""
    s = StackNormalizer().stack(raw_frames, freed=freed, before_trace=before_trace)
    return Group(signature=s.signature, site=s.site, frames=list(s.frames), count=1, bytes=1)


CASES = {
    "parameter: nn module constructor": (
        native("at::_ops::empty_memory_format::call(c10::ArrayRef<long>)")
        + py_frames(SP + "torch/nn/modules/linear.py:99:__init__", "train.py:8:<module>"), "parameter"),
    "parameter: model.to(device)": (
        native("at::_ops::_to_copy::call(at::Tensor const&)", "at::_ops::to_dtype_layout::call(at::Tensor const&)")
        + py_frames(SP + "torch/nn/modules/module.py:1340:convert", SP + "torch/nn/modules/module.py:900:_apply",
                    SP + "torch/nn/modules/module.py:1355:to", "train.py:9:<module>"), "parameter"),
    "gradient: AccumulateGrad": (
        native("at::_ops::new_empty_strided::call(at::Tensor const&)",
               "torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)",
               "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)"), "gradient"),
    "optimizer_state: Adam _init_group": (
        native("at::_ops::zeros_like::call(at::Tensor const&)")
        + py_frames(SP + "torch/optim/adam.py:139:_init_group", SP + "torch/optim/adam.py:214:step",
                    SP + "torch/optim/optimizer.py:509:wrapper", "train.py:20:<module>"), "optimizer_state"),
    "optimizer_state: custom optimizer step": (
        native("at::_ops::zeros_like::call(at::Tensor const&)")
        + py_frames("mypkg/lion.py:40:step", SP + "torch/optim/optimizer.py:509:wrapper", "train.py:20:<module>"),
        "optimizer_state"),
    "optimizer_temporary: the update's math": (
        py_frames(SP + "torch/optim/adam.py:347:_single_tensor_adam", SP + "torch/optim/adam.py:214:step",
                  SP + "torch/optim/optimizer.py:509:wrapper"), "optimizer_temporary"),
    "autograd: backward node": (
        native("at::_ops::mm::call(at::Tensor const&, at::Tensor const&)",
               "torch::autograd::generated::AddmmBackward0::apply(std::vector<at::Tensor>&&)",
               "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)"), "autograd"),
    "autograd: profiler backward": (
        [{"filename": "none", "line": 0, "name": "<built-in method run_backward of torch._C._EngineBase object at 0x7f>"},
         {"filename": "none", "line": 0, "name": "torch/autograd/graph.py(966): _engine_run_backward"},
         {"filename": "none", "line": 0, "name": "train.py(30): <module>"}], "autograd"),
    "activation: module forward": (
        native("at::_ops::addmm::call(at::Tensor const&)", "at::_ops::linear::call(at::Tensor const&)")
        + py_frames(SP + "torch/nn/modules/linear.py:125:forward", "model.py:40:forward", "train.py:25:<module>"),
        "activation"),
    "activation: checkpoint recompute in backward": (
        native("at::_ops::addmm::call(at::Tensor const&)")
        + py_frames(SP + "torch/nn/modules/linear.py:125:forward", "model.py:40:forward",
                    SP + "torch/utils/checkpoint.py:1100:recompute_fn")
        + native("torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)"),
        "activation"),
    "activation: loss outside forward": (
        native("at::_ops::sub_Tensor::call(at::Tensor const&)")
        + py_frames("nn_utils.py:11:log_softmax", "nn_utils.py:17:cross_entropy", "train.py:69:<module>"),
        "activation"),
    "parameter: transformers 5 loads a weight in its thread pool": (
        # from_pretrained(..., device_map="cuda"): the worker's own stack, down to threading's bootstrap,
        # without the from_pretrained that submitted the job (a real GPU's trace has the same)
        native("at::_ops::_to_copy::call(at::Tensor const&)", "at::_ops::to_dtype_layout::call(at::Tensor const&)")
        + py_frames(SP + "transformers/core_model_loading.py:1323:_materialize_copy",
                    SP + "transformers/core_model_loading.py:1345:_job",
                    "/usr/lib/python3.11/concurrent/futures/thread.py:58:run",
                    "/usr/lib/python3.11/concurrent/futures/thread.py:83:_worker",
                    "/usr/lib/python3.11/threading.py:982:run",
                    "/usr/lib/python3.11/threading.py:1045:_bootstrap_inner",
                    "/usr/lib/python3.11/threading.py:1002:_bootstrap"), "parameter"),
    "input: batch moved to the device by a prefetching thread": (
        native("at::_ops::_to_copy::call(at::Tensor const&)", "at::_ops::to_dtype_layout::call(at::Tensor const&)")
        + py_frames("train.py:12:prefetch", "/usr/lib/python3.11/threading.py:982:run",
                    "/usr/lib/python3.11/threading.py:1045:_bootstrap_inner",
                    "/usr/lib/python3.11/threading.py:1002:_bootstrap"), "input"),
    "input: batch moved to the device": (
        native("at::_ops::_to_copy::call(at::Tensor const&)", "at::_ops::to_dtype_layout::call(at::Tensor const&)")
        + py_frames("train.py:22:<module>"), "input"),
    "input: data loader": (
        py_frames(SP + "torch/utils/data/_utils/pin_memory.py:18:pin_memory", "train.py:22:<module>"), "input"),
    "input: random batch made by the loop": (
        native("at::_ops::randint::call(long, c10::ArrayRef<long>)") + py_frames("train.py:21:<module>"), "input"),
    "communication: NCCL": (
        native("c10d::ProcessGroupNCCL::allreduce(std::vector<at::Tensor>&)")
        + py_frames(SP + "torch/distributed/distributed_c10d.py:2100:all_reduce", "train.py:40:<module>"),
        "communication"),
    "other: nothing telling": (py_frames("utils.py:3:helper", "train.py:5:<module>"), "other"),
}


def test_the_shipped_rules_satisfy_their_schema():
    from importlib import resources

    from memdiff.read.schema import validate

    text = resources.files("memdiff").joinpath("rules", "categories.json").read_text()
    validate("categories.json", json.loads(text), "rules")


@pytest.mark.parametrize("case", sorted(CASES))
def test_builtin_rules(case):
    frames, category = CASES[case]
    assert category_of(group_for(frames), load_rules()) == category


@pytest.mark.parametrize("frames, category", [
    (py_frames(SP + "torch/optim/optimizer.py:900:zero_grad", "train.py:30:<module>"), "gradient"),
    (py_frames("cs336_basics/optimizer.py:73:step", SP + "torch/optim/optimizer.py:533:wrapper"), "optimizer_state"),
    (native("c10::TensorImpl::~TensorImpl()",
            "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)"), "activation"),
    (py_frames("model.py:40:forward"), "other"),  # allocation rules never apply to a free's stack
])
def test_memory_known_by_the_stack_that_freed_it(frames, category):
    assert category_of(group_for(frames, freed=True, before_trace=True), load_rules()) == category


RECOMPUTE = (native("at::_ops::addmm::call(at::Tensor const&)")
             + py_frames(SP + "torch/nn/modules/linear.py:125:forward", "model.py:40:forward",
                         SP + "torch/utils/checkpoint.py:1100:recompute_fn")
             + native("torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)"))


@pytest.mark.parametrize("born, category", [
    ("backward", "recomputed_activation"),  # the forward run again for the backward: PyTorch's autograd
    ("forward", "activation"),  # what the checkpointed forward keeps
])
def test_checkpointing_s_recomputation_is_told_by_when_it_is_made(born, category):
    group = replace(group_for(RECOMPUTE), lifetime={"born": born, "freed": "backward", "outlives": "phase"})
    assert category_of(group, load_rules()) == category


BACKWARD_NODE = [{"filename": "none", "line": 0, "name": name} for name in (
    "autograd::engine::evaluate_function: AddmmBackward0",
    "<built-in method run_backward of torch._C._EngineBase object>", "train.py(30): <module>")]


@pytest.mark.parametrize("frames, born, category", [
    # A gradient kept from before recording, accumulated into in place by the backward.
    (BACKWARD_NODE, "before_trace", "gradient"),
    # The same stack standing in for memory made in the trace is no such gradient.
    (BACKWARD_NODE, "forward", "activation"),
])
def test_an_update_in_place_by_the_backward_is_a_gradient_s(frames, born, category):
    s = StackNormalizer()
    s.mark_updates([frames])
    stack = s.stack(frames, freed=True, before_trace=True)
    group = Group(signature=stack.signature, site=stack.site, frames=list(stack.frames), count=1, bytes=1,
                  lifetime={"born": born, "freed": "never", "outlives": "trace"})
    assert stack.site.startswith("updated in place at ")
    assert category_of(group, load_rules()) == category


def test_stackless_memory():
    rules = load_rules()
    assert category_of(group_for(None, before_trace=True), rules) == "untracked"
    assert category_of(group_for(None), rules) == "other"


def test_user_rules_take_priority_and_may_add_categories(tmp_path):
    frames = native("at::_ops::cat::call(c10::ArrayRef<at::Tensor>)") + py_frames("model.py:88:update_kv_cache",
                                                                                 "model.py:40:forward")
    (tmp_path / "rules.toml").write_text('[[rules]]\ncategory = "kv_cache"\nframes = [{name = "kv_cache"}]\n')
    (tmp_path / "rules.json").write_text(json.dumps({"rules": [{"category": "cache", "frames": [{"file": "model"}]}]}))
    assert category_of(group_for(frames), load_rules()) == "activation"
    assert category_of(group_for(frames), load_rules([str(tmp_path / "rules.toml")])) == "kv_cache"
    both = load_rules([str(tmp_path / "rules.json"), str(tmp_path / "rules.toml")])
    assert category_of(group_for(frames), both) == "cache"  # equal priority: the earlier file wins
    assert category_of(group_for(frames), load_rules(custom_profile='{"kv": "update_kv"}')) == "kv"


def test_a_class_test_reads_the_class_of_the_frames_line_from_its_file(tmp_path, monkeypatch):
    # A trace names `__init__` only: the class that holds the line is read from the script, found from
    # the folder it ran in. The EMA's clone and its own to()'s copy read `other` by the built-in rule,
    # the model's weight `parameter`; a user rule names a class of its own; where the file is not here,
    # neither applies.
    (tmp_path / "train.py").write_text(
        "class Net:\n    def __init__(self):\n        self.w = make()\n"
        "class ModelEMA:\n    def __init__(self, net):\n        self.w = net.w.clone()\n"
        "class Ref:\n    def __init__(self, net):\n        self.w = net.w.clone()\n"
        "class ModelEma:\n    def to(self, device):\n        self.w = self.w.to(device)\n")

    def group(op: str, line: int, name: str = "__init__") -> Group:
        # as a summary holds it: the path relative, as the script ran (`python train.py`)
        frames = [Frame("", 0, f"at::_ops::{op}::call"), Frame("train.py", line, name), Frame("train.py", 20, "main")]
        return Group(signature=f"{op}{line}", site=f"train.py:{name} <- {op}", frames=frames, count=1, bytes=1)

    ema, ref, net, moved = group("clone", 6), group("clone", 9), group("empty", 3), group("_to_copy", 12, "to")
    (tmp_path / "rules.toml").write_text('[[rules]]\ncategory = "reference"\nframes = [{class = "^Ref$"}]\n')
    monkeypatch.chdir(tmp_path)
    rules = load_rules([str(tmp_path / "rules.toml")])
    assert [category_of(g, rules) for g in (ema, ref, net, moved)] == ["other", "reference", "parameter", "other"]
    monkeypatch.chdir(tmp_path.parent)
    assert [category_of(g, rules) for g in (ema, ref, net, moved)] == ["parameter", "parameter", "parameter", "input"]

@pytest.mark.parametrize("content, message", [
    ('{"rules": [{"category": "a", "frames": [{"name": "ok"}]}, {"category": "b", "frames": [{"name": "KV["}]}]}',
     "rule 2 (b): invalid regex 'KV[': unterminated character set"),
    ('{"rules": [{"category": "a", "frames": [{"colour": "x"}]}]}', "not valid memdiff rules: rules.0.frames.0"),
    ('{"rules": [{"category": "a"}]}', "not valid memdiff rules: rules.0"),
    # A schema's pattern is said (it read "a value that fails the schema's 'pattern' rule").
    ('{"rules": [{"category": "", "frames": [{"name": "x"}]}]}', "not valid memdiff rules: rules.0.category: a value "
                                                                 "that does not match the schema's pattern "
                                                                 "^[A-Za-z][A-Za-z0-9_.-]*$"),
    ('{"rules": [', "invalid JSON"),
])
def test_invalid_rules_name_the_problem(tmp_path, content, message):
    path = tmp_path / "rules.json"
    path.write_text(content)
    with pytest.raises(InputError) as e:
        load_rules([str(path)])
    assert e.value.path == str(path) and message in e.value.message


def test_invalid_rules_exit_2_from_the_cli(tmp_path, capsys):
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [[alloc(1, 8, py_frames("m.py:1:f"))]]}, 4))
    assert main(["peak", str(snap), "--custom-profile", '{"bad": "("}']) == 2
    err = capsys.readouterr().err
    assert err.startswith("memdiff: --custom-profile: rule 1 (bad): invalid regex '('") and err.count("\n") == 1


def test_a_toml_rules_file_with_a_byte_order_mark_is_read(tmp_path):
    # A Windows editor's BOM read as 'invalid TOML: Invalid statement (at line 1, column 1)'.
    path = tmp_path / "rules.toml"
    path.write_bytes('[[rules]]\ncategory = "kv_cache"\nframes = [{name = "KVCache"}]\n'.encode("utf-8-sig"))
    assert [r.category for r in load_rules([str(path)])][:1] == ["kv_cache"]


def _rules_file(path, count: int):
    """A rules file of `count` rules, one per layer's function, as a generator script would write it."""
    path.write_text(json.dumps({"rules": [{"category": f"layer{k}", "frames": [{"name": f"^layer_{k}_forward$"}]}
                                          for k in range(count)]}))
    return str(path)


def test_more_user_rules_than_the_cap_are_refused_before_any_is_compiled(tmp_path, capsys):
    """Each rule is searched in every frame: 20,000 rules made `memdiff peak` of a real run take 23 s."""
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [[alloc(1, 8, py_frames("m.py:1:f"))]]}, 4))
    huge = _rules_file(tmp_path / "huge.json", 20_000)
    assert main(["peak", str(snap), "--rules", huge]) == 2
    err = capsys.readouterr().err
    assert err == (f"memdiff: {huge}: 20,000 rules: at most 1,000 user rules are read, as each one is searched in "
                   f"every frame of the run; merge the rules of a category into one regex (`attn|mlp`)\n")
    first, second = _rules_file(tmp_path / "a.json", 600), _rules_file(tmp_path / "b.json", 401)
    with pytest.raises(InputError, match=r"^.*b\.json: 401 rules \(with the rules files before it, 1,001\): at most"):
        load_rules([first, second])
    profile = json.dumps({f"layer{k}": f"layer_{k}" for k in range(1_001)})
    with pytest.raises(InputError, match=r"^--custom-profile: 1,001 rules: at most 1,000"):
        load_rules(custom_profile=profile)


def test_custom_profile_shows_in_the_peak_table(tmp_path, capsys):
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [[alloc(1, 2**20, py_frames("kv.py:1:grow"))]]}, 4))
    assert main(["peak", str(snap), "--custom-profile", '{"kv_cache": "^kv\\\\.py$"}']) == 0
    out = capsys.readouterr().out
    assert re.search(r"^kv_cache +1\.00 MiB +100\.0%$", out, re.MULTILINE)


# --- the real snapshots ---------------------------------------------------------------------------

TRAINING = ["cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle",
            "tinyllama-lora-fwdbwd.pickle", "linear-grad.pickle", "cs336-windows.pickle"]


@pytest.mark.parametrize("name", TRAINING)
def test_nine_tenths_of_stacked_bytes_get_a_category(shared, name):
    for d in read_summary(str(shared / name), load_rules()).devices:
        stacked = [g for g in d.groups if not g.site.startswith("<no stack")]
        other = sum(g.bytes for g in stacked if g.category == "other")
        assert other <= 0.1 * sum(g.bytes for g in stacked)
        assert sum(d.categories.values()) == d.peak_bytes


def test_adamw_state_of_the_cs336_run(shared):
    d = read_summary(str(shared / "cs336-medium-ctx128-train.pickle"), load_rules()).devices[0]
    assert d.categories["optimizer_state"] > 3 * 2**30
    assert (d.phase_at_peak, d.scope_at_peak) == ("optimizer", "Optimizer.step#AdamW.step")
    by_site = {g.site: g for g in d.groups}
    assert by_site["AccumulateGrad <- new_empty_strided"].category == "gradient"
    # The embedding's gradient is made by the index op's backward, not AccumulateGrad: only its
    # lifetime (allocated in backward, kept after it: the trace ends in the optimizer step) says
    # it is a gradient.
    embedding = by_site["IndexBackward0 <- new_zeros"]
    assert (embedding.category, embedding.lifetime) == (
        "gradient", {"born": "backward", "freed": "never", "outlives": "trace"})


def test_the_differ_shows_category_deltas(shared, capsys):
    code = main([str(shared / "cs336-medium-ctx128-train.pickle"), str(shared / "cs336-medium-ctx256-train.pickle")])
    out = capsys.readouterr().out
    assert code == 1
    table = out[out.index("category"):].split("\n\n")[0]
    assert "activation" in table and "+3.71 GiB" in table
    assert "gradient" in table and "-1.58 GiB" in table


def test_an_op_s_scratch_is_what_pytorch_calls_temporary(torch, tmp_path):
    """Issue 60: a classifier trained on a frozen attention body, recorded on CPU. The math path of
    scaled_dot_product_attention (an attention mask keeps it there) makes scratch it frees before
    it returns, which PyTorch's profiler calls `temporary` (the category it writes on each
    allocation); memdiff, reading stacks and the trace's order alone, calls the same bytes so, and
    nothing else: the frozen layers' outputs, freed by the next layer, stay activations. The
    optimizer step's own temporaries are `optimizer_temporary` (docs/categories.md)."""
    import numpy as np
    from torch import nn
    from torch.nn import functional as F

    from memdiff.predict.forecast.course import read_course
    from memdiff.recording.capture import record

    class Attention(nn.Module):
        def __init__(self, width: int = 64, heads: int = 4) -> None:
            super().__init__()
            self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

        def forward(self, x, mask):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d))

    torch.manual_seed(0)
    body, head = nn.ModuleList([Attention(), Attention()]), nn.Linear(64, 2)
    body.requires_grad_(False)
    optimizer = torch.optim.AdamW(head.parameters())
    x, mask, y = torch.randn(4, 32, 64), torch.zeros(4, 1, 32, 32), torch.tensor([0, 1, 0, 1])
    path = tmp_path / "frozen-body.pickle"
    with record(str(path)):
        for _ in range(2):
            h = x
            for layer in body:
                h = layer(h, mask)
            F.cross_entropy(head(h[:, 0]), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    course = read_course(str(path), 0, load_rules()).devices[0]
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    ours = np.array(course.categories, dtype=object)[course.category]
    pairs = {}  # (PyTorch's category, memdiff's) -> bytes
    for k in np.flatnonzero(~course.before).tolist():
        key = (trace[int(course.start[k])]["category"], ours[k])
        pairs[key] = pairs.get(key, 0) + int(course.size[k])
    temporary = {key: size for key, size in pairs.items() if "temporary" in key}
    assert temporary.get(("temporary", "temporary"), 0) >= 8 << 10, pairs
    assert set(temporary) <= {("temporary", "temporary"), ("temporary", "optimizer_temporary")}, pairs


ACCUMULATED = native("at::_ops::mm::call(at::Tensor const&, at::Tensor const&)",
                     "torch::autograd::generated::AddmmBackward0::apply(std::vector<at::Tensor>&&)",
                     "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)")


@pytest.mark.parametrize("freed, category", [
    # zero_grad(set_to_none=False): a .grad made by a backward before the trace (its entries fell out
    # of the ring buffer, or history was on before a warm-up step) is still live at the dump.
    ("never", "gradient"),
    # zero_grad(set_to_none=True) frees it in the step, or the next forward's zero_grad does.
    ("optimizer", "gradient"),
    ("forward", "gradient"),
    # freed by the trace's first backward: a backward's buffer in flight when the trace starts.
    ("backward", "autograd"),
])
def test_a_backward_s_allocation_older_than_the_trace_that_outlives_its_backward_is_a_gradient(freed, category):
    outlives = "trace" if freed == "never" else "none"
    group = replace(group_for(ACCUMULATED, before_trace=True),
                    lifetime={"born": "before_trace", "freed": freed, "outlives": outlives})
    assert category_of(group, load_rules()) == category
