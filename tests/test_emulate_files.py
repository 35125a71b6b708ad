"""The user's files under `memdiff record --emulate`: saves of emulated tensors or of data read back
from the emulated GPU write nothing (a real checkpoint beside the script keeps its bytes), host data
is written as a real run writes it, and a real checkpoint loads onto the emulated GPU from its
shapes and dtypes."""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch


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


def _written(stderr: str, call: str, target: str) -> int:
    """The bytes of tensor data memdiff says a real run writes, from its one line about `target`."""
    said = re.findall(rf"memdiff: emulation: {re.escape(call)} to {re.escape(target)} not written: .*?"
                      r"([\d,]+) bytes of tensor data", stderr)  # a progress bar may precede it on its line
    assert len(said) == 1, stderr
    return int(said[0].replace(",", ""))


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
    assert not (tmp_path / "full.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "run.pickle", "train.py"]  # no temp file
    parameters = sum(p.numel() for p in model.parameters())
    assert _written(done.stderr, "torch.save", "ckpt.pt") == 4 * parameters
    # the weights, AdamW's two moments, and its step counters (one float32 per parameter tensor)
    assert _written(done.stderr, "torch.save", "full.pt") == 3 * 4 * parameters + 4 * len(list(model.parameters()))
    notes = _snapshot(tmp_path)["emulated"]["notes"]
    assert any(n.startswith("torch.save to ckpt.pt not written") and "ckpt.pt is unchanged" in n for n in notes)
    assert any(n.startswith("torch.save to full.pt not written") and "no file was made" in n for n in notes)


@pytest.mark.slow
def test_save_pretrained_writes_its_configs_and_no_weights(tmp_path):
    make = tmp_path / "make.py"
    source = """
        import sys, torch
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))
        if sys.argv[1] == "load":  # the real checkpoint, read on the CPU, then moved
            model = GPT2LMHeadModel.from_pretrained(sys.argv[2]).cuda()
            print(model.device, torch.cuda.memory_allocated())
        elif sys.argv[1] == "cuda":
            model = model.cuda()
        model.save_pretrained(sys.argv[2])
    """
    make.write_text(textwrap.dedent(source))
    real = subprocess.run([sys.executable, str(make), "cpu", "real"], capture_output=True, text=True, cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    weights = tmp_path / "real" / "model.safetensors"
    before = _digest(weights)
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as real_file:  # what the real save wrote: the truth
        real_bytes = sum(real_file.get_tensor(k).nbytes for k in real_file.keys())
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    for how, target in (("load", "real"), ("cuda", "fresh")):
        done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                               str(tmp_path / "run.pickle"), "--", "python", "train.py", how, target],
                              capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert _written(done.stderr, "safetensors save_file", f"{target}/model.safetensors") == real_bytes
        if how == "load":
            device, allocated = done.stdout.split()[:2]
            assert device == "cuda:0" and int(allocated) >= real_bytes  # the loaded weights on the device
    assert _digest(weights) == before
    # the configs are host data, written as a real run writes them; no weight file is made
    assert sorted(os.listdir(tmp_path / "fresh")) == ["config.json", "generation_config.json"]


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
def test_numpy_saves_of_device_data_write_nothing_and_host_data_is_written(tmp_path):
    (tmp_path / "w.npy").write_bytes(b"the user's own array")
    done = _emulate(tmp_path, """
        import numpy as np, torch
        x = torch.nn.Linear(32, 48).cuda().weight
        np.save("w.npy", x.detach().cpu().numpy())
        np.savez("both.npz", w=x.detach().cpu().numpy(), ids=np.arange(4))
        np.save("ids.npy", np.arange(4))
        torch.save({"step": 3, "ids": torch.arange(4)}, "host.pt")
        print("went on")
    """)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "w.npy").read_bytes() == b"the user's own array"
    assert not (tmp_path / "both.npz").exists()
    assert _written(done.stderr, "numpy.save", "w.npy") == 32 * 48 * 4
    assert _written(done.stderr, "numpy.savez", "both.npz") == 32 * 48 * 4 + 4 * 8
    import numpy as np

    assert np.load(tmp_path / "ids.npy").tolist() == [0, 1, 2, 3]
    host = torch.load(tmp_path / "host.pt")
    assert host["step"] == 3 and host["ids"].tolist() == [0, 1, 2, 3]


