"""Stack signatures: stable across machines, install prefixes, Python versions and line shifts."""

from __future__ import annotations

import copy

import pytest

from memdiff.model import Frame
from memdiff.read import accel
from memdiff.read.frames import PerFrames, StackNormalizer, normalize_path, relativize

ALLOCATOR = [
    {"name": "torch::unwind::unwind()", "filename": "??", "line": 0},
    {"name": "torch::CapturedTraceback::gather(bool, bool, bool)", "filename": "??", "line": 0},
    {"name": "torch::cuda::(anonymous namespace)::gather_with_cpp()", "filename": "memory_snapshot.cpp", "line": 0},
    {"name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)",
     "filename": "CUDACachingAllocator.cpp", "line": 0},
]


def mixed_stack(prefix: str, sep: str = "/", line_shift: int = 0, py312: bool = True,
                project: str = "/home/a/proj"):
    """A CUDA stack as stacks='all' records it: allocator, aten ops, interpreter, Python frames."""
    site = f"{prefix}{sep}site-packages{sep}torch{sep}optim{sep}adam.py"
    interp = (["_PyEval_EvalFrameDefault", "PyObject_Call", "PyType_GetModule", "_PyObject_MakeTpCall"] if py312
              else ["_PyEval_EvalFrameDefault", "cfunction_call", "method_vectorcall_VARARGS_KEYWORDS"])
    return ALLOCATOR + [
        {"name": "at::_ops::empty_like::call(at::Tensor const&, std::optional<c10::ScalarType>)", "filename": "??", "line": 0},
        {"name": "at::native::zeros_like(at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "at::_ops::zeros_like::call(at::Tensor const&, std::optional<c10::ScalarType>)", "filename": "??", "line": 0},
        {"name": "torch::autograd::THPVariable_zeros_like(_object*, _object*, _object*)", "filename": "python_torch_functions_0.cpp", "line": 0},
    ] + [{"name": n, "filename": "??", "line": 0} for n in interp] + [
        {"name": "_init_group", "filename": site, "line": 139 + line_shift},
        {"name": "step", "filename": site, "line": 214 + line_shift},
        {"name": "wrapper", "filename": site.replace("adam.py", "optimizer.py"), "line": 509 + line_shift},
        {"name": "<module>", "filename": f"{project}{sep}train.py", "line": 7 + line_shift},
        {"name": "_run_code", "filename": f"{prefix}{sep}lib{sep}python3.12{sep}runpy.py", "line": 88},
        {"name": "__libc_start_main", "filename": "??", "line": 0},
        {"name": "_start", "filename": "??", "line": 0},
    ]


def sig(frames, freed=False):
    return StackNormalizer().stack(frames, freed=freed).signature


def test_signature_ignores_install_prefix_os_python_version_and_lines():
    linux = mixed_stack("/home/a/.venv/lib/python3.12")
    windows = mixed_stack("D:\\Dev\\x\\.venv\\Lib", sep="\\", py312=False, project="D:\\Dev\\x")
    shifted = mixed_stack("/opt/conda/lib/python3.10", line_shift=17, project="/work/ci/checkout")
    assert sig(linux) == sig(windows) == sig(shifted)


def test_signature_changes_when_the_code_path_changes():
    base = mixed_stack("/usr/lib/python3.12")
    other_fn = copy.deepcopy(base)
    other_fn[-6]["name"] = "_init_state"
    other_op = copy.deepcopy(base)
    other_op[6]["name"] = "at::_ops::ones_like::call(at::Tensor const&)"
    assert len({sig(base), sig(other_fn), sig(other_op)}) == 3


def test_a_free_stack_never_shares_a_signature_with_an_allocation_stack():
    frames = mixed_stack("/x")
    assert sig(frames) != sig(frames, freed=True)


def test_site_and_display_frames_drop_noise_and_keep_landmarks():
    stack = StackNormalizer().stack(mixed_stack("/home/a/.venv/lib/python3.12"))
    assert stack.site == "adam.py:_init_group <- zeros_like"
    assert [(f.file, f.name) for f in stack.frames] == [
        ("", "at::_ops::empty_like::call"),
        ("", "at::_ops::zeros_like::call"),
        ("torch/optim/adam.py", "_init_group"),
        ("torch/optim/adam.py", "step"),
        ("torch/optim/optimizer.py", "wrapper"),
        ("/home/a/proj/train.py", "<module>"),
    ]


def test_a_site_in_a_packages_init_names_its_package():
    # `__init__.py` alone is one of hundreds of files: `mypkg/__init__.py` says whose
    frames = ALLOCATOR + [
        {"name": "at::_ops::empty::call(c10::ArrayRef<long>)", "filename": "??", "line": 0},
        {"name": "make_cache", "filename": "/home/a/proj/mypkg/__init__.py", "line": 12},
        {"name": "<module>", "filename": "/home/a/proj/train.py", "line": 3},
    ]
    assert StackNormalizer().stack(frames).site == "mypkg/__init__.py:make_cache <- empty"
    frames[-2]["filename"] = "/home/a/proj/mypkg/cache.py"
    assert StackNormalizer().stack(frames).site == "cache.py:make_cache <- empty"


def test_backward_stacks_are_labelled_by_their_autograd_node():
    frames = ALLOCATOR + [
        {"name": "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "torch::autograd::generated::AddmmBackward0::apply(std::vector<at::Tensor>&&)", "filename": "??", "line": 0},
        {"name": "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)", "filename": "??", "line": 0},
        {"name": "std::error_code::default_error_condition() const", "filename": "??", "line": 0},
        {"name": "__clone", "filename": "??", "line": 0},
    ]
    stack = StackNormalizer().stack(frames)
    assert stack.site == "AddmmBackward0 <- mm"
    assert [f.name for f in stack.frames] == [
        "at::_ops::mm::call", "torch::autograd::generated::AddmmBackward0::apply",
        "torch::autograd::Engine::evaluate_function"]


def test_cpu_backward_stacks_read_as_cuda_ones():
    """memdiff's CPU route names the node and its op in the profiler's words (capture._stack)."""
    def profiler(*names: str):
        return [{"filename": "none", "line": 0, "name": n} for n in names]
    engine = ("<built-in method run_backward of torch._C._EngineBase object at 0x7f4fc35a7010>",
              "torch/autograd/graph.py(966): _engine_run_backward", "torch/_tensor.py(566): backward",
              "/home/a/proj/train.py(88): main")
    stack = StackNormalizer().stack(profiler("aten::mm", "autograd::engine::evaluate_function: AddmmBackward0",
                                             *engine))
    assert stack.site == "AddmmBackward0 <- mm"
    accumulate = StackNormalizer().stack(profiler("aten::clone",
                                                  "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
                                                  *engine))
    assert accumulate.site == "AccumulateGrad <- clone"
    assert StackNormalizer().stack(profiler(*engine)).site == "graph.py:_engine_run_backward <- run_backward"


def test_hex_addresses_in_names_do_not_split_groups():
    a = [{"filename": "none", "line": 0, "name": "<built-in method mul_ of Parameter object at 0x7f6af9259d10>"},
         {"filename": "none", "line": 0, "name": "torch/optim/adam.py(347): _single_tensor_adam"}]
    b = copy.deepcopy(a)
    b[0]["name"] = "<built-in method mul_ of Parameter object at 0x55d0aa01ff00>"
    assert sig(a) == sig(b)


def test_profiler_module_instance_numbers_do_not_split_groups():
    def frames(n):
        return [{"filename": "none", "line": 0, "name": "<built-in function linear>"},
                {"filename": "none", "line": 0, "name": "torch/nn/modules/linear.py(130): forward"},
                {"filename": "none", "line": 0, "name": f"nn.Module: Linear_{n}"}]
    assert sig(frames(0)) == sig(frames(3))


def test_frames_are_normalized_once_per_distinct_sequence_of_frames():
    shared = mixed_stack("/x")
    normalizer = StackNormalizer()
    for _ in range(1000):
        normalizer.stack(shared)
    # Each event's own list of the same (memo-shared) frame dicts, as real snapshots hold them;
    # the lists stay referenced, as the snapshot keeps them while it is normalized.
    own_list, other_frames = list(shared), copy.deepcopy(shared)
    assert normalizer.stack(own_list) is normalizer.stack(shared)
    assert normalizer.computed == 1
    normalizer.stack(other_frames)  # equal frames, but other objects: computed again
    normalizer.stack(shared, freed=True)
    assert normalizer.computed == 3


@pytest.mark.parametrize("pure", [False, True], ids=["accelerated", "pure"])
def test_a_value_per_frames_is_computed_once_per_sequence_of_frame_objects(monkeypatch, pure):
    if pure:
        monkeypatch.setenv("MEMDIFF_PURE", "1")
    elif accel.reader() is None:
        pytest.skip("the accelerator is not built or MEMDIFF_PURE is set")
    frame = {"filename": "model.py", "line": 1, "name": "forward"}
    seen = []
    per = PerFrames(lambda frames, extra: seen.append(len(frames)) or len(seen))
    lists = [[frame] * 19_999 for _ in range(50)]  # what pickle memo references make of one deep stack
    assert {per.get(frames) for frames in lists} == {1}
    # lists are told apart by identity only while they live: the snapshot keeps them, as here
    other = {"filename": "model.py", "line": 2, "name": "forward"}
    lists += [[dict(frame)] * 19_999, [frame, other], [other, frame], [frame, other, other], [frame, other], [], []]
    assert per.get(lists[0], extra=True) == 2 and per.get(lists[50]) == 3
    assert seen == [19_999] * 3
    # the same objects in another order, or one more of them, are another sequence
    assert [per.get(frames) for frames in lists[51:]] == [4, 5, 6, 4, 7, 7]


@pytest.mark.parametrize("raw, shown", [
    ("/home/a/.venv/lib/python3.12/site-packages/torch/optim/adam.py", "torch/optim/adam.py"),
    ("D:\\Dev\\x\\.venv\\Lib\\site-packages\\torch\\optim\\adam.py", "torch/optim/adam.py"),
    ("/usr/lib/python3/dist-packages/numpy/core/x.py", "numpy/core/x.py"),
    ("/opt/conda/lib/python3.9/runpy.py", "stdlib/runpy.py"),
    ("C:\\Python312\\Lib\\threading.py", "stdlib/threading.py"),
    ("<frozen runpy>", "stdlib/runpy.py"),
    ("/home/a/proj/scripts/../pkg/model.py", "/home/a/proj/pkg/model.py"),
    ("D:\\Dev\\proj\\model.py", "/Dev/proj/model.py"),
])
def test_normalize_path(raw, shown):
    assert normalize_path(raw) == shown


def test_user_paths_are_shown_relative_to_the_project_root():
    groups = [[Frame("/home/a/proj/pkg/model.py", 3, "forward"), Frame("torch/nn/modules/linear.py", 1, "forward")],
              [Frame("/home/a/proj/train.py", 9, "<module>")]]
    assert relativize(groups) == [
        [Frame("pkg/model.py", 3, "forward"), Frame("torch/nn/modules/linear.py", 1, "forward")],
        [Frame("train.py", 9, "<module>")]]


def test_memdiffs_own_launcher_frames_do_not_change_signatures():
    work = py_frames_like([("gpt.py", 113, "train"), ("gpt.py", 140, "main")])
    console = work + py_frames_like([("/work/memdiff/commands/record.py", 70, "_run_target"),
                                     ("/work/memdiff/cli.py", 80, "main"), ("/venv/bin/memdiff", 8, "<module>")])
    module = work + py_frames_like([("/usr/lib/python3.11/runpy.py", 88, "_run_code"),
                                    ("/work/memdiff/commands/record.py", 70, "_run_target"),
                                    ("/work/memdiff/__main__.py", 5, "<module>")])
    assert sig(work) == sig(console) == sig(module)


def py_frames_like(specs):
    return [{"filename": f, "line": line, "name": name} for f, line, name in specs]


def test_a_boolean_line_is_no_line_number():
    """`True` is an int to Python; kept as a line it would make a summary its own schema refuses
    (the fuzz suite's seed 20261122, case 143)."""
    with pytest.raises(ValueError, match="line bool True"):
        StackNormalizer().stack([{"name": "forward", "filename": "/home/a/proj/model.py", "line": True}])


# The outer frames of one allocation in a marked test, as memdiff's CPU route recorded them under
# pytest 9.2 and pytest-xdist 3.8 (`python -m pytest`, `pytest -n 2`): the test's own frames, then
# pytest's and pluggy's, then how the session was started.
TEST_BODY = ["<built-in method empty of type object at 0x7f71920cea40>", "torch/nn/modules/linear.py(96): __init__",
             "/home/a/proj/tests/test_sig.py(5): test_rec"]
RUNNER = ["_pytest/python.py(187): pytest_pyfunc_call", "pluggy/_execution.py(147): _multicall",
          "pluggy/_manager.py(183): _hookexec", "pluggy/_caller.py(197): __call__", "_pytest/python.py(1798): runtest",
          "_pytest/runner.py(184): pytest_runtest_call", "_pytest/runner.py(118): pytest_runtest_protocol"]
SERIAL = ["_pytest/main.py(411): pytest_runtestloop", "_pytest/main.py(387): _main",
          "_pytest/config/__init__.py(286): _console_main", "pytest/__main__.py(9): <module>",
          "<frozen runpy>(198): _run_module_as_main"]
CONSOLE_SCRIPT = ["_pytest/main.py(411): pytest_runtestloop", "_pytest/config/__init__.py(286): _console_main",
                  "/home/a/.venv/bin/pytest(8): <module>"]
XDIST = ["xdist/remote.py(227): run_one_test", "xdist/remote.py(206): pytest_runtestloop",
         "_pytest/main.py(387): _main", "xdist/remote.py(427): <module>",
         "execnet/gateway_base.py(1291): executetask", "execnet/gateway_base.py(1806): serve",
         "<string>(8): <module>", "<string>(1): <module>"]


def test_a_tests_stacks_sign_alike_however_the_suite_was_launched():
    # `pytest -n 2` rewrote every signature of a baseline `python -m pytest` wrote (the frames
    # outside the test differ), so a refresh under another launcher churned the whole file.
    def stack(outer):
        return StackNormalizer().stack([{"filename": "none", "line": 0, "name": n} for n in TEST_BODY + RUNNER + outer])
    serial, script, xdist = stack(SERIAL), stack(CONSOLE_SCRIPT), stack(XDIST)
    assert serial.signature == script.signature == xdist.signature
    assert [f.name for f in xdist.frames][-2:] == ["__init__", "test_rec"]  # the test's own frames stay
    assert xdist.site == "linear.py:__init__ <- empty"
    # A script, not a test: nothing is cut, and its frames still tell its stacks apart.
    plain = StackNormalizer().stack([{"filename": "none", "line": 0, "name": n}
                                     for n in TEST_BODY[:2] + ["/home/a/proj/train.py(3): <module>"]])
    assert plain.signature != serial.signature and plain.frames[-1].name == "<module>"
