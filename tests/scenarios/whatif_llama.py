"""A small Llama-like decoder (plain torch.nn: RMS norms, attention through SDPA, a SwiGLU MLP, a
ModuleList of blocks) trained a few steps on CUDA, with each change `memdiff whatif` names made by hand
as its own flag, the ordinary way: `memdiff whatif --emulate` must make the same run of the script
without them (tests/test_whatif_rerun.py).

    python tests/scenarios/whatif_llama.py [--checkpoint F] [--weights bf16] [--autocast bf16]
        [--optimizer sgd] [--zero-grad zeros] [--accumulate K]
"""

import argparse
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=256)
parser.add_argument("--vocab", type=int, default=2048)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--checkpoint", type=float, default=0.0, help="checkpoint every 1/F-th block (0.5: the 2nd, 4th, ...)")
parser.add_argument("--weights", choices=("bf16", "fp16"))
parser.add_argument("--autocast", choices=("bf16", "fp16"))
parser.add_argument("--optimizer", choices=("adamw", "adamw-amsgrad", "sgd", "sgd-momentum", "adam", "adagrad", "rmsprop",
                                            "adafactor"), default="adamw")
parser.add_argument("--step", choices=("single", "foreach", "fused"), help="the update's form (default: torch's)")
parser.add_argument("--zero-grad", choices=("none", "zeros"), default="none")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches of 1/K the batch per step")
parser.add_argument("--on-gpu", action="store_true",
                    help="build the model on the GPU (`with torch.device('cuda')`), never moving it")
parser.add_argument("--fail", action="store_true", help="raise an error that is not out of memory")
args = parser.parse_args()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, 4 * dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args.dim) for _ in range(args.layers))
        self.norm = RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)
        f = Fraction(args.checkpoint).limit_denominator(1000)
        self.checkpointed = {k for k in range(args.layers) if int((k + 1) * f) > int(k * f)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=False) if i in self.checkpointed else layer(x)
        return self.head(self.norm(x))


if args.fail:
    raise ValueError("the data set is missing")
torch.manual_seed(0)
if args.on_gpu:
    with torch.device("cuda"):
        model = Decoder()
else:
    model = Decoder().to("cuda")
if args.weights:
    model = model.to(DTYPES[args.weights])
params = model.parameters()
FORM = {None: {}, "single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.step]
optimizer = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **FORM),
             "adamw-amsgrad": lambda: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
             "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
             "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
             "adam": lambda: torch.optim.Adam(params, lr=1e-3),
             "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-3),
             "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3),
             "adafactor": lambda: torch.optim.Adafactor(params, lr=1e-3)}[args.optimizer]()
micro = args.batch // args.accumulate
for _ in range(args.steps):
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda")
    for k in range(args.accumulate):
        part = ids[k * micro:(k + 1) * micro]
        if args.autocast:
            with torch.autocast("cuda", dtype=DTYPES[args.autocast]):
                logits = model(part[:, :-1])
        else:
            logits = model(part[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), part[:, 1:].flatten()) / args.accumulate
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=args.zero_grad == "none")
print(f"max_memory_allocated {torch.cuda.max_memory_allocated()}")
