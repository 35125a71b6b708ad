"""`memdiff record --emulate GPU -o DIR/ --ranks LIST -- accelerate launch ...`: the ranks named of the
job an accelerate or DeepSpeed command describes run alone, each with the environment its own launcher gives
it (docs/jobs.md, "Some ranks of a large job")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from test_record_ranks import free_port

# Slow (the fast loop, -m "not slow", leaves it out): every test runs processes that import torch.
pytestmark = pytest.mark.slow

# What a rank is told by its launcher, printed in one write (the ranks share stdout); the tensor makes
# it a process that recorded something.
SAYS = textwrap.dedent("""
    import os
    import torch

    torch.ones(1024, device="cuda" if torch.cuda.is_available() else "cpu")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
    told = sorted(f"{k}={v}" for k, v in os.environ.items() if k in names or k.startswith(("ACCELERATE_", "FSDP_")))
    os.write(1, (" ".join(told) + "\\n").encode())
""")


def test_a_rank_of_an_accelerate_job_runs_alone_with_the_environment_accelerate_gives_it(torch, tmp_path):
    pytest.importorskip("accelerate")
    (tmp_path / "says.py").write_text(SAYS)
    options = ["--use_fsdp", "--num_processes", "2", "--mixed_precision", "bf16", "--fsdp_sharding_strategy",
               "SHARD_GRAD_OP", "--main_process_port", str(free_port()), "says.py"]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))  # no accelerate config of this machine's
    # the truth: accelerate's own launch of the whole job, on the CPU
    real = subprocess.run(["accelerate", "launch", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert real.returncode == 0, real.stderr[-3000:]
    told = sorted(real.stdout.splitlines())
    assert len(told) == 2 and "ACCELERATE_MIXED_PRECISION=bf16" in told[1] and "RANK=1" in told[1].split()
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks",
                           "1", "--", "accelerate", "launch", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 1 alone, told what accelerate told it: its rank, the job's size, the precision and FSDP's settings
    assert done.stdout.splitlines() == [told[1]]
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.pickle")) == ["rank1.pickle"]
    assert "wrote 1 snapshot of a job of 2 ranks (rank 1, each run alone)" in done.stderr


def test_an_accelerate_launch_of_one_process_or_a_bad_option_is_one_line_exit_2(torch, tmp_path):
    pytest.importorskip("accelerate")
    (tmp_path / "says.py").write_text(SAYS)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    for options, said in ((["--num_processes", "1", "says.py"], "starts one process"),
                          (["--num_processes", "two", "says.py"], "accelerate launch refuses the command")):
        done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/",
                               "--ranks", "0", "--", "accelerate", "launch", *options], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600, env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*.pickle"))


# A rank as DeepSpeed's launcher starts it (deepspeed/launcher/launch.py): its own variables, the node's
# GPUs made visible, and `--local_rank=N` passed to the script, which DeepSpeed scripts parse.
SAYS_DEEPSPEED = textwrap.dedent("""
    import argparse
    import os
    import torch

    torch.ones(1024, device="cuda" if torch.cuda.is_available() else "cpu")
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--lr")
    args = parser.parse_args()
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "CUDA_VISIBLE_DEVICES",
             "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
    told = sorted(f"{k}={v}" for k, v in os.environ.items() if k in names)
    os.write(1, (" ".join(told) + f" --local_rank={args.local_rank} --lr={args.lr}\\n").encode())
