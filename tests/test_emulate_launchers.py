"""`memdiff record --emulate GPU -o DIR/ --ranks LIST -- accelerate launch ...`: the ranks named of the
job an accelerate or DeepSpeed command describes run alone, each with the environment its own launcher gives
it (docs/jobs.md, "Some ranks of a large job")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT
from test_emulate_deepspeed import _libraries as deepspeed_libraries
from test_record_ranks import free_port

# Slow (the fast loop, -m "not slow", leaves it out): every test runs processes that import torch.
pytestmark = pytest.mark.slow

ACCELERATE_DEEPSPEED = ROOT / "tests" / "scenarios" / "accelerate_deepspeed_train.py"

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



def test_accelerate_launch_of_n_processes_without_multi_gpu_starts_n_ranks_as_on_a_node_of_n_gpus(torch, tmp_path,
                                                                                                 monkeypatch):
    """`accelerate launch --num_processes 2 train.py` (no --multi_gpu, no config: accelerate's nd_parallel
    README) asks the node how many GPUs it has and launches multi-GPU when there are more than one. The
    emulated launcher saw one GPU and started the script once, as a single process (accelerate's
    `nd_parallel.py` then stopped: "Mesh should not be bigger than default world size 1"); a node has the
    GPUs the job asks for."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    options = ["--num_processes", "2", "--main_process_port", str(free_port()), "says.py"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no accelerate config of this machine's
    # the truth: accelerate's own reading of the command on a node with 2 GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(options))
    assert args.multi_gpu and args.num_processes == 2
    monkeypatch.undo()
    # --ranks reads the command for the same job
    from memdiff.recording.launch_accelerate import read_accelerate
    assert read_accelerate(["accelerate", "launch", *options]).nproc_per_node == 2
    (tmp_path / "says.py").write_text(SAYS)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--",
                           "accelerate", "launch", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    told = sorted(done.stdout.splitlines())
    assert len(told) == 2 and all("WORLD_SIZE=2" in line.split() for line in told), done.stdout
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.pickle")) == ["rank0.pickle", "rank1.pickle"]

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


def test_only_a_script_python_runs_itself_is_run_first_to_read_the_job_it_starts():
    """`python train.py` (or `python -m MODULE`) may start its ranks from inside (Lightning's launcher): --ranks
    runs it once to read its job (tests/test_emulate_jobs.py). A launcher that Python runs is read as that
    launcher, never run to find out; any other program is no launcher --ranks reads."""
    from memdiff.recording.launchers import runs_a_script

    assert runs_a_script(["python", "train.py", "--lr", "1"]) and runs_a_script(["python3.11", "-m", "pkg.train"])
    for launcher in (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"],
                     ["python", "-m", "accelerate.commands.launch", "--multi_gpu", "train.py"],
                     ["python3", "/opt/venv/bin/deepspeed", "train.py"], ["torchrun", "train.py"], ["./train.sh"]):
        assert not runs_a_script(launcher), launcher


