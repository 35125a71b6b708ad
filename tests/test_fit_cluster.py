"""`memdiff fit` across a cluster: `{nodes}`, `{tp}`, `{pp}`, `{dp}` searched for the fewest that fits, the other
placeholders fixed with `--set`, and a job larger than one node run as the ranks `--ranks auto` picks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memdiff.errors import InputError
from memdiff.predict.fit import FITS, Fewest, FitRun, Grid, fixed, knob_of, parse_set, runs_picked_ranks
from memdiff.predict.fit_gate import judge
from memdiff.recording.emulate.gpus import gpu

ROOT = Path(__file__).resolve().parents[1]
FSDP = ROOT / "tests" / "scenarios" / "fsdp_train.py"
MIB = 1 << 20


def memdiff(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}
    return subprocess.run([sys.executable, "-m", "memdiff", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def test_set_fixes_the_placeholders_fit_does_not_search():
    command = ["torchrun", "--nproc-per-node", "8", "train.py", "--tp", "{tp}", "--pp", "{pp}", "--dp", "{dp}"]
    values = dict(parse_set(s) for s in ["tp=8", "pp=2"])
    assert values == {"tp": 8, "pp": 2}
    rest = fixed(command, values)
    assert rest[4:] == ["--tp", "8", "--pp", "2", "--dp", "{dp}"]
    assert knob_of(rest, {}) == "dp"  # the one left is searched


@pytest.mark.parametrize("text", ["tp", "tp=", "tp=0", "tp=x", "=8", "t-p=8"])
def test_a_set_that_is_not_name_equals_a_count_is_refused(text):
    with pytest.raises(InputError) as caught:
        parse_set(text)
    assert caught.value.path == "--set" and "NAME=VALUE" in caught.value.message


def test_a_set_the_command_has_no_place_for_is_refused():
    with pytest.raises(InputError) as caught:
        fixed(["torchrun", "train.py", "--tp", "{tp}"], {"pp": 2})
    assert caught.value.path == "--set" and "{pp}" in caught.value.message


def test_several_placeholders_say_how_to_fix_the_others():
    with pytest.raises(InputError) as caught:
        knob_of(["train.py", "--tp", "{tp}", "--dp", "{dp}"], {})
    assert "fit searches one" in caught.value.message and "--set" in caught.value.message


def _run(value: int, ranks: list, world: int) -> FitRun:
    return FitRun(gpu="h100", value=value, outcome=FITS, snapshot="", log="", peak_bytes=MIB,
                  reserved_peak_bytes=2 * MIB, phase=None, step=None, site=None, oom_message=None, seconds=1.0,
                  cpu_seconds=1.0, why="ascending", ranks_run=ranks, world_size=world)


def test_the_answer_says_which_ranks_ran_and_that_the_others_did_not():
    search = Fewest(gpu("h100"), Grid("nodes", 1, 8), 1.0, None)
    search.started(0, "ascending")
    search.finished(0, _run(1, [0, 63], 64))
    assert search.answer().line.endswith("at 1 ran ranks 0, 63 of 64 (one per role, --ranks auto), the others "
                                         "not run")
    search = Fewest(gpu("h100"), Grid("nodes", 1, 8), 1.0, None)
    search.started(0, "ascending")
    search.finished(0, _run(1, [0, 1], 2))
    assert search.answer().line.endswith("at 1 ran each of its 2 ranks alone (--ranks auto)")


def test_more_nodes_needed_is_the_loss_and_says_nodes():
    baseline = {"knob": "nodes", "direction": "smallest", "gpus": [{"gpu": "h100", "value": 2}]}
    (found,) = judge({"h100": 3}, "nodes", baseline, "baselines/fit.json")
    assert found.code == "G011" and "h100 nodes 2 -> 3 (the fewest nodes on which every rank's" in found.message
    assert judge({"h100": 1}, "nodes", baseline, "baselines/fit.json") == []


@pytest.mark.parametrize("command, knob, picked", [
    # one node of 8: run whole, as fit always ran a launcher
    (["torchrun", "--nproc-per-node", "8", "train.py"], "batch", False),
    # two nodes cannot start whole on one machine; 16 ranks on a node are more than fit runs whole
    (["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "train.py"], "batch", True),
    (["torchrun", "--nproc-per-node=16", "train.py"], "batch", True),
    # {nodes} searched: every value runs alike, one node included
    (["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "train.py"], "nodes", True),
    # accelerate's and DeepSpeed's jobs of 16 processes are read as --ranks reads them; a launcher --ranks
    # does not read runs whole
    (["accelerate", "launch", "--multi_gpu", "--num_processes", "16", "train.py"], "batch", True),
    (["deepspeed", "--num_gpus", "16", "train.py"], "batch", True),
    (["deepspeed", "--num_gpus", "8", "train.py"], "batch", False),
    (["mpirun", "-np", "16", "python", "train.py"], "batch", False),
])
def test_which_launched_jobs_run_as_their_picked_ranks(command, knob, picked):
    assert runs_picked_ranks(command, knob) is picked


def test_an_accelerate_deepspeed_job_of_16_processes_runs_as_its_picked_ranks(monkeypatch):
    """accelerate's DeepSpeed launch is read as --ranks reads it (its launcher needs DeepSpeed importable)."""
    pytest.importorskip("accelerate")
    from test_emulate_deepspeed import _libraries

    monkeypatch.syspath_prepend(_libraries())
    assert runs_picked_ranks(["accelerate", "launch", "--use_deepspeed", "--num_processes", "16", "train.py"], "batch")


