"""Sharded jobs: what FSDP2 and DDP hold, named for what it is: hand-built stacks, then (slow) two
FSDP2 jobs recorded with `memdiff record -- torchrun` (tests/scenarios/fsdp_train.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, alloc, free, py_frames

from memdiff import api
from memdiff.analyse.classify import category_of, load_rules
from memdiff.model import Group
from memdiff.read.frames import StackNormalizer

FSDP_TRAIN = ROOT / "tests" / "scenarios" / "fsdp_train.py"
SP = "/venv/lib/python3.12/site-packages/"
FSDP = SP + "torch/distributed/fsdp/_fully_shard/"
TRAIN = ["fsdp_train.py:40:main", "fsdp_train.py:60:<module>"]


def group(frames, lifetime=None) -> Group:
    s = StackNormalizer().stack(frames)
    return Group(signature=s.signature, site=s.site, frames=list(s.frames), count=1, bytes=1, lifetime=lifetime)


SHARDED = py_frames(FSDP + "_fsdp_param.py:227:_init_sharded_param", FSDP + "_fsdp_param.py:192:__init__",
                    FSDP + "_fsdp_param_group.py:156:__init__", FSDP + "fully_shard.py:200:fully_shard", *TRAIN)
UNSHARDED = py_frames(FSDP + "_fsdp_param.py:1066:alloc_storage", FSDP + "_fsdp_param.py:823:alloc_all_gather_outputs",
                      FSDP + "_fsdp_collectives.py:430:foreach_all_gather_copy_out",
                      FSDP + "_fsdp_param_group.py:416:wait_for_unshard", "fsdp_train.py:31:forward", *TRAIN)
REDUCE = py_frames(FSDP + "_fsdp_collectives.py:52:allocate", FSDP + "_fsdp_collectives.py:521:foreach_reduce",
                   FSDP + "_fsdp_param_group.py:587:post_backward", SP + "torch/autograd/__init__.py:255:backward",
                   *TRAIN)
ALL_GATHER = py_frames(FSDP + "_fsdp_collectives.py:52:allocate", FSDP + "_fsdp_collectives.py:324:foreach_all_gather",
                       FSDP + "_fsdp_param_group.py:371:unshard", "fsdp_train.py:31:forward", *TRAIN)
# gloo's reduce-scatter makes its own buffer under foreach_reduce; it is the collective's, not a .grad
COLLECTIVE = py_frames(SP + "torch/distributed/distributed_c10d.py:4400:reduce_scatter_single",
                       SP + "torch/distributed/c10d_logger.py:80:wrapper") + REDUCE[1:]
# gradient sync off (a pipeline's microbatches): each unsharded gradient upcast to reduce_dtype, kept for the
# next microbatches to add theirs to, reduce-scattered in the last one's backward (its stack as recorded)
ACCUMULATED = [{"filename": "??", "line": 0, "name": "at::_ops::_to_copy::call"},
               {"filename": "??", "line": 0, "name": "torch::autograd::generated::RegisterPostBackwardFunctionBackward::apply"},
               *py_frames(FSDP + "_fsdp_param.py:813:to_accumulated_grad_if_needed",
                          FSDP + "_fsdp_param_group.py:611:post_backward", *TRAIN)]
KEPT = {"born": "backward", "freed": "optimizer", "outlives": "phase"}
INSIDE = {"born": "backward", "freed": "backward", "outlives": "none"}


@pytest.mark.parametrize("frames, lifetime, category", [
    (SHARDED, None, "parameter"),
    (UNSHARDED, {"born": "forward", "freed": "backward", "outlives": "phase"}, "unsharded_parameter"),
    (UNSHARDED, {"born": "forward", "freed": "forward", "outlives": "none"}, "unsharded_parameter"),
    # the reduce-scatter's output is the sharded .grad, kept until zero_grad; its input is freed inside
    (REDUCE, KEPT, "gradient"),
    (REDUCE, INSIDE, "communication"),
    (ACCUMULATED, INSIDE, "gradient"),
    (COLLECTIVE, KEPT, "communication"),
    (ALL_GATHER, {"born": "forward", "freed": "forward", "outlives": "none"}, "communication"),
], ids=["sharded-param", "unsharded-held", "unsharded-resharded", "reduce-output", "reduce-input",
                                                         "accumulated-without-sync", "collective-own",
                                                         "all-gather"])
def test_fsdp2_memory_is_named_for_what_it_holds(frames, lifetime, category):
    assert category_of(group(frames, lifetime), load_rules()) == category


def test_ddp_buckets_are_communication():
    ddp = SP + "torch/nn/parallel/distributed.py"
    rebuilt = [{"filename": "none", "line": 0, "name": "<built-in method _rebuild_buckets of PyCapsule object at 0x1>"},
               *py_frames(ddp + ":1744:_pre_forward", ddp + ":1884:forward", *TRAIN)]
    initial = py_frames(ddp + ":1200:_ddp_init_helper", ddp + ":900:__init__", *TRAIN)
    rules = load_rules()
    for frames in (rebuilt, initial):
        g = group(frames, {"born": "forward", "freed": "never", "outlives": "trace"})
        assert category_of(g, rules) == "communication"
        assert category_of(replace(g, lifetime=None), rules) == "communication"


# Megatron-core 0.16.1's DistributedDataParallel: _ParamAndGradBuffer.__init__ makes the flat bf16
# parameter buffer (line 797, with the distributed optimizer only), then the flat fp32 gradient buffer
# every weight's main_grad is a view of (line 803), both by torch.zeros; frees of the model's old
# weights follow at line 835 (`del old_param_data`), as recorded under the emulator.
MEGATRON = SP + "megatron/core/distributed/"
ZEROS = {"filename": "??", "line": 0, "name": "at::_ops::zeros::call(c10::ArrayRef<long>, ...)"}


def _megatron_buffers(line: int) -> list:
    return [ZEROS, *py_frames(MEGATRON + f"param_and_grad_buffer.py:{line}:__init__",
                              MEGATRON + "distributed_data_parallel.py:200:_allocate_buffers_for_parameters",
                              MEGATRON + "distributed_data_parallel.py:291:__init__", *TRAIN)]


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distributed-optimizer", "plain"])
def test_megatrons_flat_gradient_buffer_is_gradient_and_its_parameter_buffer_parameter(write_snapshot,
                                                                                        distributed_optimizer):
    numel = 1_878_016  # rank 0's parameters in tests/test_emulate_megatron.py's --tp 2 job
    grad, param = 4 * numel, 2 * numel  # fp32 main grads (grad_reduce_in_fp32), bf16 weights
    trace = [alloc(0x1000, param, _megatron_buffers(797))] if distributed_optimizer else []
    trace += [alloc(0x900000, grad, _megatron_buffers(803))]
    if distributed_optimizer:
        old = py_frames("model.py:12:__init__", *TRAIN)
        trace = [alloc(0x2000000, param, old), *trace, free(0x2000000, param, _megatron_buffers(835))]
    trace.append(alloc(0x4000000, 3 * param, py_frames("model.py:30:forward", *TRAIN)))  # the peak: a forward's
    device = api.summarize(write_snapshot({"segments": [], "device_traces": [trace]})).devices[0]
    assert device.categories["gradient"] == grad
    assert device.categories.get("parameter", 0) == (param if distributed_optimizer else 0)
    assert {g.site for g in device.groups if g.category == "gradient"} == \
        {"param_and_grad_buffer.py:__init__ (last allocating line) <- zeros"}


def _memdiff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def _record_fsdp(cwd: Path, out: str, *flags: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", out, "--", sys.executable, "-m",
                           "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(port), str(FSDP_TRAIN), "--facts", str(cwd / "facts.json"), *flags],
                          cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr


def _parameter_rows(report, tmp_path: Path) -> str:
    """What a failure needs to be explained: the rows read as parameters, and where the recordings
    are (pytest keeps the last runs' tmp_path)."""
    rows = [{**{k: r.get(k) for k in ("site", "status", "base_bytes", "head_bytes", "label", "matched_by")},
             "frames": r.get("frames", [])[:6]}
            for r in report["devices"][0]["rows"] if r.get("category") == "parameter"]
    return f"parameter rows: {json.dumps(rows)}; recordings in {tmp_path}"


@pytest.mark.slow
def test_fsdp2_reshard_after_forward_reads_as_unsharded_parameters_held_per_rank(torch, tmp_path):
    _record_fsdp(tmp_path, "reshard/")
    _record_fsdp(tmp_path, "keep/", "--no-reshard")
    facts = json.loads((tmp_path / "facts.json").read_text())
    shard = facts["parameter_bytes"] // facts["world_size"]  # the model's weights, split evenly (no padding)
    for rank in range(facts["world_size"]):
        base, head = (str(tmp_path / run / f"rank{rank}.pickle") for run in ("reshard", "keep"))
        done = _memdiff("diff", base, head, "--format", "json")
        assert done.returncode in (0, 1), done.stderr
        report = json.loads(done.stdout)
        categories = {c["category"]: c for c in report["devices"][0]["categories"]}
        # Every rank holds its shard of the weights (a rank whose profiler missed a free on gloo's
        # thread once read 8 more shards as older than the trace: tests/test_normalize.py keeps
        # that capture)
        assert categories["parameter"]["base_bytes"] == categories["parameter"]["head_bytes"] == shard, \
            _parameter_rows(report, tmp_path)
        # The full weights stay gathered from each block's forward to its backward. Not checked at the
        # run's own peak: which phase peaks varies from run to run, and one in the optimizer step, after
        # the backward resharded them, held none in either run (CI saw the delta 0 there). At the
        # forward's peak they are held, and the headline names them first, never the collective buffers
        # (which gloo's threads still hold there varies from run to run too).
        done = _memdiff("diff", base, head, "--format", "json", "--at", "forward")
        assert done.returncode in (0, 1), done.stderr
        report = json.loads(done.stdout)
        categories = {c["category"]: c for c in report["devices"][0]["categories"]}
        assert categories.get("unsharded_parameter", {}).get("base_bytes", 0) < \
            categories["unsharded_parameter"]["head_bytes"]
        assert categories["parameter"]["base_bytes"] == categories["parameter"]["head_bytes"] == shard
        headline = json.dumps(report["headline"])
        assert "unsharded_parameter" in headline
        assert "communication" not in headline.split("unsharded_parameter")[0]
        # in the optimizer step every rank holds its shard of the weights and of the gradients
        done = _memdiff("diff", base, head, "--format", "json", "--at", "optimizer")
        assert done.returncode in (0, 1), done.stderr
        categories = {c["category"]: c for c in json.loads(done.stdout)["devices"][0]["categories"]}
        assert categories["gradient"]["base_bytes"] == categories["gradient"]["head_bytes"] == shard
    ranks = _memdiff("ranks", str(tmp_path / "keep"))
    assert ranks.returncode == 0, ranks.stderr
    assert "unsharded_parameter" in ranks.stdout
