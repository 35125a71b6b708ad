"""`memdiff record --emulate GPU -o DIR/ --ranks LIST -- accelerate launch ...`: the ranks named of the
job an accelerate command describes run alone, each with the environment accelerate's own launch gives
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
