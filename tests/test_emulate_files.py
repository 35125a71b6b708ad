"""The user's files under `memdiff record --emulate`: whatever the run writes, renames or deletes lands
in its overlay and no byte of the user's tree changes; what the run saved it loads back (shapes and
dtypes on the emulated GPU); a real checkpoint loads onto the emulated GPU from its shapes and dtypes;
and memdiff says once what a real run would have written there."""

from __future__ import annotations

import gzip
import hashlib
import inspect
import json
import os
import pickle
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memdiff.units import format_bytes


def _emulate(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def _snapshot(tmp_path: Path) -> dict:
    path = tmp_path / "run.pickle"
    with (gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open)(path, "rb") as f:
        return pickle.load(f)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _written(stderr: str, kind: str, target: str) -> int:
    """The bytes of tensor data memdiff says a real run writes at `target`, from the run's summary."""
    said = re.findall(rf"memdiff: emulation:   {kind} {re.escape(target)} \(.*?, ([\d,]+) bytes of tensor data",
                      stderr)
    assert len(said) == 1, stderr
    return int(said[0].replace(",", ""))


def _tree(root: Path) -> dict:
    """Every path below `root` with its bytes (None for a folder): the user's tree, to compare."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 40))


MODEL = "torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 40))"


@pytest.mark.slow
def test_a_save_over_a_real_checkpoint_leaves_its_bytes_and_says_what_a_real_run_writes(tmp_path):
    torch.manual_seed(0)
    model = _model()
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")  # the user's real weights
    before = _digest(tmp_path / "ckpt.pt")
    done = _emulate(tmp_path, f"""
        import torch
        model = {MODEL}.cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(8, 96, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        torch.save(model.state_dict(), "ckpt.pt")
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict()}}, "full.pt")
        print("went on")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["went on"]
    assert _digest(tmp_path / "ckpt.pt") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "run.pickle", "train.py"]  # nothing left
    parameters = sum(p.numel() for p in model.parameters())
    assert _written(done.stderr, "changed", "ckpt.pt") == 4 * parameters
    # the weights, AdamW's two moments, and its step counters (one float32 per parameter tensor)
    assert _written(done.stderr, "created", "full.pt") == 3 * 4 * parameters + 4 * len(list(model.parameters()))
    assert "the user's files are unchanged: 1 changed, 1 created" in done.stderr
    notes = _snapshot(tmp_path)["emulated"]["notes"]
    assert any("the run's writes went to its overlay" in n and "changed ckpt.pt" in n for n in notes)


# timm's CheckpointSaver, accelerate's save_state into a folder that exists, word_language_model's
# save-then-reload, and datasets' `.map()` cache (a temporary file opened twice, then moved)
PUBLIC_SAVERS = """
    import os, pathlib, shutil, tempfile, torch
    model = torch.nn.Linear(64, 32).cuda()
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, "tmp.pth.tar")
    if os.path.exists("last.pth.tar"):
        os.unlink("last.pth.tar")
    if os.path.exists("checkpoint-0.pth.tar"):
        os.unlink("checkpoint-0.pth.tar")
    os.link("tmp.pth.tar", "checkpoint-0.pth.tar")
    os.replace("tmp.pth.tar", "last.pth.tar")
    shutil.copyfile("last.pth.tar", "model_best.pth.tar")
    print(torch.load("model_best.pth.tar")["epoch"], torch.load("last.pth.tar")["state_dict"]["weight"].device)
    with open("state/scheduler.bin", "wb") as f:
        f.write(b"new scheduler")
    pathlib.Path("state/trainer_state.json").write_text("{}")
    print(sorted(os.listdir("state")))
    with open("model.pt", "wb") as f:
        torch.save(model, f)
    with open("model.pt", "rb") as f:
        print(type(torch.load(f, weights_only=False)).__name__)
    fd, cache = tempfile.mkstemp(dir="state", suffix=".arrow")
    with open(cache, "wb") as writer, open(cache, "rb") as reader:
        writer.write(b"rows")
    os.close(fd)
    shutil.move(cache, "state/cache.arrow")
    print(open("state/cache.arrow", "rb").read().decode())
    shutil.rmtree("state")
    os.makedirs("state/again")
    print(os.path.exists("state/scheduler.bin"), [sorted(d) + sorted(f) for _, d, f in os.walk("state")])
"""