@pytest.mark.slow
def test_safetensors_loads_to_the_device_and_file_objects_stay_empty(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(128, 96), "b": torch.zeros(5, dtype=torch.float16)}, tmp_path / "real.safetensors")
    before = _digest(tmp_path / "real.safetensors")
    done = _emulate(tmp_path, """
        import io, torch
        from safetensors import safe_open
        from safetensors.torch import load_file, save
        loaded = load_file("real.safetensors", device="cuda")
        print(*[f"{k}:{v.device}:{tuple(v.shape)}:{v.dtype}" for k, v in sorted(loaded.items())])
        print(torch.cuda.memory_allocated())
        with safe_open("real.safetensors", framework="pt", device="cuda") as opened:
            part = opened.get_slice("w")[:10, 90:]
            print(part.device, tuple(part.shape), torch.cuda.memory_allocated())
        print(len(save(loaded)))
        buffer = io.BytesIO()
        torch.save(loaded, buffer)
        buffer.seek(0)
        try:
            torch.load(buffer)
        except EOFError as exc:
            print("EOFError", "did not fill" in str(exc))
    """)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "b:cuda:0:(5,):torch.float16 w:cuda:0:(128, 96):torch.float32"
    assert int(lines[1]) == 512 + 128 * 96 * 4  # each rounded to 512 bytes, as the caching allocator does
    assert lines[2] == f"cuda:0 (10, 6) {int(lines[1]) + 512}"  # what the slice selects, no more
    assert lines[3:] == ["0", "EOFError True"]
    assert _digest(tmp_path / "real.safetensors") == before


def test_leaving_the_emulator_puts_every_save_and_load_back(tmp_path):
    import numpy as np

    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    before = (torch.save, torch.load, torch.serialization.save, np.save, np.savez, torch.storage._to)
    with emulating(Emulator(gpu("h100"))):
        assert torch.save is not before[0] and np.save is not before[3]
        weights = torch.nn.Linear(4, 4).cuda().state_dict()
        torch.save(weights, tmp_path / "emulated.pt")
        torch.save({"n": 1}, tmp_path / "host.pt")
    assert (torch.save, torch.load, torch.serialization.save, np.save, np.savez, torch.storage._to) == before
    assert not (tmp_path / "emulated.pt").exists()
    assert torch.load(tmp_path / "host.pt") == {"n": 1}
    torch.save({"n": 2}, tmp_path / "after.pt")
    assert torch.load(tmp_path / "after.pt") == {"n": 2}


