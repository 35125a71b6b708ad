"""One training step of a model built on the CPU and then moved to the GPU, as fine-tuning and
diffusion scripts do: the weights are made and initialised on the host, `.to(device)` moves them.
The emulator benchmark runs it under `memdiff record --emulate` and reads the process's peak RSS.

    python benchmarks/cpu_built_step.py dit     # a DiT-XL/2-shaped diffusion transformer (~675M parameters), with an EMA copy
    python benchmarks/cpu_built_step.py llama   # a 1B Llama (LlamaForCausalLM from a config, no checkpoint)
"""

import argparse
import copy
import math

import torch
from torch import nn


class Modulated(nn.Module):
    """A transformer block whose norms are shifted and scaled by the conditioning (adaLN), its
    residual branches gated, the modulation's projection starting at zero."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_attn = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm_mlp = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm_attn(x) * (1 + scale_a) + shift_a
        b, n, w = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        x = x + gate_a * self.proj(a)
        return x + gate_m * self.mlp(self.norm_mlp(x) * (1 + scale_m) + shift_m)


class DiffusionTransformer(nn.Module):
    """Latents cut into patches, a timestep and a class as the conditioning, modulated blocks,
    and a modulated head that gives back noise and variance per patch."""

    def __init__(self, size: int = 32, channels: int = 4, patch: int = 2, width: int = 1152, depth: int = 28,
                 heads: int = 16, classes: int = 1000) -> None:
        super().__init__()
        self.patch, self.channels, self.size = patch, channels, size
        self.embed = nn.Conv2d(channels, width, patch, stride=patch)
        tokens = (size // patch) ** 2
        self.position = nn.Parameter(torch.zeros(1, tokens, width), requires_grad=False)
        self.time = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        self.label = nn.Embedding(classes + 1, width)  # the last class is "no class" (guidance)
        self.blocks = nn.ModuleList(Modulated(width, heads) for _ in range(depth))
        self.head_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.head_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.head = nn.Linear(width, patch * patch * 2 * channels)
        self.initialise(tokens, width)

    def initialise(self, tokens: int, width: int) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        flat = self.embed.weight.data
        nn.init.xavier_uniform_(flat.view(flat.shape[0], -1))  # the patch embedding as a linear map
        nn.init.zeros_(self.embed.bias)
        nn.init.normal_(self.label.weight, std=0.02)
        for layer in (self.time[0], self.time[2]):
            nn.init.normal_(layer.weight, std=0.02)
        for block in self.blocks:  # every block starts as the identity
            nn.init.zeros_(block.modulation[-1].weight)
            nn.init.zeros_(block.modulation[-1].bias)
        nn.init.zeros_(self.head_modulation[-1].weight)
        nn.init.zeros_(self.head.weight)
        # fixed sine-cosine positions over the patch grid, made in numpy as such scripts do
        import numpy as np

        side = int(math.sqrt(tokens))
        ys, xs = np.meshgrid(np.arange(side, dtype=np.float64), np.arange(side, dtype=np.float64), indexing="ij")
        freq = 1.0 / 10000 ** (np.arange(width // 4, dtype=np.float64) / (width // 4))
        parts = [f(pos.reshape(-1, 1) * freq) for pos in (ys, xs) for f in (np.sin, np.cos)]
        self.position.data.copy_(torch.from_numpy(np.concatenate(parts, axis=1)).float().unsqueeze(0))

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        half = 128
        freq = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t[:, None].float() * freq[None]
        return self.time(torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(2).transpose(1, 2) + self.position
        c = self.timestep(t) + self.label(y)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.head_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        return self.head(self.head_norm(h) * (1 + scale) + shift)


def build(kind: str) -> nn.Module:
    """The model, on the CPU, initialised as its script initialises it."""
    if kind == "dit":
        return DiffusionTransformer()
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("dit", "llama"))
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = build(args.kind)
    if args.kind == "dit":  # an EMA of the weights, copied before the move, as diffusion training keeps one
        ema = copy.deepcopy(model).to(device)
        ema.requires_grad_(False)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    if args.kind == "dit":
        x = torch.randn(args.batch, 4, 32, 32, device=device)
        t = torch.randint(0, 1000, (args.batch,), device=device)
        y = torch.randint(0, 1000, (args.batch,), device=device)
        loss = (model(x, t, y) ** 2).mean()
    else:
        ids = torch.randint(0, 128256, (args.batch, 512), device=device)
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if args.kind == "dit":
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1e-4)
    print(sum(p.numel() for p in model.parameters()), torch.cuda.max_memory_allocated())


if __name__ == "__main__":
    main()