def test_set_needs_a_place_in_the_command(tmp_path):
    done = memdiff("fit", "--emulate", "l4", "--set", "tp=8", "-o", f"{tmp_path}/runs/", "--", "torchrun",
                   "--nproc-per-node", "{nproc}", str(FSDP))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "{tp}" in done.stderr


def _parameter_bytes(width: int) -> int:
    """The scenario's model's parameter bytes, built on the meta device (no memory) from its own classes."""
    import importlib.util

    import torch
    from torch import nn

    spec = importlib.util.spec_from_file_location("fsdp_train", FSDP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = nn.Sequential(*(module.Block(width) for _ in range(module.BLOCKS)))
    return sum(t.numel() * t.element_size() for t in model.parameters())


@pytest.mark.slow
def test_nodes_finds_the_fewest_nodes_running_only_the_picked_ranks(tmp_path, torch):
    # FSDP2 at width 2048: 4 blocks of 4 w^2 fp32 weights and their biases, P = 256.1 MiB. Each rank holds
    # its shard of the weights, their gradients and AdamW's two moments, 4 x 256 MiB / world size, and beside
    # them what does not shard. By hand, with 2 ranks a node: 1 node (2 ranks) holds at AdamW's step 4P/2 of
    # shards and the square root of the second moment AdamW makes (P/2): at least 5P/2 = 640 MiB allocated; 2
    # nodes (4 ranks) hold 4P/4 of shards and at most a whole model's worth unsharded (P: one block's gathered
    # weights and gradients in its backward, or the model made whole on the rank before sharding): at most
    # 2P = 512 MiB. The caching allocator reserves some 1.3x what is allocated; a limit of 0.034 of an L4
    # (755.6 MiB) is 1.48x the 2-node ceiling and 1.18x the 1-node floor: the fewest nodes is 2.
    weights = _parameter_bytes(2048)
    assert round(weights / MIB, 1) == 256.1
    done = memdiff("fit", "--emulate", "l4", "--max-memory", "0.034", "--range", "nodes=1:4", "--jobs", "1",
                   "-o", f"{tmp_path}/runs/", "--format", "json", "--", sys.executable, "-m",
                   "torch.distributed.run", "--nnodes", "{nodes}", "--nproc-per-node", "2", str(FSDP), "--cuda",
                   "--width", "2048")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["knob"] == "nodes" and doc["direction"] == "smallest"
    (gpu,) = doc["gpus"]
    assert gpu["value"] == 2 and gpu["fails"]["value"] == 1 and gpu["fails"]["outcome"] == "over-limit"
    assert [r["value"] for r in gpu["runs"]] == [1, 2]  # from the smallest up; 3 and 4 never ran
    # Each value ran the picked ranks: rank 0 and the last rank (the world is one FSDP mesh), and at 2 nodes
    # the first node's last (1) and the last node's first (2), by their places in their nodes: every rank.
    for run, world in ((gpu["fails"], 2), (gpu["fits"], 4)):
        assert run["world_size"] == world and run["ranks_run"] == list(range(world))
        manifest = json.loads((Path(run["snapshot"]) / "memdiff-job.json").read_text())
        assert manifest["emulated_ranks"] == list(range(world))
        assert sorted(p.name for p in Path(run["snapshot"]).glob("rank*.pickle")) == [f"rank{r}.pickle"
                                                                                     for r in range(world)]
    assert "at 2 ran each of its 4 ranks alone (--ranks auto)" in gpu["line"]
    assert gpu["fits"]["reserved_peak_bytes"] <= gpu["limit_bytes"] < gpu["fails"]["reserved_peak_bytes"]
    assert gpu["fails"]["peak_bytes"] >= 5 * weights // 2 and gpu["fits"]["peak_bytes"] <= 2 * weights  # by hand
    assert 2 * weights < gpu["limit_bytes"] < 5 * weights // 2 * 1.3


LIGHTNING_RANKS = '''
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

NODES = int(sys.argv[1])
HOLDER = sys.argv[2] if len(sys.argv) > 2 else "1"  # the rank that holds more: rank 1, or the last rank
BATCH = int(sys.argv[3]) if len(sys.argv) > 3 else 8


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def on_train_start(self):
        if HOLDER == "1" and self.global_rank == 1:  # a rank that holds more than rank 0: 64 MiB over the nodes
            self.held = torch.zeros((64 << 20) // 4 // NODES, device=self.device)
        if HOLDER == "last" and self.global_rank == self.trainer.world_size - 1:  # on the last node: 96 MiB / nodes
            self.held = torch.zeros((96 << 20) // 4 // NODES, device=self.device)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(32, 32), torch.randint(0, 4, (32,))), batch_size=BATCH)
    trainer = L.Trainer(accelerator="gpu", devices=2, num_nodes=NODES, strategy="ddp", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)
'''


@pytest.mark.slow
def test_a_script_whose_lightning_launcher_starts_its_ranks_is_judged_by_every_rank_it_starts(tmp_path, torch):
    # `python train.py 1 1 {batch}` whose Trainer(devices=2, num_nodes=1) starts its rank 1 itself, one node: run
    # whole, as its launcher starts it. Rank 1 met the machine's own torch ("No supported gpu backend found!")
    # and died, and fit judged the job by rank 0 alone.
    pytest.importorskip("lightning")
    from memdiff import api

    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_RANKS)
    done = memdiff("fit", "--emulate", "l4", "--range", "batch=8:8", "--jobs", "1", "-o", f"{tmp_path}/runs/",
                   "--format", "json", "--", sys.executable, str(script), "1", "1", "{batch}")
    assert done.returncode == 0, done.stderr
    (gpu,) = json.loads(done.stdout)["gpus"]
    run = gpu["fits"]
    assert gpu["value"] == 8 and run.get("ranks_run") is None  # the whole job ran: both ranks of one node
    own = Path(run["snapshot"])
    started = own.with_name(f"{own.stem}.rank1.pickle")  # rank 1's snapshot, beside the script's own
    rank0, rank1 = (api.summarize(p).devices[0] for p in (own, started))
    # DDP's ranks are alike but for what rank 1 holds, which the model says: 64 MiB
    assert rank1.peak_bytes - rank0.peak_bytes == 64 << 20
    assert run["peak_bytes"] == rank1.peak_bytes and run["site"].startswith("rank 1: ")