@pytest.mark.slow
def test_public_savers_leave_every_user_file_byte_identical_and_read_back_what_they_wrote(tmp_path):
    for name in ("last.pth.tar", "model_best.pth.tar", "checkpoint-0.pth.tar"):
        (tmp_path / name).write_bytes(os.urandom(512))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "scheduler.bin").write_bytes(b"old scheduler")
    (tmp_path / "state" / "model.safetensors").write_bytes(b"old weights")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PUBLIC_SAVERS))
    before = _tree(tmp_path)
    done = _emulate(tmp_path, PUBLIC_SAVERS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "3 cuda:0",  # the run's own checkpoint, loaded back
        "['model.safetensors', 'scheduler.bin', 'trainer_state.json']",
        "Linear",
        "rows",
        "False [['again'], []]"]
    assert {k: v for k, v in _tree(tmp_path).items() if k != "run.pickle"} == before
    weights = 4 * (64 * 32 + 32)
    assert _written(done.stderr, "changed", "last.pth.tar") == weights
    assert "created model.pt" in done.stderr and "changed state/" in done.stderr


@pytest.mark.slow
def test_keep_writes_keeps_the_overlay_to_look_at_and_refuses_a_folder_in_use(tmp_path):
    kept = tmp_path / "writes"
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import json, torch
        from safetensors.torch import save_file
        model = torch.nn.Linear(16, 8).cuda()
        save_file(model.state_dict(), "model.safetensors", metadata={"format": "pt"})
        json.dump({"steps": 1}, open("state.json", "w"))
    """))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--keep-writes", str(kept), "--", "python", "train.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"kept in {kept}" in done.stderr
    upper = kept / "upper" / str(tmp_path).lstrip(os.sep)
    assert json.loads((upper / "state.json").read_text()) == {"steps": 1}
    from safetensors import safe_open

    with safe_open(upper / "model.safetensors", framework="pt") as f:  # a real safetensors file, its data a hole
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == {"weight": (8, 16), "bias": (8,)}
        assert f.metadata() == {"format": "pt"}
        assert not f.get_tensor("weight").any()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pickle", "train.py", "writes"]
    again = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                            str(tmp_path / "run.pickle"), "--keep-writes", str(kept), "--", "python", "train.py"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [f"memdiff: --keep-writes: {kept} is there already: give a new "
                                                 f"or empty folder for the run's writes"]


@pytest.mark.slow
def test_a_real_checkpoint_loads_onto_the_emulated_gpu_from_its_shapes_and_dtypes(tmp_path):
    torch.manual_seed(0)
    embedding = torch.randn(300, 64).to(torch.bfloat16)
    real = {"embed": embedding, "head": embedding, "norm": torch.ones(64), "steps": torch.arange(7)}
    torch.save(real, tmp_path / "real.pt")
    before = _digest(tmp_path / "real.pt")
    script = """
        import torch
        kept = []
        for where in ("cuda", torch.device("cuda"), lambda storage, location: storage.cuda()):
            loaded = torch.load("real.pt", map_location=where)
            kept.append(loaded)
            print(*[f"{k}:{v.device}:{tuple(v.shape)}:{v.dtype}" for k, v in loaded.items()],
                  loaded["embed"].data_ptr() == loaded["head"].data_ptr())
        print(torch.load("real.pt")["steps"].tolist())  # a load that stays on the host is the real data
        on_gpu = torch.load("gpu.pt")  # saved on a GPU: its storages go back to it
        print(on_gpu.device, tuple(on_gpu.shape))
    """
    # A checkpoint as a GPU writes it: its storages tagged `cuda:0` (torch's own tagging hook).
    (tmp_path / "gpu.py").write_text(textwrap.dedent("""
        import torch, torch.serialization as s
        s.register_package(0, lambda storage: "cuda:0" if storage.device.type == "cpu" else None, lambda *a: None)
        torch.save(torch.randn(100, 30), "gpu.pt")
    """))
    made = subprocess.run([sys.executable, "gpu.py"], capture_output=True, text=True, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    done = _emulate(tmp_path, script)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    want = " ".join(f"{k}:cuda:0:{tuple(v.shape)}:{v.dtype}" for k, v in real.items()) + " True"
    assert lines[:3] == [want] * 3
    assert lines[3] == str(list(range(7)))
    assert lines[4] == "cuda:0 (100, 30)"
    assert _digest(tmp_path / "real.pt") == before
    # each load made one allocation per storage (the shared one once), from the script's line
    storages = sorted({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in real.values()}.values())
    blocks = [b for s in _snapshot(tmp_path)["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    line = textwrap.dedent(script).splitlines().index("    loaded = torch.load(\"real.pt\", map_location=where)") + 1
    loaded = [b["requested_size"] for b in blocks
              if any(f["filename"].endswith("train.py") and f["line"] == line for f in b["frames"])]
    assert sorted(loaded) == sorted(storages * 3)


@pytest.mark.slow
def test_numpy_images_and_a_scripts_own_binary_writes_land_in_the_overlay(tmp_path):
    # llm.c's weight export (`f.write(t.cpu().numpy().tobytes())`), dcgan's save_image, numpy saves
    pytest.importorskip("PIL")
    users = {name: os.urandom(256) for name in ("model.bin", "w.npy", "fake_samples.png")}
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    done = _emulate(tmp_path, """
        import numpy as np, torch
        from PIL import Image
        w = torch.nn.Linear(32, 48).cuda().weight.detach()
        with open("model.bin", "wb") as f:
            f.write(np.zeros(256, dtype=np.int32).tobytes())
            f.write(w.cpu().numpy().tobytes())
        with open("model.bin", "rb") as f:  # reading back its header, as a real run would
            print(len(f.read(1024)), len(f.read()))
        np.save("w.npy", w.cpu().numpy())
        np.save("ids.npy", np.arange(4))
        print(np.load("ids.npy").tolist(), np.load("w.npy").shape)
        Image.fromarray(w.cpu().to(torch.uint8).numpy()).save("fake_samples.png")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"1024 {32 * 48 * 4}", "[0, 1, 2, 3] (48, 32)"]
    for name, data in users.items():
        assert (tmp_path / name).read_bytes() == data, name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "run.pickle", "train.py"])
    assert "created ids.npy" in done.stderr and "changed fake_samples.png" in done.stderr