@pytest.mark.slow
def test_the_hugging_face_trainers_checkpoints_hold_no_weights_optimizer_or_rng_state(tmp_path):
    pytest.importorskip("transformers")
    done = _emulate(tmp_path, """
        import os, torch
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))
        data = [{"input_ids": torch.randint(0, 256, (16,)), "labels": torch.randint(0, 256, (16,))} for _ in range(8)]
        args = TrainingArguments("out", max_steps=2, save_steps=1, per_device_train_batch_size=4, report_to=[])
        Trainer(model=model, args=args, train_dataset=data).train()
        print(4 * sum(p.numel() for p in model.parameters()))  # the tied head counted once, as a save writes it
        for step in (1, 2):
            print(" ".join(sorted(os.listdir(f"out/checkpoint-{step}"))))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    weights, *folders = done.stdout.splitlines()[-3:]
    # what the Trainer writes from the host (configs, its state, the scheduler's) is there; the
    # weights, AdamW's moments and the GPU's rng state are not
    assert folders == ["config.json generation_config.json scheduler.pt trainer_state.json training_args.bin"] * 2
    for step in (1, 2):
        assert _written(done.stderr, "safetensors save_file", f"out/checkpoint-{step}/model.safetensors") == \
            int(weights)
        assert _written(done.stderr, "torch.save", f"out/checkpoint-{step}/optimizer.pt") > 2 * int(weights)
        assert f"torch.save to out/checkpoint-{step}/rng_state.pth not written" in done.stderr


@pytest.mark.slow
def test_distributed_checkpoint_accelerate_and_many_files_write_nothing_and_say_it_once(tmp_path):
    pytest.importorskip("accelerate")
    done = _emulate(tmp_path, """
        import os, torch
        import torch.distributed.checkpoint as dcp
        from accelerate import Accelerator
        accelerator = Accelerator()
        model = torch.nn.Linear(64, 32).to(accelerator.device)
        opt = torch.optim.AdamW(model.parameters())
        model, opt = accelerator.prepare(model, opt)
        model(torch.randn(4, 64, device=accelerator.device)).sum().backward()
        opt.step()
        dcp.save({"model": model.state_dict()}, checkpoint_id="dcp")
        print(dcp.async_save({"model": model.state_dict()}, checkpoint_id="dcp_async").result())
        accelerator.save_state("state")
        for step in range(8):
            torch.save(model.state_dict(), f"step{step}.pt")
        print(sorted(os.listdir("state")), os.path.exists("dcp"), os.path.exists("dcp_async"))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = 4 * (64 * 32 + 32)
    assert done.stdout.splitlines()[-2:] == ["None", "[] False False"]
    assert _written(done.stderr, "torch.distributed.checkpoint.save", "dcp") == weights
    assert _written(done.stderr, "torch.distributed.checkpoint.async_save", "dcp_async") == weights
    assert _written(done.stderr, "safetensors save_file", "state/model.safetensors") == weights
    assert _written(done.stderr, "torch.save", "state/optimizer.bin") == 2 * weights + 2 * 4  # moments, steps
    assert "torch.save to state/random_states_0.pkl not written" in done.stderr
    # six files named one by one (five above, then step0.pt), then one line for the rest
    named = [line for line in done.stderr.splitlines() if "torch.save to step" in line]
    assert [line.split(" to ")[1].split()[0] for line in named] == ["step0.pt", "step1.pt"]
    assert "every later save of emulated data not written either" in named[-1]
    assert not list(tmp_path.glob("step*.pt"))


@pytest.mark.slow
def test_a_saver_that_writes_a_temporary_then_renames_copies_and_prunes_leaves_the_users_files(tmp_path):
    # timm's saver and atomic saves write a temporary name and rename it into place, copy the best
    # checkpoint and delete old ones: the skipped save's file moves as the real run's, and a file the
    # user had at a pruned path stays.
    (tmp_path / "old.pt").write_bytes(b"the user's own checkpoint")
    done = _emulate(tmp_path, """
        import os, shutil, torch
        model = torch.nn.Linear(64, 64).cuda()
        torch.save(model.state_dict(), "tmp.pt")
        os.replace("tmp.pt", "last.pt")
        shutil.copyfile("last.pt", "best.pt")
        torch.save(model.state_dict(), "old.pt")
        os.remove("old.pt")
        print(sorted(f for f in os.listdir(".") if f.endswith(".pt")))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "['old.pt']"
    assert (tmp_path / "old.pt").read_bytes() == b"the user's own checkpoint"


@pytest.mark.slow
def test_a_save_into_a_file_the_script_opened_over_a_real_checkpoint_leaves_its_bytes(tmp_path):
    # word_language_model's `with open(path, "wb") as f: torch.save(model, f)`: open() itself emptied
    # the user's checkpoint before the skipped save; the script's closing torch.load then failed.
    torch.save(_model().state_dict(), tmp_path / "model.pt")
    before = _digest(tmp_path / "model.pt")
    done = _emulate(tmp_path, """
        import torch
        model = torch.nn.Linear(64, 64).cuda()
        with open("model.pt", "wb") as f:
            torch.save(model.state_dict(), f)
        with open("model.pt", "rb") as f:
            print(sorted(torch.load(f)))
        with open("notes.bin", "wb") as f:  # a file of the script's own bytes is written as open() gives it
            f.write(b"abc")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _digest(tmp_path / "model.pt") == before
    assert (tmp_path / "notes.bin").read_bytes() == b"abc"


@pytest.mark.slow
def test_loading_what_the_run_saved_gives_back_what_it_held_on_the_emulated_gpu(tmp_path):
    # word_language_model saves its best model through an open file and loads it back to test it: the
    # load gives the saved module back (each tensor an allocation on the device), not the user's
    # older file that the skipped save left in place.
    torch.save(_model(), tmp_path / "model.pt")  # the user's older model, on the host
    before = _digest(tmp_path / "model.pt")
    done = _emulate(tmp_path, """
        import torch
        model = torch.nn.LSTM(32, 64, 2).cuda()
        with open("model.pt", "wb") as f:
            torch.save(model, f)
        with open("model.pt", "rb") as f:
            model = torch.load(f, weights_only=False)
        print(type(model).__name__, {str(p.device) for p in model.parameters()})
        torch.save(torch.nn.Linear(8, 8).cuda().state_dict(), "sd.pt")
        print({k: tuple(v.shape) for k, v in torch.load("sd.pt").items()})
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-2] == "LSTM {'cuda:0'}"
    assert lines[-1] == "{'weight': (8, 8), 'bias': (8,)}"
    assert _digest(tmp_path / "model.pt") == before
    assert not (tmp_path / "sd.pt").exists()


# llm.c's train_gpt2.py exports its weights for its C code with its own writes: a header from a real
# CPU tensor, then each weight read back from the device.
LLMC_WRITER = f"""
    import os, pickle, numpy as np, torch
    model = {MODEL}.cuda()
    model(torch.randn(8, 96, device="cuda")).sum().backward()

    def write_fp32(tensor, file):
        t = tensor.detach().cpu().to(torch.float32)
        file.write(t.numpy().tobytes())

    def write_bf16(tensor, file):
        t = tensor.detach().cpu().to(torch.bfloat16).view(torch.int16)
        file.write(t.numpy().tobytes())

    header = torch.zeros(256, dtype=torch.int32)
    header[0] = 20240326
    params = {{name: p.cpu() for name, p in model.named_parameters()}}
    with open("model.bin", "wb") as f:
        f.write(header.numpy().tobytes())
        for p in params.values():
            write_fp32(p, f)
    with open("model_bf16.bin", "wb") as f:
        f.write(header.numpy().tobytes())
        for p in model.parameters():
            write_bf16(p.grad, f)
    with open("tokenizer.bin", "wb") as f:  # the script's own data: written as a real run writes it
        f.write(header.numpy().tobytes())
        f.write(bytes(range(256)))
    with open("model.bin", "rb") as f:  # reading back its header, as a real run would
        print(int(np.frombuffer(f.read(1024), dtype=np.int32)[0]), len(f.read()))
    weight = model[0].weight.detach().cpu().numpy()
    weight.tofile("weight.raw")
    with open("view.bin", "wb") as f:
        f.write(memoryview(weight))
    with open("arrays.pkl", "wb") as f:
        pickle.dump({{"w": weight}}, f)
    print("went on")
"""


@pytest.mark.slow
def test_a_scripts_own_binary_writes_of_read_back_weights_leave_the_users_files(tmp_path):
    users = {name: os.urandom(4096) for name in ("model.bin", "model_bf16.bin", "weight.raw", "arrays.pkl")}
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    done = _emulate(tmp_path, LLMC_WRITER)
    assert done.returncode == 0, done.stderr[-3000:]
    parameters = sum(p.numel() for p in _model().parameters())
    # the header read back, and the size of the weights after it that a real run wrote
    assert done.stdout.splitlines() == [f"20240326 {4 * parameters}", "went on"]
    for name, data in users.items():
        assert (tmp_path / name).read_bytes() == data, name
    assert not (tmp_path / "view.bin").exists()
    header = np.zeros(256, dtype=np.int32)
    header[0] = 20240326
    assert (tmp_path / "tokenizer.bin").read_bytes() == header.tobytes() + bytes(range(256))
    for name, size in (("model.bin", 1024 + 4 * parameters), ("model_bf16.bin", 1024 + 2 * parameters)):
        said = re.findall(rf"memdiff: emulation: the script's binary writes to {name} not written: it holds data "
                          rf"read back from the emulated GPU.*?([\d,]+) bytes\); {name} is unchanged", done.stderr)
        assert said == [f"{size:,}"], done.stderr
    assert "numpy tofile to weight.raw not written" in done.stderr
    assert "pickle.dump to arrays.pkl not written" in done.stderr
    assert "the script's binary writes to view.bin not written" in done.stderr
    notes = _snapshot(tmp_path)["emulated"]["notes"]
    assert any(n.startswith("the script's binary writes to model.bin not written") for n in notes)
    # no temporary file is left beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "tokenizer.bin", "run.pickle", "train.py"])


@pytest.mark.slow
def test_an_image_of_read_back_pixels_is_not_saved_and_an_image_of_host_data_is(tmp_path):
    # dcgan's `vutils.save_image(fake.detach(), path)`: torchvision's save_image ends in
    # `Image.fromarray(grid.mul(255)...to("cpu", torch.uint8).numpy()).save(path)`.
    pytest.importorskip("PIL")
    from PIL import Image

    (tmp_path / "fake_samples.png").write_bytes(b"the user's own samples")
    done = _emulate(tmp_path, """
        import numpy as np, torch
        from PIL import Image
        fake = torch.nn.Conv2d(4, 3, 3, padding=1).cuda()(torch.randn(1, 4, 32, 48, device="cuda"))[0]
        pixels = fake.detach().mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to("cpu", torch.uint8).numpy()
        Image.fromarray(pixels).save("fake_samples.png")
        Image.fromarray(pixels).convert("L").resize((24, 16)).save("gray.png")
        with open("opened.png", "wb") as f:
            Image.fromarray(pixels).save(f, format="PNG")
        Image.fromarray(np.arange(48 * 32, dtype=np.uint8).reshape(32, 48)).save("host.png")
        print("went on")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["went on"]
    assert (tmp_path / "fake_samples.png").read_bytes() == b"the user's own samples"
    assert "PIL Image.save to fake_samples.png not written" in done.stderr
    assert "(a real run writes a 48x32 RGB image, 4,608 bytes of pixels before encoding); fake_samples.png is " \
           "unchanged" in done.stderr
    assert not (tmp_path / "gray.png").exists() and not (tmp_path / "opened.png").exists()
    expected = tmp_path / "expected.png"
    Image.fromarray(np.arange(48 * 32, dtype=np.uint8).reshape(32, 48)).save(expected)
    assert (tmp_path / "host.png").read_bytes() == expected.read_bytes()


def test_a_file_open_when_the_emulator_stops_is_put_in_place_and_numpy_and_open_are_put_back(tmp_path):
    import builtins

    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    before = (builtins.open, np.ndarray.tobytes, np.ndarray.tofile)
    (tmp_path / "log.bin").write_bytes(b"old")
    (tmp_path / "log.bin").chmod(0o600)
    with emulating(Emulator(gpu("h100"))):
        f = open(tmp_path / "log.bin", "wb")
        f.write(b"written under emulation;")
        assert (tmp_path / "log.bin").read_bytes() == b"old"  # not in place before it is closed
        made = open(tmp_path / "new.bin", "wb")
        made.write(np.arange(4, dtype=np.int16).tobytes())
        made.close()
    f.write(b" and after")
    f.close()
    assert (builtins.open, np.ndarray.tobytes, np.ndarray.tofile) == before
    assert (tmp_path / "log.bin").read_bytes() == b"written under emulation; and after"
    assert (tmp_path / "log.bin").stat().st_mode & 0o777 == 0o600  # the mode of the file it replaced
    assert (tmp_path / "new.bin").read_bytes() == np.arange(4, dtype=np.int16).tobytes()
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"")
    assert (tmp_path / "new.bin").stat().st_mode == plain.stat().st_mode  # as open() makes a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.bin", "new.bin", "plain.bin"]


def test_leaving_the_emulator_puts_pil_and_pickle_back(tmp_path):
    image = pytest.importorskip("PIL.Image")
    import pickle as pickle_module

    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    before = (image.Image.save, image.Image._new, image.frombuffer, image.frombytes, pickle_module.dump)
    with emulating(Emulator(gpu("h100"))):
        assert image.Image.save is not before[0] and pickle_module.dump is not before[4]
        pixels = torch.nn.Linear(8, 8).cuda().weight.detach().to("cpu", torch.uint8).numpy()
        image.fromarray(pixels).save(tmp_path / "device.png")
        image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(tmp_path / "host.png")
    assert (image.Image.save, image.Image._new, image.frombuffer, image.frombytes, pickle_module.dump) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.png"]


def test_a_file_renamed_while_still_open_lands_at_its_new_name_or_nowhere(tmp_path):
    # the atomic-write idiom some savers use: write a temporary name, flush, rename, then close
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    (tmp_path / "weights.bin").write_bytes(b"the user's weights")
    with emulating(Emulator(gpu("h100"))):
        f = open(tmp_path / "config.tmp", "wb")
        f.write(b"host bytes")
        f.flush()
        os.replace(tmp_path / "config.tmp", tmp_path / "config.bin")
        f.close()
        weights = torch.nn.Linear(4, 4).cuda().weight.detach().cpu()
        g = open(tmp_path / "weights.tmp", "wb")
        g.write(weights.numpy().tobytes())
        g.flush()
        os.replace(tmp_path / "weights.tmp", tmp_path / "weights.bin")
        g.close()
        with open(tmp_path / "weights.bin", "rb") as back:  # the layout the real run wrote there
            assert len(back.read()) == 4 * 4 * 4
    assert (tmp_path / "config.bin").read_bytes() == b"host bytes"
    assert (tmp_path / "weights.bin").read_bytes() == b"the user's weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.bin", "weights.bin"]


def test_numpys_copies_of_read_back_data_are_not_written_and_of_host_data_are(tmp_path):
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    before = (np.ndarray.astype, np.ndarray.copy, np.ndarray.flatten)
    with emulating(Emulator(gpu("h100"))):
        weight = torch.nn.Linear(16, 16).cuda().weight.detach().cpu().numpy()
        with open(tmp_path / "half.bin", "wb") as f:
            f.write(weight.astype(np.float16).tobytes())
        weight.T.copy().tofile(tmp_path / "copy.raw")
        with open(tmp_path / "flat.bin", "wb") as f:
            f.write(weight.flatten())
        with open(tmp_path / "host.bin", "wb") as f:
            f.write(np.arange(4).astype(np.float16).tobytes())
    assert (np.ndarray.astype, np.ndarray.copy, np.ndarray.flatten) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.bin"]
    assert (tmp_path / "host.bin").read_bytes() == np.arange(4).astype(np.float16).tobytes()