# accelerate's DeepSpeed launch (accelerate 1.15's deepspeed_launcher) needs DeepSpeed where it runs: its
# own launcher stops without it, and the ranks' Accelerator imports it.
def _with_deepspeed(tmp_path) -> dict:
    """This environment, with DeepSpeed importable (MEMDIFF_DEEPSPEED_LIBS) and no accelerate config of
    this machine's."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"),
            "PYTHONPATH": os.pathsep.join((str(ROOT), deepspeed_libraries()))}


def test_a_rank_of_an_accelerate_deepspeed_job_is_told_what_accelerates_launcher_tells_it(torch, tmp_path):
    """On one machine accelerate's DeepSpeed launch is torchrun with accelerate's DeepSpeed variables and
    the working folder appended to PYTHONPATH: the real launcher's rank 1 (run here on the CPU; its
    ranks need no GPU to print) and `--ranks 1` of the same command say the same line."""
    pytest.importorskip("accelerate")
    (tmp_path / "says.py").write_text(SAYS + textwrap.dedent("""
        path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        os.write(1, f"working folder last on PYTHONPATH: {path[-1] == os.getcwd()}\\n".encode())
    """))
    options = ["--use_deepspeed", "--num_processes", "2", "--zero_stage", "2", "--mixed_precision", "bf16",
               "--gradient_accumulation_steps", "4", "--main_process_port", str(free_port()), "says.py"]
    env = _with_deepspeed(tmp_path)
    real = subprocess.run(["accelerate", "launch", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert real.returncode == 0, real.stderr[-3000:]
    told = sorted(real.stdout.splitlines())
    rank1 = next(line for line in told if "RANK=1" in line.split())
    assert told.count("working folder last on PYTHONPATH: True") == 2
    assert {"ACCELERATE_USE_DEEPSPEED=true", "ACCELERATE_DEEPSPEED_ZERO_STAGE=2", "WORLD_SIZE=2",
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4"} <= set(rank1.split())
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks",
                           "1", "--", "accelerate", "launch", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == [rank1, "working folder last on PYTHONPATH: True"]
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.pickle")) == ["rank1.pickle"]
    # without DeepSpeed, as accelerate's launcher does, the command is refused: one line, exit 2
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "again/", "--ranks",
                           "1", "--", "accelerate", "launch", *options], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**env, "PYTHONPATH": str(ROOT)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "needs DeepSpeed installed" in lines[0], done.stderr


# The jobs of accelerate's DeepSpeed launches on several machines, read in one process: by its default
# launcher (DeepSpeed's runner over pdsh, `--no_local_rank`, the variables accelerate writes to its
# `.deepspeed_env`), by `nossh` (DeepSpeed's runner, which passes --local_rank) and by `standard` (torchrun).
READ = textwrap.dedent("""
    import json, sys
    from memdiff.errors import InputError
    from memdiff.recording.launch import rank_env
    from memdiff.recording.launchers import read_launch

    said = {}
    for name, command in json.loads(sys.argv[1]).items():
        try:
            launch = read_launch(command)
        except InputError as exc:
            said[name] = str(exc)
            continue
        said[name] = {"nodes": launch.nnodes, "per_node": launch.nproc_per_node, "rank11": launch.command(11)[1:],
                      "env": {**launch.env, **rank_env(launch, 11, [11], 29500)}}
    print(json.dumps(said))
