"""Every thread of the script runs on the emulated GPU under `memdiff record --emulate`: thread pools,
plain threads, and transformers 5's `from_pretrained(..., device_map="cuda")`, which loads weights in
a thread pool. Before, a worker started without the emulator's (per-thread) modes and reached CUDA
itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")


def _emulate(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script)],
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
    import tempfile
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)  # a CPU model's checkpoint: real files
        model = LlamaForCausalLM.from_pretrained(folder, device_map="cuda")
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    print(model.device, torch.cuda.memory_allocated(), sum(-(-n // 512) * 512 for n in storages.values()))
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    model(ids, labels=ids).loss.backward()
"""


@pytest.mark.slow
def test_from_pretrained_with_a_device_map_loads_onto_the_emulated_gpu(tmp_path: Path):
    pytest.importorskip("transformers")
    done = _emulate(tmp_path, FROM_PRETRAINED)
    device, allocated, blocks = done.stdout.split()[-3:]
    # what is allocated is the model's parameters and buffers, each its own block, and nothing else
    assert (device, allocated) == ("cuda:0", blocks)
