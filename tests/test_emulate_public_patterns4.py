"""Patterns of public training scripts (Lightning Fabric's examples, run by `fabric run`) that drifted
under `memdiff record --emulate`, each as a small scenario of our own: the script exits 0 and
torch.distributed answers as it does on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


# A rank-zero-first section, as Lightning builds it: a gloo group beside NCCL's, with a timeout of
# years, whose monitored barrier (gloo's alone) the ranks wait at on entry and exit; the default group
# is bound to the rank's GPU, as Lightning's DDP strategy asks (`init_process_group(device_id=...)`),
# so a barrier without `device_ids` knows its device and warns nothing.
RANK_ZERO_FIRST = """
import datetime
import warnings

import torch
import torch.distributed as dist

warnings.simplefilter("error")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
slow = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=10000))
slow.monitored_barrier()
dist.monitored_barrier(slow, timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
dist.destroy_process_group(slow)
total = torch.ones(8, device="cuda")
dist.barrier()
dist.all_reduce(total)
print("total", int(total.sum().item()))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def rank_zero_first(tmp_path_factory) -> subprocess.CompletedProcess:
    """RANK_ZERO_FIRST under `memdiff record --emulate h100 -o run.pickle -- python train.py`."""
    tmp_path = tmp_path_factory.mktemp("rank_zero_first")
    script = tmp_path / "train.py"
    script.write_text(RANK_ZERO_FIRST)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def test_a_monitored_barrier_of_a_gloo_group_completes_as_on_the_gpu(rank_zero_first):
    # The fake backend refused gloo's monitored barrier ("Backend fake does not support monitoredBarrier"):
    # every rank of Lightning Fabric's image classifier stopped in `fabric.rank_zero_first()`.
    assert rank_zero_first.returncode == 0, rank_zero_first.stderr[-3000:]
    assert "total 8" in rank_zero_first.stdout


def test_a_barrier_of_a_group_given_its_gpu_warns_nothing(rank_zero_first):
    # torch binds the group to `device_id` (`pg.bound_device_id = device_id` in init_process_group),
    # and a barrier without device_ids syncs that GPU; unbound, it warns "using the device under
    # current context" on rank 0, a line the GPU run does not print (Lightning's all-reduce of a
    # metric barriers so). Here the warning is an error, so the line would stop the script.
    assert "using the device under current context" not in rank_zero_first.stderr
    assert "total 8" in rank_zero_first.stdout, rank_zero_first.stderr[-3000:]