""")


def _deepspeed_ranks(tmp_path, ranks: str, *options: str) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o runs/ --ranks RANKS -- deepspeed OPTIONS` (DeepSpeed itself need
    not be installed: memdiff reads its launcher's command and starts the ranks as it would)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks",
                           ranks, "--", "deepspeed", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**env, "OMP_NUM_THREADS": "1"})


def test_ranks_of_a_deepspeed_job_run_alone_as_deepspeeds_launcher_starts_them(torch, tmp_path):
    """Rank 11 of two nodes of 8 GPUs is told what DeepSpeed 0.19.8's launcher tells it (its launch.py:
    RANK, LOCAL_RANK = rank % 8, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK = node, CROSS_SIZE, the node's 8 GPUs
    visible, `--local_rank=3` before the script's own arguments; none of torchrun's variables). Checked
    once against the real launcher on a CPU: `deepspeed --num_gpus 2 says.py --lr 1e-4` told rank 1 the
    line `--ranks 1` of the same command prints here."""
    (tmp_path / "says.py").write_text(SAYS_DEEPSPEED)
    done = _deepspeed_ranks(tmp_path, "0,11", "--num_nodes", "2", "--num_gpus", "8", "says.py", "--lr", "1e-4")
    assert done.returncode == 0, done.stderr[-3000:]
    gpus = "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"
    assert sorted(done.stdout.splitlines()) == [
        f"CROSS_RANK=0 CROSS_SIZE=2 {gpus} LOCAL_RANK=0 LOCAL_SIZE=8 RANK=0 WORLD_SIZE=16 --local_rank=0 --lr=1e-4",
        f"CROSS_RANK=1 CROSS_SIZE=2 {gpus} LOCAL_RANK=3 LOCAL_SIZE=8 RANK=11 WORLD_SIZE=16 --local_rank=3 --lr=1e-4"]
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.pickle")) == ["rank0.pickle", "rank11.pickle"]
    assert "wrote 2 snapshots of a job of 16 ranks (ranks 0, 11, each run alone)" in done.stderr
    # A hostfile's hosts and slots size the job; --module runs a module, --no_local_rank passes no rank.
    (tmp_path / "hosts").write_text("# two workers\nworker-0 slots=4\nworker-1 slots=4\n")
    done = _deepspeed_ranks(tmp_path, "5", "-H", "hosts", "--no_local_rank", "--module", "says", "--lr", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["CROSS_RANK=1 CROSS_SIZE=2 CUDA_VISIBLE_DEVICES=0,1,2,3 LOCAL_RANK=1 "
                                        "LOCAL_SIZE=4 RANK=5 WORLD_SIZE=8 --local_rank=-1 --lr=2"]


def test_a_deepspeed_job_memdiff_cannot_size_is_one_line_exit_2(tmp_path):
    (tmp_path / "says.py").write_text(SAYS_DEEPSPEED)
    (tmp_path / "uneven").write_text("worker-0 slots=8\nworker-1 slots=4\n")
    for options, said in ((["says.py"], "give --num_gpus N"),
                          (["--num_gpus", "two", "says.py"], "deepspeed refuses the command: "),
                          (["--include", "localhost:0,1", "says.py"], "--include/--exclude are not read"),
                          (["-H", "uneven", "says.py"], "its hosts have different slots (8, 4)"),
                          (["-H", "missing", "says.py"], "missing: no such hostfile"),
                          (["--num_gpus", "2", "gone.py"], "gone.py: no such script")):
        done = _deepspeed_ranks(tmp_path, "0", *options)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*.pickle"))


def test_deepspeeds_runner_is_read_however_it_is_started(tmp_path):
    """`deepspeed`, `python PATH/deepspeed` (the installed script run by a chosen Python) and `python -m
    deepspeed.launcher.runner` are one launcher; each rank runs `python -u SCRIPT --local_rank=N ARGS`."""
    from memdiff.recording.launch_deepspeed import read_deepspeed

    options = ["--num_nodes", "2", "--num_gpus", "4", "train.py", "--lr", "1"]
    for start in (["deepspeed"], ["python3", "/opt/venv/bin/deepspeed"], ["python", "-m", "deepspeed.launcher.runner"]):
        launch = read_deepspeed(start + options)
        assert (launch.nnodes, launch.nproc_per_node) == (2, 4)
        assert launch.command(6)[1:] == ["-u", "train.py", "--local_rank=2", "--lr", "1"]
