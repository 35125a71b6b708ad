"""What the engines of large jobs do that the emulator must take as a GPU does (issue 59's table):
FSDP2's free and regrowth of each all-gathered weight (`UntypedStorage.resize_`), a model built on
the meta device, `python -m` of a package that reads sys.argv at import, and the NCCL names torch
reads behind `is_nccl_available()`, and a job of FSDP2 x tensor x pipeline parallel run one rank a
role; each held to a count from the model's own sizes or to what torch and python do."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest

import memdiff

# Slow (the fast loop, -m "not slow", leaves it out): every test runs an emulated process.
pytestmark = pytest.mark.slow


def _emulate(tmp_path: Path, source: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o run.pickle -- python train.py` of `source`."""
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", "train.py"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **(env or {})})


RESIZE = """
    import torch

    x = torch.empty(1024, 1024, device="cuda")
    storage = x.untyped_storage()
    print(torch.cuda.memory_allocated())
    storage.resize_(0)
    print(torch.cuda.memory_allocated())
    storage.resize_(2 * 1024 * 1024)
    print(torch.cuda.memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    storage.resize_(8 * 1024 * 1024)
    print(torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
"""


def test_resizing_a_storage_frees_and_allocates_as_cuda_does(tmp_path):
    # resize_bytes_cuda: to 0 bytes frees the block; to n bytes takes a new block of n, copies the
    # old bytes in, then frees the old block (both are held for a moment)
    done = _emulate(tmp_path, RESIZE)
    assert done.returncode == 0, done.stderr[-3000:]
    mib = 1024 * 1024
    assert done.stdout.split() == [str(4 * mib), "0", str(2 * mib), str(8 * mib), str(10 * mib)]


FSDP2_FORWARD = """
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    with torch.no_grad():  # the forward's cuBLAS workspaces, made before the count starts
        torch.nn.Linear(8, 8).cuda()(torch.ones(8, 8, device="cuda"))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(8, 1024, device="cuda")
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        y = model(x)
    print(torch.cuda.memory_allocated() - start, torch.cuda.max_memory_allocated() - start)
    dist.destroy_process_group()
"""


