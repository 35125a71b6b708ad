"""Every thread of the script runs on the emulated GPU under `memdiff record --emulate`: thread pools,
plain threads, and transformers 5's `from_pretrained(..., device_map="cuda")`, which loads weights in
a thread pool. Before, a worker started without the emulator's (per-thread) modes and reached CUDA
itself. The weights those workers load read as parameters, as the main thread's do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import pytest

pytest.importorskip("torch")


def _emulate(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script), *args],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


POOL = """
    import threading
    from concurrent.futures import ThreadPoolExecutor
    import torch

    host = [torch.randn(1024, 1024), torch.randn(4096, 256), torch.randn(512), torch.randn(2048, 2048)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        moved = list(pool.map(lambda t: t.to("cuda"), host))
    made = {}
    worker = threading.Thread(target=lambda: made.update(x=torch.zeros(256, 256, device="cuda")))
    worker.start()
    worker.join()
    print(sorted({str(t.device) for t in [*moved, made["x"]]}), torch.cuda.memory_allocated())
"""


@pytest.mark.slow
def test_thread_pool_workers_and_threads_allocate_on_the_emulated_gpu(tmp_path: Path):
    done = _emulate(tmp_path, POOL)
    # every tensor moved by a worker and made by a thread is on the GPU, each block rounded to 512 B
    sizes = [1024 * 1024 * 4, 4096 * 256 * 4, 512 * 4, 2048 * 2048 * 4, 256 * 256 * 4]
    assert done.stdout.splitlines()[-1] == f"['cuda:0'] {sum(-(-n // 512) * 512 for n in sizes)}"


FROM_PRETRAINED = """
    import sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(sys.argv[1])  # a CPU model's checkpoint: real files
    mapped = LlamaForCausalLM.from_pretrained(sys.argv[1], device_map="cuda")  # a thread pool's workers
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [*mapped.parameters(), *mapped.buffers()]}
    print(mapped.device, torch.cuda.memory_allocated(), sum(-(-n // 512) * 512 for n in storages.values()))
    moved = LlamaForCausalLM.from_pretrained(sys.argv[1]).cuda()  # loaded on the CPU, moved by this thread
    models = [mapped, moved]
    optimizer = torch.optim.AdamW([p for model in models for p in model.parameters()])
    ids = torch.randint(0, 256, (2, 16), device="cuda")
    sum(model(ids, labels=ids).loss for model in models).backward()
    optimizer.step()
    print(sum(model.get_memory_footprint() for model in models), ids.numel() * ids.element_size())
"""


@pytest.fixture(scope="module")
def from_pretrained(tmp_path_factory) -> Tuple[List[str], Path]:
    """One emulated run loading the same checkpoint both ways, then a training step: its printed lines
    and its snapshot."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("from_pretrained")
    done = _emulate(folder, FROM_PRETRAINED, str(folder / "llama"))
    return done.stdout.splitlines()[-2:], folder / "run.pickle"


@pytest.mark.slow
def test_from_pretrained_with_a_device_map_loads_onto_the_emulated_gpu(from_pretrained):
    device, allocated, blocks = from_pretrained[0][0].split()
    # what is allocated is the model's parameters and buffers, each its own block, and nothing else
    assert (device, allocated) == ("cuda:0", blocks)


@pytest.mark.slow
def test_weights_a_thread_pool_loads_are_parameters_as_those_the_main_thread_moves(from_pretrained):
    # transformers 5's workers move each weight to the GPU with a stack of their own, without the
    # from_pretrained that submitted the job: all of the weights read as `input` before (417.25 KiB)
    from memdiff import api

    footprint, batch = (int(n) for n in from_pretrained[0][1].split())
    categories = api.summarize(from_pretrained[1]).devices[0].categories
    # both models' weights and buffers at the peak, as transformers counts them, and as parameters only
    assert categories["parameter"] == footprint
    assert categories["input"] == batch
