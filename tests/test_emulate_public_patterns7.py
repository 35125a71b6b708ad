"""Patterns of public training scripts met in the eighth pass over them (docs/emulate.md, "An eighth
pass"), each as a small scenario of our own under `memdiff record --emulate h100`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _record(tmp_path, script, *extra):
    (tmp_path / "train.py").write_text(script)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", *extra,
                           "--", sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _facts(stdout):
    return json.loads(next(s for s in stdout.splitlines() if s.startswith("facts "))[len("facts "):])


def _tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def test_a_file_class_derived_from_fileio_writes_into_the_overlay(tmp_path):
    """A library's own file class deriving from `io.FileIO` (blobfile's local files, through which
    OpenAI's improved-diffusion saves its checkpoints) opens its path itself, around the routed open():
    the audit hook stopped its first save with PermissionError, where a GPU's run writes. It writes into
    the run's copy now and reads back, and the user's file keeps its bytes. Every file object is still an
    `io.FileIO`, and the library's class only its own."""
    import io

    from memdiff.recording.emulate.overlay_calls import overlaid

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "model000003.pt").write_bytes(b"the user's own checkpoint")
    before = _tree(tmp_path)
    with overlaid():
        class ProxyFile(io.FileIO):  # defined as the script imports its library: while the run goes
            def __init__(self, path, mode):
                super().__init__(path, mode=mode)

        for name, data in (("model000003.pt", b"step 3's weights"), ("model000000.pt", b"step 0's weights")):
            with ProxyFile(str(tmp_path / "logs" / name), "wb") as f:
                f.write(data)
        with ProxyFile(str(tmp_path / "logs" / "model000003.pt"), "rb") as f:
            seen = (f.read(), f.name)
        with open(tmp_path / "logs" / "model000000.pt", "rb") as f:
            plain = (f.read(), isinstance(f.raw, io.FileIO), isinstance(f.raw, ProxyFile))
    assert seen == (b"step 3's weights", str(tmp_path / "logs" / "model000003.pt"))
    assert plain == (b"step 0's weights", True, False)
    assert _tree(tmp_path) == before
    assert io.FileIO is sys.modules["_io"].FileIO  # the real class again after the run


# A training loop object that refers to itself, left as garbage with its model and Adam's state on the
# device, and a snapshot taken while the cyclic collector is due (OpenAI's improved-diffusion with
# `--use_fp16 True`: its TrainLoop, once main() returned, was collected inside memdiff's own snapshot).
# Ground truth, PyTorch's allocator contract: a snapshot's allocated blocks are exactly what its trace
# leaves allocated (the trace's alloc entries give the requested size, as the blocks' requested_size).
GARBAGE_CYCLE = """
import gc, json
import torch

class Loop:
    def __init__(self):
        self.model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).cuda()
        self.opt = torch.optim.Adam(self.model.parameters())
        self.again = self.step  # the cycle

    def step(self):
        self.model(torch.randn(4, 64, device="cuda")).sum().backward()
        self.opt.step()

gc.collect()
gc.disable()
Loop().step()
gc.set_threshold(gc.get_count()[0] + 12)  # the collector's next run comes a dozen objects on
gc.enable()
snap = torch.cuda.memory._snapshot()
blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
live = {}
for e in snap["device_traces"][0]:
    if e["action"] == "alloc":
        live[e["addr"]] = e["size"]
    elif e["action"] == "free_completed":
        live.pop(e["addr"])
print("facts", json.dumps({"dump": sorted((b["address"], b["requested_size"]) for b in blocks),
                           "trace": sorted(live.items())}))
"""


@pytest.mark.slow  # starts `memdiff record` (a child running torch)
def test_a_snapshot_is_taken_whole_while_the_collector_is_due(tmp_path):
    # Before: the collection ran inside the snapshot, after its segments were read: Adam's state of the
    # garbage loop was freed in the trace and still allocated in the dump (the fp16 run's 923.62 MiB
    # 'static', live before the trace began, and a peak that much too high).
    done = _record(tmp_path, GARBAGE_CYCLE)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _facts(done.stdout)
    assert [tuple(x) for x in facts["dump"]] == [tuple(x) for x in facts["trace"]]
    assert len(facts["dump"]) > 3 * 16  # the weights, their gradients and Adam's two moments of each