@pytest.mark.slow
def test_a_lightning_job_of_several_nodes_is_fit_on_the_ranks_ranks_auto_picks(tmp_path, torch):
    # `python train.py {nodes} last` whose Trainer(devices=2, num_nodes=NODES) starts its ranks itself, and whose
    # last rank, on the last node, holds 96 MiB / nodes more than the others. Under 0.003 of an L4 (66.67 MiB),
    # with the others' 24 MiB reserved, 2 nodes reserve 72 MiB on rank 3: over. fit ran such a job as its first
    # node's ranks (0 and 1, which hold the same) and said 2 fits. Now the script stops where its launcher would
    # start the ranks, and the job runs as `record --ranks auto` runs it: rank 0 and the last rank (a DDP job has
    # no other role in its layout), and by their places in their nodes the first node's last rank (1) and the
    # last node's first (2): at 2 nodes of 2, every rank, each alone. One value keeps it cheap (docs/fit.md:
    # 3 nodes fit).
    pytest.importorskip("lightning")
    from memdiff import api

    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_RANKS)
    done = memdiff("fit", "--emulate", "l4", "--max-memory", "0.003", "--range", "nodes=2:2", "--jobs", "1",
                   "-o", f"{tmp_path}/runs/", "--format", "json", "--", sys.executable, str(script), "{nodes}", "last")
    assert done.returncode == 1, done.stderr  # no value of the range fits
    (gpu,) = json.loads(done.stdout)["gpus"]
    run = gpu["fails"]
    assert gpu["value"] is None and run["value"] == 2 and run["outcome"] == "over-limit"
    assert (run["ranks_run"], run["world_size"], run["ranks_how"]) == ([0, 1, 2, 3], 4, "one per role")
    folder = Path(run["snapshot"])  # the job's folder, as a torchrun job's: rank0.pickle ... rank3.pickle
    assert sorted(p.name for p in folder.glob("*.pickle")) == [f"rank{r}.pickle" for r in range(4)]
    assert not folder.with_suffix(".pickle").exists()  # the script's own run read the job, and is no rank
    manifest = json.loads((folder / "memdiff-job.json").read_text())
    assert (manifest["world_size"], manifest["emulated_ranks"], "first_node" in manifest) == (4, [0, 1, 2, 3], False)
    rank0, rank1, rank2, last = (api.summarize(folder / f"rank{r}.pickle").devices[0] for r in range(4))
    assert last.peak_bytes - rank0.peak_bytes == 48 << 20  # what the last rank holds at 2 nodes, to the byte
    assert rank0.peak_bytes == rank1.peak_bytes == rank2.peak_bytes
    assert run["peak_bytes"] == last.peak_bytes and run["site"].startswith("rank 3: ")
    assert rank0.reserved_peak_bytes < gpu["limit_bytes"] < run["reserved_peak_bytes"]  # rank 0 (and 1) fit
    assert "ran each of its 4 ranks alone (--ranks auto)" in gpu["line"]