def test_leaving_the_emulator_puts_every_file_call_back_and_leaves_nothing(tmp_path):
    import builtins

    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    calls = (builtins.open, os.open, os.replace, os.stat, os.listdir, torch.save, torch.load, torch.storage._to)
    (tmp_path / "log.bin").write_bytes(b"old")
    with emulating(Emulator(gpu("h100"))):
        assert builtins.open is not calls[0] and torch.save is not calls[5]
        torch.save(torch.nn.Linear(4, 4).cuda().state_dict(), tmp_path / "emulated.pt")
        torch.save({"n": 1}, tmp_path / "host.pt")
        assert torch.load(tmp_path / "host.pt") == {"n": 1}
        f = open(tmp_path / "log.bin", "ab")
        f.write(b" and more")
    f.write(b" after")  # a file still open writes on into the overlay's copy, which is gone
    f.close()
    assert (builtins.open, os.open, os.replace, os.stat, os.listdir, torch.save, torch.load,
            torch.storage._to) == calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.bin"]
    assert (tmp_path / "log.bin").read_bytes() == b"old"
    torch.save({"n": 2}, tmp_path / "after.pt")
    assert torch.load(tmp_path / "after.pt") == {"n": 2}


def test_a_folder_the_run_made_can_be_worked_in_and_the_user_s_tree_stays_as_it_was(tmp_path, monkeypatch):
    """A script that makes its run folder and moves into it (Hydra's outputs/DATE/TIME, a script's own
    `os.chdir(out_dir)`): the folder exists only in the overlay, and os.chdir failed with ENOENT."""
    from memdiff.recording.emulate.overlay_calls import overlaid

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("the user's")
    before = _tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    with overlaid():
        os.makedirs("outputs/run1")
        os.chdir("outputs/run1")
        torch.save({"step": 3}, "ckpt.pt")
        seen = (os.getcwd(), str(Path.cwd()), os.path.abspath("ckpt.pt"), os.listdir("."), torch.load("ckpt.pt"))
        os.chdir("../../data")  # the user's own folder, entered as it is
        in_data = (os.getcwd(), open("train.txt").read())
        with open("log.txt", "w") as f:
            f.write("a line")
        assert sorted(os.listdir(".")) == ["log.txt", "train.txt"]
        os.chdir(tmp_path / "outputs" / "run1")
    run1 = str(tmp_path / "outputs" / "run1")
    assert seen == (run1, run1, os.path.join(run1, "ckpt.pt"), ["ckpt.pt"], {"step": 3})
    assert in_data == (str(tmp_path / "data"), "the user's")
    assert os.getcwd() == str(tmp_path)  # out of the overlay's copy, which is gone
    assert _tree(tmp_path) == before