@pytest.mark.parametrize("name", ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_a_process_of_mpiexec_sees_a_gpu_for_each_process_on_its_node(monkeypatch, name):
    # OpenAI's improved-diffusion, as its README runs it on many GPUs (`mpiexec -n N python
    # scripts/image_train.py`), puts each MPI rank on `cuda:{rank % 8}`: each process saw one GPU and rank
    # 1 stopped at `model.to(cuda:1)` (invalid device ordinal), where a node of N GPUs runs. MPICH's and
    # Intel MPI's mpiexec say the processes on the node in MPI_LOCALNRANKS, Open MPI's in
    # OMPI_COMM_WORLD_LOCAL_SIZE (their launchers' documented environment).
    from memdiff.recording.emulate.devices import GPUS, LOCAL_SIZES, gpus_per_node

    for other in (GPUS, "CUDA_VISIBLE_DEVICES", *LOCAL_SIZES):
        monkeypatch.delenv(other, raising=False)
    assert gpus_per_node() == 1
    monkeypatch.setenv(name, "2")
    assert gpus_per_node() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, where a job has both
    assert gpus_per_node() == 4


def test_ctrl_c_while_the_emulator_frees_a_storage_stops_the_script_at_its_next_op(monkeypatch):
    """The emulator frees a dropped storage in a weakref.finalize callback, where Python ignores every
    exception: a Ctrl-C that came then was lost ("Exception ignored in: <finalize object>") and the run
    went on (MEGABYTE-pytorch's train.py, stopped by `timeout -s INT`, trained on until it was killed,
    its snapshot unwritten), its free cut short. Now the free ends and the Ctrl-C stops the script at
    its next op, as a GPU's free (C++) lets it reach the script."""
    import os
    import signal
    import weakref

    from memdiff.recording.emulate import interrupts
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator

    emulator = Emulator(gpu("h100"))
    done = []

    def release(block, index):  # a Ctrl-C comes in the middle of the free
        os.kill(os.getpid(), signal.SIGINT)
        done.append(block)

    monkeypatch.setattr(emulator, "release", release)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with interrupts.held_in_finalizers(signals=(signal.SIGINT,)):
            class Storage:
                pass
            storage = Storage()
            emulator.blocks[id(storage)] = "block"
            weakref.finalize(storage, emulator._storage_freed, id(storage))
            del storage  # the script drops its tensor: the emulator's finalizer frees it
            assert done == ["block"]  # the free ran to its end
            with pytest.raises(KeyboardInterrupt):
                interrupts.deliver()  # the script's next op
            interrupts.deliver()  # handled once
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_a_weak_dictionary_drops_a_dead_tensor_stops_the_script_at_its_next_op():
    """torch's WeakIdKeyDictionary (autograd's and the emulator's tables of tensors) drops a dead key in a
    weakref callback, where CPython ignores every exception: a Ctrl-C landing there was lost ("Exception
    ignored in: <function WeakIdKeyDictionary.__init__.<locals>.remove>") and a Lightning script recorded
    into one file trained on (1 run in 5). Now it is held to the script's next op."""
    import os
    import signal

    import torch
    from torch.utils.weak import WeakIdKeyDictionary

    from memdiff.recording.emulate import interrupts

    table = WeakIdKeyDictionary()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with interrupts.held_in_finalizers(signals=(signal.SIGINT,)):
            table._pending_removals = _Interrupting(lambda: os.kill(os.getpid(), signal.SIGINT))
            table._iterating.add(object())  # removals are queued while iterating: the queue's append signals
            tensor = torch.zeros(1)
            table[tensor] = 1
            del tensor  # the callback runs, and the Ctrl-C comes inside it
            assert table._pending_removals.calls == 1  # the callback ran to its end
            with pytest.raises(KeyboardInterrupt):
                interrupts.deliver()  # the script's next op
    finally:
        signal.signal(signal.SIGINT, previous)


class _Interrupting(list):
    """A list whose append first runs `action` (a Ctrl-C arriving), as inside the removal callback."""

    def __init__(self, action):
        super().__init__()
        self.action, self.calls = action, 0

    def append(self, item):
        self.action()
        self.calls += 1
        super().append(item)
