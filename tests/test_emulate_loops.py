"""Training and validation loops as people write them, run unmodified under `memdiff record
--emulate h100`: a DataLoader with worker processes and pinned memory feeding a side-stream
prefetcher timed with CUDA events, the log lines of a loop (f-strings, %-format, print, repr), and
validation under torch.inference_mode() that reads values back."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
from conftest import read_back

import memdiff

torch = pytest.importorskip("torch")


def _emulate(tmp_path, source, name):
    """`memdiff record --emulate h100 -o run.pickle -- python NAME` of a script written from `source`."""
    script = tmp_path / name
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ),
                          timeout=900)  # a lost worker batch hangs the run: fail, never hang CI


def _allocations(path):
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    return [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]


LOADER = """
import torch
from torch.utils.data import DataLoader, TensorDataset


class Prefetcher:
    \"\"\"Copies the next batch to the GPU on a side stream while the current one trains.\"\"\"

    def __init__(self, loader):
        self.loader = loader
        self.stream = torch.cuda.Stream(device="cuda:0")

    def __iter__(self):
        ready = None
        for x, y in self.loader:
            print("pinned", x.is_pinned(), y.is_pinned())
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream=self.stream):
                nx = x.cuda(non_blocking=True)
                ny = y.to("cuda", non_blocking=True)
            if ready is not None:
                yield ready
            torch.cuda.current_stream().wait_stream(self.stream)
            nx.record_stream(torch.cuda.current_stream())
            ny.record_stream(torch.cuda.current_stream())
            ready = nx, ny
        yield ready


data = TensorDataset(torch.randn(64, 24), torch.arange(64) % 4)
loader = DataLoader(data, batch_size=16, num_workers=2, pin_memory=True)
model = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("params", sum(p.numel() for p in model.parameters()))
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for step, (x, y) in enumerate(Prefetcher(loader)):
    if step == 2:
        break
    start.record()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end)
    print("step", step, "labels", y[:6].tolist(), "on", x.device, type(ms).__name__, ms >= 0)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    print("current is side", torch.cuda.current_stream() == side)
print("current is default", torch.cuda.current_stream() == torch.cuda.default_stream())
"""


@pytest.mark.slow
def test_a_dataloader_with_workers_and_pinned_memory_feeds_a_side_stream_prefetcher(tmp_path):
    done = _emulate(tmp_path, LOADER, "loader.py")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    # The pin-memory thread pinned every batch the two workers made (four of 16 rows), and the
    # labels reached the device with their values (the dataset's 0, 1, 2, 3, ...).
    assert out.count("pinned True True") == 4
    assert "step 0 labels [0, 1, 2, 3, 0, 1] on cuda:0 float True" in out
    assert "step 1 labels [0, 1, 2, 3, 0, 1] on cuda:0 float True" in out
    assert out[-2:] == ["current is side True", "current is default True"]
    params = int(out[0].split()[1])
    assert params == 24 * 64 + 64 + 64 * 4 + 4
    assert memdiff.summarize(tmp_path / "run.pickle").devices[0].categories["parameter"] == 4 * params
    # The batches copied under the side stream come from its own pool, as the caching allocator keeps
    # one per stream: each batch's x (16 x 24 floats) and y (16 int64) there, nothing else. Pinned
    # host memory is not device memory: no allocation of the batch's size on the default stream.
    allocations = _allocations(tmp_path / "run.pickle")
    side = [(e["size"], e["stream"]) for e in allocations if e["stream"] != 0]
    streams = {stream for _, stream in side}
    assert len(streams) == 1 and sorted(size for size, _ in side) == [16 * 8] * 4 + [16 * 24 * 4] * 4
    assert not [e for e in allocations if e["stream"] == 0 and e["size"] == 16 * 24 * 4]


LOGGING = """
import torch

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).cuda()
opt = torch.optim.AdamW(model.parameters())
ids = torch.arange(4, device="cuda")
halves = ids / 2
before = torch.cuda.memory_allocated()
scale = torch.tensor([0.5, 2.0], device="cuda")
print("constant", torch.cuda.memory_allocated() - before, scale)