def test_a_write_around_the_routes_is_stopped_and_one_outside_python_is_named(tmp_path):
    import posix

    from memdiff.recording.emulate.overlay_calls import TreeCheck, overlaid

    (tmp_path / "data.bin").write_bytes(b"the user's")
    check = TreeCheck([str(tmp_path)], skip=())
    with overlaid():
        with pytest.raises(PermissionError, match="memdiff: emulation: open of .*data.bin stopped"):
            posix.open(str(tmp_path / "data.bin"), os.O_WRONLY | os.O_TRUNC)
        with pytest.raises(PermissionError, match="stopped"):
            posix.unlink(str(tmp_path / "data.bin"))
        subprocess.run(["sh", "-c", f"echo made > {tmp_path / 'by_a_program.txt'}"], check=True)
    assert (tmp_path / "data.bin").read_bytes() == b"the user's"
    lines = check.changed()
    assert len(lines) == 1 and lines[0].startswith(f"{tmp_path / 'by_a_program.txt'} was made by a writer outside")


def test_another_emulated_run_s_overlay_beside_the_script_is_not_named_as_a_writer(tmp_path):
    """Two emulated runs in one folder: each made its hidden overlay folder beside the script while
    the other ran, and each named the other's as a change made by a writer outside Python."""
    from memdiff.recording.emulate.overlay_calls import TreeCheck

    check = TreeCheck([str(tmp_path)], skip=())
    other = tmp_path / ".memdiff-writes-k3x9"  # as tempfile names the other run's
    (other / "upper").mkdir(parents=True)
    (other / "upper" / "ckpt.pt").write_bytes(b"the other run's write")
    (tmp_path / "by_a_program.txt").write_text("made")
    assert check.changed() == [f"{tmp_path / 'by_a_program.txt'} was made by a writer outside Python's file "
                               f"calls (a C library or a program the run started), which the overlay cannot route"]


def test_a_folder_deeper_than_python_s_recursion_limit_is_checked_to_its_bottom(tmp_path):
    """A tree nested deeper than Python's recursion limit (a folder copied into itself, left beside
    the script by an earlier run): the check walked it with os.walk and stopped the run with
    memdiff's exit 3 (RecursionError) before the script began; it must look to the bottom."""
    from memdiff.recording.emulate.overlay_calls import TreeCheck

    depth = len(inspect.stack())  # the frames already in use, pytest's
    bottom = tmp_path.joinpath(*["d"] * 300)
    bottom.mkdir(parents=True)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 150)  # the tree is deeper than what is left
    try:
        check = TreeCheck([str(tmp_path)], skip=())
        (bottom / "by_a_program.txt").write_text("made")
        lines = check.changed()
    finally:
        sys.setrecursionlimit(limit)
    assert lines == [f"{bottom / 'by_a_program.txt'} was made by a writer outside Python's file calls "
                     f"(a C library or a program the run started), which the overlay cannot route"]


# A Hugging Face script whose data is read from files: `datasets` writes its Arrow cache through
# Python's files and a file lock, then reads it back through pyarrow's memory_map (native code).
DATASETS_MAP = """
    import os, torch
    from datasets import load_dataset
    rows = load_dataset("text", data_files={"train": "train.txt"}, cache_dir="hf-cache")["train"]
    rows = rows.map(lambda batch: {"n": [len(t) for t in batch["text"]]}, batched=True)
    print(len(rows), sum(rows["n"]), os.path.isdir("hf-cache"))
    torch.nn.Linear(8, 8).cuda()
"""


@pytest.mark.slow
def test_a_datasets_map_with_a_file_cache_reads_back_its_cache_and_leaves_no_file(tmp_path):
    pytest.importorskip("datasets")  # the test extra has it on Python 3.11+, as transformers
    lines = [f"line {i} of the corpus" for i in range(50)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "train.py").write_text(textwrap.dedent(DATASETS_MAP))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(tmp_path / "train.py")],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"50 {sum(len(line) for line in lines)} True"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pickle", "train.py", "train.txt"]
    assert "created hf-cache/" in done.stderr