""")


def test_accelerate_deepspeed_jobs_of_two_machines_are_read_as_their_launchers_start_them(tmp_path):
    pytest.importorskip("accelerate")
    (tmp_path / "hosts").write_text("worker-0 slots=8\nworker-1 slots=8\n")
    (tmp_path / "config.yaml").write_text(textwrap.dedent("""
        compute_environment: LOCAL_MACHINE
        distributed_type: DEEPSPEED
        deepspeed_config: {zero_stage: 3, offload_param_device: cpu, gradient_accumulation_steps: 2}
        mixed_precision: bf16
        num_machines: 2
        num_processes: 16
        machine_rank: 0
    """))
    two = ["--num_processes", "16", "--num_machines", "2", "--machine_rank", "0"]
    job = ["train.py", "--lr", "1e-4"]
    commands = {
        "pdsh": ["accelerate", "launch", "--use_deepspeed", *two, "--deepspeed_hostfile", "hosts", "--zero_stage",
                 "3", "--offload_optimizer_device", "cpu", *job],
        "nossh": ["accelerate", "launch", "--use_deepspeed", *two, "--deepspeed_hostfile", "hosts",
                  "--deepspeed_multinode_launcher", "nossh", *job],
        "standard": ["accelerate", "launch", "--config_file", "config.yaml", "--deepspeed_multinode_launcher",
                     "standard", "--main_process_ip", "10.0.0.1", *job],
        "no hostfile": ["accelerate", "launch", "--use_deepspeed", *two, *job],
        "openmpi": ["accelerate", "launch", "--use_deepspeed", *two, "--deepspeed_hostfile", "hosts",
                    "--deepspeed_multinode_launcher", "openmpi", *job]}
    done = subprocess.run([sys.executable, "-c", READ, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=_with_deepspeed(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout)
    pdsh, nossh, standard = read["pdsh"], read["nossh"], read["standard"]
    for job_read in (pdsh, nossh, standard):
        assert (job_read["nodes"], job_read["per_node"], job_read["env"]["WORLD_SIZE"]) == (2, 8, "16")
        assert (job_read["env"]["RANK"], job_read["env"]["LOCAL_RANK"]) == ("11", "3")
        assert job_read["env"]["ACCELERATE_USE_DEEPSPEED"] == "true"
    # DeepSpeed's launcher's variables, the options accelerate gave as variables, and no --local_rank
    # (accelerate starts its runner with --no_local_rank); the empty ACCELERATE_CONFIG_DS_FIELDS is one
    # accelerate leaves out of `.deepspeed_env`
    assert pdsh["rank11"] == ["-u", "train.py", "--lr", "1e-4"]
    assert {k: pdsh["env"].get(k) for k in ("CROSS_RANK", "LOCAL_SIZE", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                                            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                                            "ACCELERATE_CONFIG_DS_FIELDS")} == \
        {"CROSS_RANK": "1", "LOCAL_SIZE": "8", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
         "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_CONFIG_DS_FIELDS": None}
    assert nossh["rank11"] == ["-u", "train.py", "--local_rank=3", "--lr", "1e-4"]
    # torchrun's variables, and accelerate's from its config file, with the fields the config set named
    assert (standard["env"]["GROUP_RANK"], standard["env"]["LOCAL_WORLD_SIZE"]) == ("1", "8")
    assert {k: standard["env"].get(k) for k in ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_MIXED_PRECISION",
                                                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                                                "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")} == \
        {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_MIXED_PRECISION": "bf16",
         "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}
    assert set(standard["env"]["ACCELERATE_CONFIG_DS_FIELDS"].split(",")) == \
        {"zero_stage", "offload_param_device", "gradient_accumulation_steps", "mixed_precision"}
    assert "give --deepspeed_hostfile FILE" in read["no hostfile"]
    assert "--launcher openmpi starts the ranks with that launcher's environment" in read["openmpi"]


def test_ranks_of_an_accelerate_deepspeed_zero2_job_run_alone_and_train(torch, tmp_path):
    """Rank 3 of 4 trains two ZeRO 2 steps under the Accelerator, alone, with a torch AdamW made
    before `prepare` moved the model: DeepSpeed's engine says the world is 4 and gives the rank a
    quarter of the parameters as its fp32 partition, and its snapshot holds, at its forward's peak, the
    bf16 weights whole (2N bytes) and that partition (4N/4 bytes), as test_emulate_deepspeed.py counts
    ZeRO 2. (Rank 0 alone costs as much again and shows nothing more here.)"""
    pytest.importorskip("accelerate")
    from memdiff import api

    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1 << 16, "allgather_bucket_size": 1 << 16}}))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks",
                           "3", "--", "accelerate", "launch", "--use_deepspeed", "--num_processes", "4",
                           "--deepspeed_config_file", "ds.json", "--mixed_precision", "bf16",
                           "--main_process_port", str(free_port()), str(ACCELERATE_DEEPSPEED)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_with_deepspeed(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    facts = sorted((json.loads(s[len("facts "):]) for s in done.stdout.splitlines() if s.startswith("facts ")),
                   key=lambda f: f["rank"])
    n = sum(facts[0]["numels"])
    assert [(f["rank"], f["world_size"], f["stage"], f["partition"]) for f in facts] == [(3, 4, 2, n // 4)]
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert manifest["emulated_ranks"] == [3]
    assert [r["state"] for r in manifest["ranks"]] == ["not emulated", "not emulated", "not emulated", "written"]
    for rank in (3,):
        device = api.summarize(tmp_path / "runs" / f"rank{rank}.pickle").devices[0]
        last = max(p.step for p in device.phase_peaks)
        forward = next(p.categories for p in device.phase_peaks if p.step == last and p.phase == "forward")
        assert forward["parameter"] == 2 * n + 4 * (n // 4)
