"""`memdiff record --emulate GPU -o DIR/ --ranks all --dask ADDRESS -- torchrun ...`: every rank of a job
as a task on an existing Dask cluster (docs/jobs.md). One LocalCluster for the module (its start-up is
the slow part): 2 worker processes of 1 thread, fewer than the job's ranks, as a real cluster often has.
The test of a lost scheduler starts a scheduler of its own, a process it kills."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT

from memdiff.analyse.classify import load_rules
from memdiff.cli import main
from memdiff.read.inputs import read_summary

# Slow (the fast loop, -m "not slow", leaves it out): a Dask cluster and emulated processes.
pytestmark = pytest.mark.slow

# Each rank trains DDP on its GPU, then says what rank 0 broadcast and whose names the gather gave it.
DDP = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    settings = [{"from": rank} if rank == 0 else None]
    dist.broadcast_object_list(settings, src=0)
    names = [None] * world
    dist.all_gather_object(names, f"r{rank}")
    os.write(1, f"rank {rank} of {world} got {settings[0]} names {names}\\n".encode())
    dist.destroy_process_group()
""")
PARAMETERS = (1024 * 1024 + 1024) * 4  # the Linear's weight and bias, in fp32

# A rank that holds (rank + 1) MiB, says so, and waits to be stopped.
WAITS = textwrap.dedent("""
    import os
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    kept = torch.empty((dist.get_rank() + 1) << 20, dtype=torch.uint8, device="cuda")
    time.sleep(300)
""")


# Rank 0 holds 1 MiB and ends; every other rank holds (rank + 1) MiB and waits to be stopped.
ZERO_ENDS = textwrap.dedent("""
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    kept = torch.empty((dist.get_rank() + 1) << 20, dtype=torch.uint8, device="cuda")
    if dist.get_rank():
        time.sleep(300)
""")


# Each rank holds (rank + 1) MiB and ends once the file `go` is there.
WAITS_FOR_GO = textwrap.dedent("""
    import os
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    kept = torch.empty((dist.get_rank() + 1) << 20, dtype=torch.uint8, device="cuda")
    while not os.path.exists("go"):
        time.sleep(0.1)
""")


@pytest.fixture(scope="module")
def scheduler():
    """The address of a LocalCluster of 2 worker processes, 1 thread each, for the module's tests. Its
    workers ignore SIGINT, as workers started in the background by a shell do (`dask worker ADDRESS &`,
    a CI step): what they start inherits that, and the Ctrl-C test hung (300 s) under CI, where the
    whole run starts so, until each rank took SIGINT back at its default."""
    distributed = pytest.importorskip("distributed")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the processes it starts
    try:
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address=None)
    finally:
        signal.signal(signal.SIGINT, previous)
    with cluster:
        yield cluster.scheduler_address


