"""A model built on the CPU under emulation: what goes to the emulated GPU costs no host memory and
no initialisation, what stays on the CPU is real (docs/emulate.md, "Models built on the CPU")."""

from __future__ import annotations

import copy
import io
import math
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from memdiff.recording.emulate.gpus import gpu  # noqa: E402
from memdiff.recording.emulate.runtime import Emulator  # noqa: E402
from memdiff.recording.emulate.session import emulating  # noqa: E402


def _block(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for a request: rounded up to 512 bytes."""
    return -(-nbytes // 512) * 512


class Tied(nn.Module):
    """An embedding shared with the output head, as GPT-2 and T5 share theirs."""

    def __init__(self, vocab: int = 4096, width: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.body = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def test_a_cpu_built_model_moved_to_the_gpu_trains_with_its_parameter_bytes_on_the_device():
    with emulating(Emulator(gpu("h100"))):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)], nn.LayerNorm(1024))
        params = list(model.parameters())
        expected = sum(_block(p.numel() * p.element_size()) for p in params)
        before = torch.cuda.memory_allocated()
        model.cuda()
        assert torch.cuda.memory_allocated() - before == expected
        assert all(p.is_cuda for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(8, 1024, device="cuda")).pow(2).mean().backward()
        opt.step()
        assert [p.grad.shape for p in model.parameters()] == [p.shape for p in params]
        states = [s for group in opt.state.values() for s in group.values() if s.dim() > 0]
        assert sum(s.numel() * s.element_size() for s in states) == 2 * sum(p.numel() * 4 for p in params)


def test_a_cpu_built_model_converted_then_moved_holds_the_converted_bytes_and_its_copy_is_real_on_the_cpu():
    with emulating(Emulator(gpu("h100"))):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
        kept = copy.deepcopy(model).to(torch.bfloat16)  # stays on the CPU
        half = model.to(torch.bfloat16)
        before = torch.cuda.memory_allocated()
        half.cuda()
        assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in half.parameters())
        assert torch.cuda.memory_allocated() - before == sum(_block(p.numel() * 2) for p in half.parameters())
        bound = 1 / math.sqrt(1024)
        top = kept[0].weight.detach().float().abs().max().item()
        assert 0.99 * bound < top <= bound * (1 + 2 ** -8)  # kaiming_uniform_'s bound, rounded to bf16


def test_tied_weights_stay_tied_moved_or_not():
    with emulating(Emulator(gpu("h100"))):
        kept = Tied()
        # on the CPU: one storage, written through one module, read through the other
        nn.init.constant_(kept.embed.weight, 0.25)
        assert kept.head.weight.data_ptr() == kept.embed.weight.data_ptr()
        assert torch.all(kept.head.weight == 0.25)
        moved = Tied()
        shared = moved.embed.weight.numel() * 4
        before = torch.cuda.memory_allocated()
        moved.cuda()
        assert moved.head.weight is moved.embed.weight
        others = sum(_block(p.numel() * 4) for n, p in moved.named_parameters() if not n.startswith(("embed", "head")))
        assert torch.cuda.memory_allocated() - before == _block(shared) + others


def test_an_optimizer_built_before_the_move_steps_the_moved_weights():
    # minGPT-ddp builds its optimizer, then moves the model: the GPU's move keeps each Parameter
    # (and what the user set on it), so the optimizer steps the weights on the device.
    with emulating(Emulator(gpu("h100"))):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
        model[0].weight.tag = "decay"
        params = list(model.parameters())
        opt = torch.optim.AdamW(model.parameters())
        model.to(0)
        assert all(p is q and p.is_cuda for p, q in zip(params, model.parameters()))
        assert model[0].weight.tag == "decay"
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 1024, device="cuda")).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)  # with no gradient on its weights: "No inf checks were recorded"
        scaler.update()
        states = [s for group in opt.state.values() for s in group.values() if s.dim() > 0]
        assert all(s.is_cuda for s in states)
        assert sum(s.numel() * s.element_size() for s in states) == 2 * sum(p.numel() * 4 for p in params)


def test_a_weakly_referenced_parameter_is_still_the_one_the_optimizer_steps_after_the_move():
    # DeepSpeed keeps a finalizer on every weight (deepspeed/utils/debug.py's param_names, by id), and
    # accelerate's users build a torch optimizer before `prepare` moves the model: on the GPU the move
    # keeps each Parameter, so the optimizer (and the weak reference) still hold the model's weights.
    import weakref

    with emulating(Emulator(gpu("h100"))):
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        names = {id(p): n for n, p in model.named_parameters()}
        finalizers = [weakref.finalize(p, names.pop, id(p)) for p in model.parameters()]
        model[1].bias.tag = "no_decay"
        params = list(model.parameters())
        opt = torch.optim.AdamW(model.parameters())
        model.to("cuda")
        assert all(p is q and p.is_cuda for p, q in zip(params, model.parameters()))
        assert [names[id(p)] for p in model.parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
        assert all(f.alive for f in finalizers)
        assert model[1].bias.tag == "no_decay"
        model(torch.randn(8, 256, device="cuda")).pow(2).mean().backward()
        opt.step()
        assert set(opt.state) == set(model.parameters())


def test_weights_that_stay_on_the_cpu_follow_their_initialisation():
    reference = nn.init.trunc_normal_(torch.empty(2048, 512), std=0.02, a=-0.03, b=0.03).std().item()
    with emulating(Emulator(gpu("h100"))):
        torch.manual_seed(0)
        linear = nn.Linear(1024, 2048)
        embed = nn.Embedding(4096, 512, padding_idx=3)
        conv = nn.Conv2d(4, 1152, 2, stride=2)
        flat = conv.weight.data.view(1152, -1)
        nn.init.xavier_uniform_(flat)  # an in-place init through a view, as diffusion transformers do
        trunc = torch.empty(2048, 512)
        nn.init.trunc_normal_(trunc, std=0.02, a=-0.03, b=0.03)
        zeros, full = torch.zeros(1024, 1024), torch.full((512, 1024), 2.5)
        weight = linear.weight.detach()
        bound = 1 / math.sqrt(1024)  # kaiming_uniform_(a=sqrt(5)) on fan_in 1024
        assert weight.abs().max() <= bound and weight.abs().max() > 0.99 * bound
        assert abs(weight.std().item() - bound / math.sqrt(3)) < 0.01 * bound
        row = embed.weight.detach()
        assert torch.all(row[3] == 0) and abs(row[4:].std().item() - 1) < 0.01
        xavier = math.sqrt(6 / (16 + 1152))
        assert conv.weight.abs().max() <= xavier and conv.weight.abs().max() > 0.99 * xavier
        assert trunc.min() >= -0.03 and trunc.max() <= 0.03 and abs(trunc.std().item() / reference - 1) < 0.02
        assert torch.all(zeros == 0) and torch.all(full == 2.5)


def test_a_cpu_model_computes_on_the_cpu_what_its_weights_give_without_emulation():
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(1))
    with emulating(Emulator(gpu("h100"))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 8))
        emulated = nn.functional.cross_entropy(model(x), torch.arange(16) % 8).item()
        weights = {k: torch.from_numpy(v.detach().numpy().copy()) for k, v in model.state_dict().items()}
    plain = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 8))
    plain.load_state_dict(weights)
    assert emulated == nn.functional.cross_entropy(plain(x), torch.arange(16) % 8).item()
    assert emulated > 0


def test_the_same_seed_gives_the_same_weights_and_a_copy_equals_its_source():
    with emulating(Emulator(gpu("h100"))):
        torch.manual_seed(7)
        a = nn.Linear(1024, 1024)
        ema = copy.deepcopy(a)
        half = a.weight.detach().to(torch.bfloat16)
        torch.manual_seed(7)
        b = nn.Linear(1024, 1024)
        c = nn.Linear(1024, 1024)
        assert torch.equal(a.weight, b.weight) and torch.equal(ema.weight, a.weight)
        assert not torch.equal(b.weight, c.weight)
        assert torch.equal(half, a.weight.detach().to(torch.bfloat16))
        before = a.weight.detach().clone()
        with torch.no_grad():
            a.weight.mul_(2)  # a write after the copies: they keep what they copied
        assert torch.equal(before * 2, a.weight) and torch.equal(ema.weight, before)


def test_a_state_dict_loaded_into_a_cpu_built_model_is_what_was_loaded():
    source = nn.Linear(1024, 1024)
    with emulating(Emulator(gpu("h100"))):
        model = nn.Linear(1024, 1024)
        model.load_state_dict(source.state_dict())
        assert torch.equal(model.weight, source.weight)


def test_files_written_from_a_cpu_model_hold_its_weights(tmp_path):
    from safetensors.torch import load

    with emulating(Emulator(gpu("h100"))):
        from safetensors.torch import save_file  # imported in the run, as a script does: its writer routed

        model = nn.Linear(1024, 1024)
        torch.save(model.state_dict(), tmp_path / "model.pt")
        other = nn.Linear(1024, 1024)
        save_file({"weight": other.weight.detach()}, str(tmp_path / "model.safetensors"))
        read = model.weight.detach().numpy().copy(), other.weight.detach().numpy().copy()
        # the files are in the run's overlay, which the block removes: read their bytes back as the run sees them
        written = (tmp_path / "model.pt").read_bytes(), (tmp_path / "model.safetensors").read_bytes()
    assert os.listdir(tmp_path) == []  # the user's folder is untouched: both writes went to the overlay
    saved = torch.load(io.BytesIO(written[0]))["weight"]
    assert torch.equal(saved, torch.from_numpy(read[0])) and saved.abs().max() > 0
    assert torch.equal(load(written[1])["weight"], torch.from_numpy(read[1]))


def test_a_cpu_tensor_made_under_emulation_is_real_after_it_ends():
    with emulating(Emulator(gpu("h100"))):
        w = nn.init.normal_(torch.empty(1024, 1024), std=3.0)
    assert abs(w.std().item() - 3.0) < 0.03


@pytest.mark.slow
def test_a_cpu_built_model_moved_to_the_gpu_costs_far_less_host_memory_than_its_weights(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import resource
        import torch
        from torch import nn

        def step(model):
            opt = torch.optim.AdamW(model.parameters())
            model(torch.randn(8, model[0].in_features, device="cuda")).sum().backward()
            opt.step()

        step(nn.Sequential(nn.Linear(64, 64)).cuda())  # the imports a first step makes, before measuring
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)])
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        step(model.cuda())
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        print(nbytes, grown, torch.cuda.max_memory_allocated())
    """))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    nbytes, grown, peak = (int(v) for v in done.stdout.split())
    assert nbytes == 16 * (4096 * 4096 + 4096) * 4
    assert grown < nbytes / 50  # the weights (1.07 GB) were never made on the host
    assert peak >= 4 * nbytes  # weights, gradients and AdamW's two states on the emulated GPU


def test_autocast_caches_only_the_casts_torch_caches():
    """Issue 58: torch's cached_cast keeps a weight's cast until autocast exits only for an fp32
    leaf that requires grad and is no view; any other cast is freed after its op. The emulator
    cached every leaf's: fp16 weights under bf16 autocast kept each layer's bf16 copy to the
    forward's end. Four 1024 x 1024 layers in a forward under inference_mode: fp32 weights keep
    their four 2 MiB casts, fp16 weights none."""
    with emulating(Emulator(gpu("h100"))):
        for dtype, cached in ((torch.float32, True), (torch.float16, False)):
            model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4))).to("cuda", dtype)
            x = torch.randn(8, 1024, device="cuda", dtype=dtype)
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                model[0](x)  # the thread's first product makes its cuBLAS workspace
                torch.clear_autocast_cache()
                before = torch.cuda.memory_allocated()
                y = model(x)
                held = torch.cuda.memory_allocated() - before
            casts = 4 * _block(1024 * 1024 * 2) if cached else 0
            assert (dtype, held) == (dtype, _block(y.numel() * 2) + casts)
            del model, x, y