def test_a_lightning_job_fit_already_read_is_not_run_again_to_read_it(tmp_path):
    from memdiff.recording.launch_lightning import KNOWN, probe

    env = {KNOWN: json.dumps({"devices": 2, "num_nodes": 3}), "PATH": "/nowhere"}
    launch, status = probe(["no-such-python", "train.py"], env, str(tmp_path), lambda _: None, lambda: False)
    assert status == 0 and launch is not None and (launch.nnodes, launch.nproc_per_node) == (3, 2)
    assert KNOWN not in env  # taken out: no rank sees it


@pytest.mark.slow
def test_a_job_of_two_nodes_its_lightning_launcher_starts_records_its_first_node(tmp_path, torch):
    # `record -o runs/ -- python train.py 2`: rank 0 and the rank 1 it starts waited for the second node's ranks,
    # which never start here, in DDP's first collective, for the group's timeout (30 minutes).
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_RANKS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "l4", "-o", f"{tmp_path}/runs/",
                           "--", sys.executable, str(script), "2"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(ranks 0-1, its first node's, as its Lightning launcher starts them)" in done.stderr
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert (manifest["world_size"], manifest["emulated_ranks"], manifest["first_node"]) == (4, [0, 1], True)
    assert [r["state"] for r in manifest["ranks"]] == ["written", "written", "not emulated", "not emulated"]
    ranks = memdiff("ranks", f"{tmp_path}/runs/")
    assert ranks.returncode == 0, ranks.stderr
    assert "2 ranks of 4 ranks emulated, its first node's" in ranks.stderr