def _record(cwd: Path, output: str, ranks: str, *dask: str, script: str = "ddp.py") -> list:
    return [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", output, "--ranks", ranks, *dask,
            "--", "torchrun", "--nproc-per-node", "4", script]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_every_rank_of_a_ddp_job_runs_as_a_task_and_holds_what_it_holds_run_here(torch, tmp_path, scheduler):
    (tmp_path / "ddp.py").write_text(DDP)
    done = subprocess.run(_record(tmp_path, "runs/", "all", "--dask", scheduler), cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["memdiff-job.json", *(f"rank{r}.pickle" for r in range(4))]
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    assert manifest["world_size"] == 4 and manifest["exit_status"] == 0 and manifest["emulated_ranks"] == [0, 1, 2, 3]
    assert [(r["rank"], r["state"]) for r in manifest["ranks"]] == [(r, "written") for r in range(4)]
    # Each rank's output comes back with its task. Rank 0 ran first: every other rank heard its
    # broadcast and its name; the ranks that ran beside each other did not wait on each other, and
    # keep their own values for them, as a rank run alone does.
    assert sorted(done.stdout.splitlines()) == [
        "rank 0 of 4 got {'from': 0} names ['r0', 'r0', 'r0', 'r0']",
        *(f"rank {r} of 4 got {{'from': 0}} names ['r0', 'r{r}', 'r{r}', 'r{r}']" for r in (1, 2, 3))]
    # Run here, beside each other, rank 0 and rank 1 (a replica like ranks 2 and 3) hold the same memory
    here = subprocess.run(_record(tmp_path, "here/", "0,1"), cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=_env())
    assert here.returncode == 0, here.stderr[-3000:]
    rules = load_rules()
    remote = [read_summary(str(runs / f"rank{r}.pickle"), rules).devices[0] for r in range(4)]
    local = [read_summary(str(tmp_path / "here" / f"rank{r}.pickle"), rules).devices[0] for r in (0, 1, 1, 1)]
    for rank in range(4):
        assert remote[rank].categories.get("parameter") == PARAMETERS  # the model's own size
        assert (remote[rank].peak_bytes, remote[rank].static_bytes) == (local[rank].peak_bytes,
                                                                        local[rank].static_bytes)


def test_ctrl_c_stops_the_running_ranks_with_their_snapshots_and_starts_no_other(torch, tmp_path, scheduler):
    # Ranks 1-3 all at once (no rank 0 to run first) on 2 worker threads: two run, one waits its turn.
    (tmp_path / "waits.py").write_text(WAITS)
    job = subprocess.Popen(_record(tmp_path, "runs/", "1-3", "--dask", scheduler, script="waits.py"), cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    runs = tmp_path / "runs"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # both running ranks recording (their hook says so)
        states = [json.loads(p.read_text()).get("state") for p in runs.glob(".rank*.status") if p.stat().st_size]
        if states.count("recording") == 2:
            break
        time.sleep(0.5)
    assert states.count("recording") == 2, job.communicate(timeout=60)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 130, err[-3000:]
    written = sorted(int(p.stem[4:]) for p in runs.glob("rank*.pickle"))
    assert len(written) == 2
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    # the rank that had not started never ran: the job is the two that ran, each stopped by the signal
    assert manifest["exit_status"] == 130 and manifest["emulated_ranks"] == written
    assert [r["state"] for r in manifest["ranks"] if r["rank"] in written] == ["written", "written"]


@contextlib.contextmanager
def _killable_scheduler(folder: Path):
    """A scheduler, a process of its own that a test can kill as a machine's failure would, and a worker
    of 2 threads under its nanny; the scheduler's address and process."""
    pytest.importorskip("distributed")
    file = folder / "scheduler.json"
    env, quiet = _env(), subprocess.DEVNULL
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", "0", "--no-dashboard", "--scheduler-file", str(file)], env=env,
                                 stdout=quiet, stderr=quiet)
    worker = None
    try:
        deadline = time.monotonic() + 120
        while not (file.exists() and file.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.1)
        address = json.loads(file.read_text())["address"]
        worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "2",
                                   "--no-dashboard"], env=env, stdout=quiet, stderr=quiet)
        yield address, scheduler
    finally:
        for process in (worker, scheduler):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