# A launched job's every Python process, torch or not: a checkpoint one process saves and another
# loads through an open file (word_language_model's generate.py, minGPT-ddp's resume), a data
def test_the_file_the_user_sent_the_run_s_output_to_is_not_a_writer_outside_python(tmp_path):
    """`memdiff record --emulate h100 -- python train.py > train.log 2>&1` run in the user's folder:
    the log grows as on a GPU run, by the user's own redirection, and is not named as a change."""
    (tmp_path / "data.bin").write_bytes(b"the user's")
    script = ("import subprocess, sys\n"
              "from memdiff.recording.emulate.overlay_calls import TreeCheck\n"
              "check = TreeCheck([sys.argv[1]], skip=())\n"
              "print('step 1: loss 2.31', flush=True)\n"
              "subprocess.run(['sh', '-c', 'echo made > ' + sys.argv[1] + '/by_a_program.txt'], check=True)\n"
              "print('\\n'.join(check.changed()), file=sys.stderr, flush=True)\n")
    with open(tmp_path / "train.log", "w") as log:
        subprocess.run([sys.executable, "-c", script, str(tmp_path)], stdout=log, stderr=log, check=True)
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert lines[0] == "step 1: loss 2.31"
    assert lines[1:] == [f"{tmp_path / 'by_a_program.txt'} was made by a writer outside Python's file calls (a C "
                         f"library or a program the run started), which the overlay cannot route"]


# preparation step that never imports torch (nanoGPT's prepare.py), tokenizers' native save (every
# fast tokenizer's save_pretrained); and a writer outside Python, which is named, never hidden.
JOB_SAVE = "import torch\ntorch.save(torch.nn.Linear(8, 4).cuda().state_dict(), 'ck.pt')\n"
JOB_LOAD = "import torch\nwith open('ck.pt', 'rb') as f:\n    print(sorted(torch.load(f)))\n"
JOB_PLAIN = """from tokenizers import Tokenizer, models
open("notes.txt", "w").write("written by a process that never imports torch")
Tokenizer(models.BPE()).save("tokenizer.json")
print(open("notes.txt").read())
"""


@pytest.mark.slow
def test_every_process_of_a_job_writes_into_the_overlay_and_a_writer_outside_python_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    for name, source in (("save.py", JOB_SAVE), ("load.py", JOB_LOAD), ("plain.py", JOB_PLAIN)):
        (tmp_path / name).write_text(source)
    users = {name: os.urandom(64) for name in ("ck.pt", "notes.txt", "tokenizer.json")}
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "by_sh.txt").write_text("original")
    python = shlex.quote(sys.executable)
    job = f"{python} save.py && {python} load.py && {python} plain.py && echo new > by_sh.txt"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "runs") + "/", "--", "sh", "-c", job],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["['bias', 'weight']", "written by a process that never imports torch"]
    for name, data in users.items():
        assert (tmp_path / name).read_bytes() == data, name
    assert (tmp_path / "by_sh.txt").read_text() == "new\n"  # a shell's write: not Python's, so not routed
    assert "the run's writes went to its overlay, but a writer outside it changed the user's files" in done.stderr
    assert f"{tmp_path / 'by_sh.txt'} was changed by a writer outside Python's file calls" in done.stderr
    assert "the user's files are unchanged" not in done.stderr


def test_every_dcp_save_not_written_is_said_after_the_librarys_own_line(tmp_path, capfd):
    # a script that saves every few steps: each save the library reports is followed by memdiff's
    # word on it; the run's notes (which every report shows) name the first six and count the rest
    import torch.distributed.checkpoint as dcp

    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    emulator = Emulator(gpu("h100"))
    with emulating(emulator):
        model = torch.nn.Linear(64, 32).cuda()
        for step in range(9):
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / f"step{step}"), no_dist=True)
            print(f"saved step{step}", file=sys.stderr, flush=True)
        made = sorted(p.name for p in tmp_path.iterdir())  # its folders, in the overlay, as a writer makes them
        notes = emulator.snapshot()["emulated"]["notes"]
    lines = capfd.readouterr().err.splitlines()
    weights = (64 * 32 + 32) * 4
    for step in range(9):
        said = lines[lines.index(f"saved step{step}") - 1]
        assert f"torch.distributed.checkpoint.save to {tmp_path / f'step{step}'} not written" in said, said
        assert format_bytes(weights) in said
    assert made == [f"step{step}" for step in range(9)]
    assert list(tmp_path.iterdir()) == []  # the user's tree: nothing
    assert sum("not written:" in n for n in notes) == 6
    assert "and 3 more files of emulated tensors not written, named on stderr as each was saved" in notes