def log(step, loss, norm):
    before = torch.cuda.memory_allocated()
    print(f"step {step} loss {loss:.4f} norm {norm:.2f}")
    print("step %d loss %.3f lr %.1e" % (step, loss, opt.param_groups[0]["lr"]))
    print(f"plain {loss}")
    print(loss)
    print(repr(ids))
    print(halves)
    print(str(model[0].bias[:2]))
    print("allocated after printing", torch.cuda.memory_allocated() - before)


for step in range(2):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    log(step, loss, norm)
try:
    f"{ids:.2f}"
except TypeError as exc:
    print("refused", exc)
"""


@pytest.mark.slow
def test_log_lines_format_and_print_device_tensors_as_a_gpu_does(tmp_path):
    done = _emulate(tmp_path, LOGGING, "log.py")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    # A constant made on the device keeps its values, in a block the allocator rounds to 512 bytes.
    assert out.pop(0) == "constant 512 " + repr(torch.tensor([0.5, 2.0]))[:-1] + ", device='cuda:0')"
    # Values from the model's arithmetic read back as docs/emulate.md's stand-ins: the loss (a mean) and
    # the gradients' norm are single floats, which take the next of its falling numbers when made (0 and
    # 1), so every read of the loss (formatted, by %, as a plain number, printed) gives its one number;
    # a host copy (the bias printed) is a read, the next number in each element; ids keep theirs.
    # Printed by torch's own formatting of the same values, on cuda:0.
    assert out[:8] == [f"step 0 loss {read_back(0):.4f} norm {read_back(1):.2f}",
                       f"step 0 loss {read_back(0):.3f} lr 1.0e-03", f"plain {read_back(0)!r}",
                       repr(torch.tensor(read_back(0)))[:-1] + ", device='cuda:0', grad_fn=<MeanBackward0>)",
                       "tensor([0, 1, 2, 3], device='cuda:0')",
                       repr(torch.arange(4) / 2)[:-1] + ", device='cuda:0')",
                       repr(torch.full((2,), read_back(2)))[:-1] + ", device='cuda:0', grad_fn=<SliceBackward0>)",
                       "allocated after printing 0"]
    assert out[0] == "step 0 loss 0.5000 norm 0.50" and out[8].startswith(f"step 1 loss {read_back(3):.4f}")
    # A tensor of more than one element takes no format spec, on a GPU as on the CPU.
    assert out[-1] == "refused unsupported format string passed to Tensor.__format__"
    assert "meta" not in done.stdout
    # Formatting a number reads it back to the host: no allocation of the device at a log line.
    assert not [e for e in _allocations(tmp_path / "run.pickle") if any(f["name"] == "log" for f in e["frames"])]


VALIDATION = """
import torch

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda().eval()
x = torch.randn(8, 32, device="cuda")
labels = torch.arange(8, device="cuda") % 10


def validate(name):
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    correct = (logits.argmax(-1) == labels).sum()
    host = labels.cpu().numpy()
    print(name, loss.item(), float(loss), int(correct), bool(correct), labels.tolist(), logits.detach().tolist()[0][:2],
          host.dtype, host.tolist(), logits.detach().cpu().numpy().shape)


torch.cuda.memory._record_memory_history()
with torch.inference_mode():
    validate("inference_mode")
with torch.no_grad():
    validate("no_grad")
with torch.enable_grad():
    validate("enable_grad")