@contextlib.contextmanager
def _ended_at_last(job: subprocess.Popen):
    """A dict for the pids of the ranks a test sees (rank: pid); at the end, `job` and any of them that
    outlived the test (the bug tested) are killed, so that no failure leaves a rank running."""
    ranks: dict = {}
    try:
        yield ranks
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for pid in ranks.values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _recording(job: subprocess.Popen, runs: Path, count: int) -> dict:
    """Each rank but 0 that is recording (its hook says so), with its pid, once `count` are (or the job ended)."""
    deadline, found = time.monotonic() + 300, {}
    while time.monotonic() < deadline and len(found) < count and job.poll() is None:
        for status in runs.glob(".rank*.status") if runs.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):  # being written
                said = json.loads(status.read_text())
                if said.get("state") == "recording" and said.get("rank"):
                    found[said["rank"]] = said["pid"]
        time.sleep(0.2)
    return found


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a killed orphan is a zombie until init reaps it: not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_lost_scheduler_stops_the_running_ranks_and_the_manifest_marks_them_not_finished(torch, tmp_path,
                                                                                            capsys):
    # its own scheduler, a process the test kills, and a worker of 2 threads (ranks 1 and 2 at once)
    (tmp_path / "zero_ends.py").write_text(ZERO_ENDS)
    runs = tmp_path / "runs"
    with _killable_scheduler(tmp_path) as (address, scheduler):
        job = subprocess.Popen(_record(tmp_path, "runs/", "0-2", "--dask", address, script="zero_ends.py"),
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        with _ended_at_last(job) as waiting:
            waiting.update(_recording(job, runs, 2))
            assert sorted(waiting) == [1, 2], job.communicate(timeout=60)  # rank 0 ended; 1 and 2 hold memory
            scheduler.kill()  # as a machine that fails would: no goodbye to anyone
            killed = time.monotonic()
            _, err = job.communicate(timeout=120)
            ended = time.monotonic() - killed
            deadline = time.monotonic() + 30
            while any(_running(pid) for pid in waiting.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            stopped = time.monotonic() - killed
            still = [rank for rank, pid in waiting.items() if _running(pid)]
    assert job.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(f"memdiff: --dask {address}: lost")]
    assert len(lines) == 1 and lines[0].startswith(f"memdiff: --dask {address}: lost the connection to the "
                                                   f"scheduler while the tasks of 2 ranks had not ended (1-2)"), err
    for rank in (1, 2):  # and each missing rank, as any job's
        assert f"memdiff: rank {rank} of 4 has no snapshot: its task had not ended when memdiff lost the " \
               f"connection to the Dask scheduler {address}" in err
    assert "Traceback" not in err, err
    assert not still, err  # the ranks the job still ran are stopped on their worker, not left holding its memory
    assert ended < 10 and stopped < 10, (ended, stopped)  # measured: 0.3 s both
    # rank 0 finished and is read; ranks 1 and 2 are in the job, not finished, and say why
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    assert manifest["exit_status"] == 2 and manifest["emulated_ranks"] == [0, 1, 2]
    states = {r["rank"]: (r["state"], r.get("error", "")) for r in manifest["ranks"]}
    assert states[0][0] == "written" and (runs / "rank0.pickle").is_file()
    for rank in (1, 2):
        assert states[rank][0] == "not finished" and "lost the connection to the Dask scheduler" in states[rank][1]
        assert not (runs / f"rank{rank}.pickle").exists()
    # read later, the job is not whole: the missing ranks are named
    assert main(["ranks", str(runs)]) == 2
    assert "2 ranks missing of 0-3 (its memdiff-job.json says 4): 1-2" in capsys.readouterr().err


def test_a_rank_whose_client_is_killed_is_stopped_on_its_worker(torch, tmp_path, scheduler):
    (tmp_path / "waits_for_go.py").write_text(WAITS_FOR_GO)
    job = subprocess.Popen(_record(tmp_path, "runs/", "1", "--dask", scheduler, script="waits_for_go.py"),
                           cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    with _ended_at_last(job) as waiting:
        waiting.update(_recording(job, tmp_path / "runs", 1))
        assert list(waiting) == [1], job.wait(timeout=60)
        job.kill()  # memdiff itself killed: the scheduler releases its tasks
        job.wait()
        killed, deadline = time.monotonic(), time.monotonic() + 30
        while _running(waiting[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() - killed < 5  # its task saw that no one waits for it, and killed it


def test_a_rank_whose_worker_dies_dies_with_it_and_is_never_run_twice(torch, tmp_path, scheduler):
    # Ranks 1 and 2 on the two workers of one thread; the ranks wait for a file the test makes.
    (tmp_path / "waits_for_go.py").write_text(WAITS_FOR_GO)
    runs = tmp_path / "runs"
    job = subprocess.Popen(_record(tmp_path, "runs/", "1,2", "--dask", scheduler, script="waits_for_go.py"),
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    with _ended_at_last(job) as waiting:
        waiting.update(_recording(job, runs, 2))
        assert sorted(waiting) == [1, 2], job.communicate(timeout=60)
        worker = int(Path(f"/proc/{waiting[1]}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        os.kill(worker, signal.SIGKILL)  # as the kernel's OOM killer would (its nanny starts another)
        killed, deadline = time.monotonic(), time.monotonic() + 30
        while _running(waiting[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = time.monotonic() - killed
        # Dask runs the lost task again (on the other worker, or the one its nanny restarts): it must not
        # start rank 1 again
        (tmp_path / "go").write_text("")
        _, err = job.communicate(timeout=300)
    assert stopped < 5, stopped  # the rank died with its worker, not holding memory on the machine
    assert job.returncode == 2, err[-3000:]
    assert not (runs / "job2").exists() and "jobs with the same ranks" not in err, err  # rank 1 ran once
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    states = {r["rank"]: (r["state"], r.get("error", "")) for r in manifest["ranks"]}
    assert states[2][0] == "written" and (runs / "rank2.pickle").is_file()  # the other rank went on
    assert states[1][0] == "not finished" and states[1][1].startswith("its worker tcp://") \
        and "died while it ran (Dask ran its task again" in states[1][1], states
    assert f"memdiff: rank 1 of 4 has no snapshot: {states[1][1]}" in err


def test_a_pipelines_ranks_run_in_one_task_and_each_holds_what_it_holds_in_the_whole_job(torch, tmp_path, scheduler):
    """A rank on Dask hears only the ranks that ended before it started, but a pipeline's stages hear each
    other as they step (the shapes each sends the next, at the first step): so each pipeline's ranks run
    in one task, side by side on its worker. Rank 0 first (its stage stops where it would hear stage 1),
    then again in one task with its pipeline (ranks 0-2), then the other pipeline (ranks 3-5)."""
    from test_emulate_auto_ranks import PIPELINE  # a 2 (dp) x 3 (pp) mesh, torch's shape inference

    (tmp_path / "pipeline.py").write_text(PIPELINE)
    command = ["--", "torchrun", "--nproc-per-node", "6", "pipeline.py"]
    record = [sys.executable, "-m", "memdiff", "record", "--emulate", "h100"]
    every = subprocess.run([*record, "-o", "runs/", "--ranks", "all", "--dask", scheduler, *command], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600, env=_env())
    assert every.returncode == 0, every.stderr[-3000:]
    assert "memdiff: --dask: rank 0 runs again, with the ranks of its pipeline named, in one task: its stage hears " \
           "its shapes from rank 1, which had not run" in every.stderr
    assert sorted(every.stdout.splitlines()) == [f"rank {r} stage {r % 3}" for r in range(6)]
    # --ranks auto: rank 0, then its pipeline's picks (0, 1, 2) in one task, then the last rank, 5, whose
    # stages 0 and 1 do not run: it hears what rank 1 sent rank 2, ended
    auto = subprocess.run([*record, "-o", "auto/", "--ranks", "auto", "--dask", scheduler, *command], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=_env())
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert sorted(auto.stdout.splitlines()) == [f"rank {r} stage {r % 3}" for r in (0, 1, 2, 5)]
    whole = subprocess.run([*record, "-o", "whole/", *command], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=_env())
    assert whole.returncode == 0, whole.stderr[-3000:]
    rules = load_rules()
    for folder, ranks in (("runs", range(6)), ("auto", (0, 1, 2, 5))):
        for rank in ranks:
            alone = read_summary(str(tmp_path / folder / f"rank{rank}.pickle"), rules).devices[0]
            together = read_summary(str(tmp_path / "whole" / f"rank{rank}.pickle"), rules).devices[0]
            assert (alone.peak_bytes, alone.categories) == (together.peak_bytes, together.categories), (folder, rank)


@pytest.mark.parametrize(("argv", "said"), [
    (["--emulate", "h100", "-o", "runs/", "--dask", "tcp://127.0.0.1:9"],
     "--dask: runs the ranks --ranks names as tasks on a Dask cluster: give --ranks all"),
    (["-o", "runs/", "--ranks", "all", "--dask", "tcp://127.0.0.1:9"],
     "--dask: runs the ranks of an emulated job as tasks on a Dask cluster: give it with --emulate GPU"),
    (["--emulate", "h100", "-o", "run.pickle", "--ranks", "all", "--dask", "tcp://127.0.0.1:9"],
     "--dask: records each rank of a job into a folder: give -o DIR/"),
    # locally, a job of 8 nodes of 16 GPUs is more processes than one machine runs at once
    (["--emulate", "h100", "-o", "runs/", "--ranks", "all"],
     "--ranks: 128 ranks are more than this machine runs at once (at most 64, each a process of its own): "
     "give --dask ADDRESS"),
])
def test_what_dask_ranks_cannot_run_is_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ddp.py").write_text(DDP)
    code = main(["record", *argv, "--", "torchrun", "--nnodes", "8", "--nproc-per-node", "16", "ddp.py"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "runs").exists()


def test_an_unreachable_scheduler_or_no_distributed_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ddp.py").write_text(DDP)
    argv = ["record", "--emulate", "h100", "-o", "runs/", "--ranks", "all", "--dask", "tcp://127.0.0.1:9", "--",
            "torchrun", "--nproc-per-node", "4", "ddp.py"]
    # Dask retries a refused connection until its timeout: a second is enough to be refused here.
    monkeypatch.setattr("memdiff.cluster.DASK_CONNECT_TIMEOUT_S", 1)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--dask tcp://127.0.0.1:9: cannot reach the scheduler" in err, err
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err == "memdiff: --dask: needs dask.distributed: pip install 'memdiff[dask]'\n"
    assert not (tmp_path / "runs").exists()