def test_fsdp2_frees_each_gathered_weight_after_its_layer(tmp_path):
    # Rank 0 of 2. Each layer's weights are all-gathered whole before its forward and freed after it
    # (`resize_(0)`); FSDP2 keeps the previous layer's flat all-gather buffer until the next layer's
    # copy-out (its AllGatherState). The peak is two flat buffers, one layer's gathered weights and
    # one activation; after the forward only the output is left.
    done = _emulate(tmp_path, FSDP2_FORWARD, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    layer = (1024 * 1024 + 1024) * 4  # one Linear(1024, 1024) whole, in fp32
    activation = 8 * 1024 * 4
    assert done.stdout.split() == [str(activation), str(3 * layer + activation)]


META_MODEL = """
    import torch

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    extra = [torch.empty(1024, device="meta"), torch.ones(1024).to("meta"), torch.zeros(4, 4).to(device="meta"),
             torch.tensor([1.0, 2.0], device="meta")]
    weight = model[0].weight
    print(torch.cuda.memory_allocated(), weight.device, weight.is_meta, weight.is_cuda, (weight * 2).device,
          *[t.device for t in extra])
    model.to_empty(device="cuda")
    weight = model[0].weight
    moved = torch.cuda.memory_allocated()
    print(moved, weight.device, weight.is_meta, weight.is_cuda)
    try:
        torch.nn.Linear(8, 8, device="meta").cuda()
    except NotImplementedError as exc:
        print(str(exc).split(";")[0])
    torch.set_default_device("meta")
    default = torch.nn.Linear(1024, 1024)
    print(torch.cuda.memory_allocated() - moved, default.weight.device, torch.get_default_device())
    torch.set_default_device("cuda")
    x = torch.empty(1024)
    print(torch.cuda.memory_allocated() - moved, x.device, torch.get_default_device())
"""


def test_a_model_built_on_the_meta_device_costs_nothing_until_moved_to_the_gpu(tmp_path):
    # FSDP2's recommended initialisation (torchtitan's): built on meta, no memory on the GPU; the
    # emulated GPU's own tensors are meta tensors too, and must not be confused with the script's
    done = _emulate(tmp_path, META_MODEL)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = 4 * (1024 * 1024 + 1024) * 4
    built, moved, refused, default, default_gpu = done.stdout.splitlines()
    assert built.split() == ["0", "meta", "True", "False", "meta", "meta", "meta", "meta", "meta"]
    assert moved.split() == [str(weights), "cuda:0", "False", "True"]
    assert refused == "Cannot copy out of meta tensor"  # torch's own refusal: a meta tensor has no data
    assert default.split() == ["0", "meta", "meta"]  # torch.set_default_device("meta")
    assert default_gpu.split() == [str(1024 * 4), "cuda:0", "cuda:0"]


FSDP2_META_INIT = """
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    print(torch.cuda.memory_allocated(), model[0].weight.device)
    model.to_empty(device="cuda")
    for layer in model:
        layer.reset_parameters()
    print(torch.cuda.memory_allocated(), model[0].weight.device)
    dist.destroy_process_group()
"""


def test_an_fsdp2_model_built_on_meta_holds_its_shards_once_on_the_gpu(tmp_path):
    done = _emulate(tmp_path, FSDP2_META_INIT, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    shards = 4 * (1024 * 1024 + 1024) * 4 // 2  # rank 0's halves of four Linear(1024, 1024)
    assert done.stdout.split() == ["0", "meta", str(shards), "cuda:0"]


TRAIN = """\
import sys
import torch

x = torch.empty(1024, device="cuda")
print(sys.argv[1:], torch.cuda.memory_allocated())
"""


def _module(tmp_path: Path, init: str, module: str) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -- python -m pkg.MODULE` of a package whose __init__ is `init`."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(textwrap.dedent(init))
    (tmp_path / "pkg" / "train.py").write_text(TRAIN)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", "-m", module, "--steps", "2"],
                          capture_output=True, text=True, cwd=tmp_path)


ARGV_AT_IMPORT = """
    import sys

    if "record" in sys.argv:  # torchtitan parses sys.argv at import: memdiff's own options are not its
        sys.exit("Unrecognized options: " + ", ".join(sys.argv[1:]))
"""


def test_a_package_that_reads_argv_at_import_runs_with_its_own_arguments(tmp_path):
    done = _module(tmp_path, ARGV_AT_IMPORT, "pkg.train")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "['--steps', '2'] 4096\n"
    assert "Unrecognized options" not in done.stderr


def test_a_dependency_missing_inside_a_package_is_said_as_python_says_it(tmp_path):
    # The package is there: its import of a dependency this machine lacks fails when it runs, and
    # that is the script failing (exit 1, python's traceback), not a module memdiff could not find
    done = _module(tmp_path, "import triton_for_a_gpu_this_machine_lacks\n", "pkg.train")
    assert done.returncode == 1
    assert "No module named 'triton_for_a_gpu_this_machine_lacks'" in done.stderr
    assert "no such module" not in done.stderr


def test_a_module_missing_from_a_package_is_refused_without_running_the_package(tmp_path):
    done = _module(tmp_path, ARGV_AT_IMPORT, "pkg.missing")
    assert done.returncode == 2
    assert done.stderr == "memdiff: pkg.missing: no such module (run from the folder it is importable from)\n"


NCCL_BEHIND_ITS_ANSWER = """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    options = dist.ProcessGroupNCCL.Options()  # Megatron's high-priority streams
    options.is_high_priority_stream = True
    dist.init_process_group("nccl", pg_options=options)
    c10d._set_pg_timeout(timedelta(minutes=5))  # torchtitan, after its first step
    c10d._add_ephemeral_timeout_for_all_pgs(timedelta(seconds=30))
    c10d._get_process_group_uid(c10d._get_default_group())
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    print(dist.is_nccl_available(), dist.get_backend(), t.device)
    dist.destroy_process_group()
"""


def test_what_torch_reads_behind_is_nccl_available_is_there(tmp_path):
    # A CPU build of torch never defines ProcessGroupNCCL; the emulated job answers that NCCL is
    # available, and torch's own code then names the class: _set_pg_timeout stopped with NameError
    done = _emulate(tmp_path, NCCL_BEHIND_ITS_ANSWER, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "True nccl cuda:0\n"
    assert "NameError" not in done.stderr


def _llama_3d() -> object:
    """Our Llama-3-shaped 3-D scenario as a module, for its shapes and its by-hand shard sizes."""
    script = Path(__file__).parent / "scenarios" / "llama_3d_train.py"
    spec = importlib.util.spec_from_file_location("llama_3d_train", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_3d_llama_job_runs_one_rank_per_pipeline_stage_each_holding_its_shard(tmp_path):
    # Issue 59's layout at a small size (the full 405B plan is benchmarks/test_cluster_plans.py): 8
    # GPUs on 2 nodes as a (pp 2, dp 2, tp 2) mesh, FSDP2 over dp in bf16 with fp32 reduction,
    # tensor parallel over tp, Schedule1F1B over 2 stages, two AdamW steps. `--ranks auto` runs
    # rank 0 (stage 0), the first rank of stage 1 (the last node's first), the last rank and the first
    # node's last (3, by its place in its node), and no other. Each rank holds,
    # to the byte, its fp32 shard of its stage's weights as parameters (worked out from the shape),
    # AdamW's two moments of that shard (its steps stay on the CPU), and the stage's bf16 weights
    # gathered over dp (kept from forward to backward under pipelining): dp x shard x 2 / 4.
    scenario = _llama_3d()
    script = Path(scenario.__file__)
    done = subprocess.run(
        [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks", "auto", "--",
         "torchrun", "--nnodes", "2", "--nproc-per-node", "4", str(script), "--size", "tiny", "--tp", "2",
         "--pp", "2", "--seq", "64", "--local-batch", "2"],
        capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert manifest["world_size"] == 8 and manifest["emulated_ranks"] == [0, 3, 4, 7]
    assert [r["rank"] for r in manifest["ranks"] if r["state"] == "not emulated"] == [1, 2, 5, 6]
    tp, pp, dp = 2, 2, 2
    for rank in (0, 3, 4, 7):
        device = memdiff.summarize(tmp_path / "runs" / f"rank{rank}.pickle").devices[0]
        shard = scenario.shard_bytes("tiny", tp, pp, dp, stage=rank // 4)  # type: ignore[attr-defined]
        assert device.categories["parameter"] == shard, (rank, device.categories)
        assert device.categories["optimizer_state"] == 2 * shard, (rank, device.categories)
        assert device.categories["unsharded_parameter"] == dp * shard * 2 // 4, (rank, device.categories)