"""


@pytest.mark.slow
def test_validation_under_inference_mode_reads_values_as_under_no_grad(tmp_path):
    done = _emulate(tmp_path, VALIDATION, "validate.py")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    answers = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines}
    # Labels keep their values; what comes from the model's arithmetic reads back by the policy of
    # docs/emulate.md: the loss is a single float, which takes the next of its falling numbers when
    # cross_entropy makes it (and its total weight, nll_loss's second output, the one after), so
    # `item()` and `float()` read the same number; the count of correct answers, a sum of a comparison
    # without values, the c-th rising fraction 1 - 0.5 x 64 / (64 + c) of its 8 elements, rounded with
    # the rest carried (4.0, 4.06, 4.18: 4 each time, so true); the logits copied to the host one number
    # in each element (`tolist()`, then `.cpu()`, a read each): four falling numbers a validation, in
    # the same order under each mode.
    for i, name in enumerate(("inference_mode", "no_grad", "enable_grad")):
        first = 4 * i
        assert answers[name] == f"{read_back(first)!r} {read_back(first)!r} 4 True [0, 1, 2, 3, 4, 5, 6, 7] " \
            f"[{read_back(first + 2)!r}, {read_back(first + 2)!r}] int64 [0, 1, 2, 3, 4, 5, 6, 7] (8, 10)"
    # Under inference_mode a GPU runs nn.Linear as cuBLAS's addmm (autograd's keys are skipped, not
    # the op's parts): the first validation's layers are addmm's outputs, with the handle's workspace.
    allocations = _allocations(tmp_path / "run.pickle")
    first = [e for e in allocations if any(f["name"] == "validate" for f in e["frames"])]
    ops = [next(f["name"] for f in e["frames"] if f["name"].startswith("at::_ops::")) for e in first]
    assert "at::_ops::addmm::call" in ops and "at::_ops::linear::call" not in ops
    workspace = 32 << 20  # cuBLAS's workspace per handle on sm90 (PyTorch's CUBLAS_WORKSPACE_CONFIG default)
    assert any(e["size"] == workspace for e in first)


@pytest.mark.slow
def test_a_tensor_made_from_device_scalars_reads_their_values(tmp_path):
    # The imagenet example's AverageMeter: torch.tensor([sum, count], device="cuda") where sum is a
    # device scalar; torch reads each scalar's value (the read-back rule's: known small values here).
    script = tmp_path / "meter.py"
    script.write_text(textwrap.dedent("""
        import torch
        acc = torch.ones(8, device="cuda").mean() * 100
        total = torch.tensor([acc * 8, 8], dtype=torch.float32, device="cuda")
        print(total.device, total.tolist())
    """))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "cuda:0 [800.0, 8.0]"


SAMPLING = """
import torch

# pytorch/examples' word_language_model generate.py: the next word drawn on the host from the model's
# output, and a host buffer filled from the device
model = torch.nn.Linear(16, 10).cuda()
with torch.no_grad():
    output = model(torch.randn(1, 16, device="cuda"))
    weights = output.squeeze().div(0.8).exp().cpu()
    word = torch.multinomial(weights, 1)[0]
    host = torch.empty(10)
    host.copy_(output.squeeze())
print("word", 0 <= int(word) < 10, word.dtype, "weights", weights.dtype, tuple(weights.shape),
      bool(weights.sum() > 0), "host", bool(host.min() > 0), torch.distributions.Categorical(probs=weights).sample().item() < 10)
"""


@pytest.mark.slow
def test_host_code_that_samples_from_the_models_output_runs_as_on_a_gpu(tmp_path):
    done = _emulate(tmp_path, SAMPLING, "generate.py")
    assert done.returncode == 0, done.stderr[-3000:]
    # exp() of any logits is positive on a GPU: the host copy is a distribution to sample from
    assert done.stdout.splitlines() == ["word True torch.int64 weights torch.float32 (10,) True host True True"]


@pytest.mark.slow
def test_a_host_tensor_made_from_device_scalars_reads_their_values(tmp_path):
    # Megatron-core's grad-norm fallback without apex (local_multi_tensor_l2_norm): torch.tensor of a
    # list of device scalars, no device named, is a host tensor of their values, as on a GPU.
    script = tmp_path / "norms.py"
    script.write_text(textwrap.dedent("""
        import torch
        grads = [torch.ones(4, device="cuda"), torch.ones(3, device="cuda").sum() * 0 + 2]
        norms = [[torch.norm(g) for g in grads]]
        host = torch.tensor(norms)
        print(host.device, host.dtype, tuple(host.shape), torch.tensor([grads[1], 5]).tolist())
    """))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "cpu torch.float32 (1, 2) [2.0, 5.0]"
