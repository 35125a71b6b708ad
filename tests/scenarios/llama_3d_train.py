"""A Llama-3-shaped model trained with FSDP2 x tensor parallel x pipeline parallel, as torchrun runs it.

    memdiff record --emulate h100 -o runs/ --ranks auto -- torchrun --nnodes 64 --nproc-per-node 8 \\
        llama_3d_train.py --size 405b --tp 8 --pp 8

The world is a mesh of (pp, dp, tp), tp innermost (a node's GPUs), as torchtitan lays it out. The
model (`--size`: Llama 3's 8B, 70B and 405B shapes, or `tiny` for tests) is built on the meta device,
cut into `--pp` stages of consecutive blocks (the first stages take one more when they do not
divide), each block's projections split over tp (`parallelize_module`: q, k, v and the MLP's gate
and up by columns, the output projections by rows; the embedding by rows, the head by columns),
every block wrapped in activation checkpointing (`--ac full`) and sharded by FSDP2 over dp (bf16
compute, fp32 gradient reduction), then materialised on the rank's GPU. Each pipeline stage is
given its microbatch's input and output shapes (static: no shape exchange), and `--steps` AdamW
steps run under Schedule1F1B (`--pp 1`: a plain loop over the microbatches). As in torchtitan, with
pipeline stages FSDP2 keeps each block's gathered weights from its forward to its backward
(`reshard_after_forward=False`), since every microbatch would gather them again. The head's loss
is the cross-entropy of its vocabulary shard (what loss parallel computes on each tp rank, less the
few scalars a token it all-reduces).

`shard_bytes` works out a rank's fp32 shard of its stage's weights from the shape by hand, for the
tests to hold memdiff's `parameter` bytes to.
"""

import argparse
import os
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint


@dataclass
class Shape:
    """A Llama 3 configuration's dimensions."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


# Llama 3's published shapes (its model cards' params.json), and a tiny one for tests.
SHAPES = {
    "8b": Shape(4096, 32, 32, 8, 14336, 128256),
    "70b": Shape(8192, 80, 64, 8, 28672, 128256),
    "405b": Shape(16384, 126, 128, 8, 53248, 128256),
    "tiny": Shape(256, 8, 8, 4, 512, 1024),
}


class Attention(nn.Module):
    """Grouped-query attention over SDPA, with rotary position embeddings."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.head_dim = shape.dim // shape.heads
        self.wq = nn.Linear(shape.dim, shape.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: this tp rank's heads (the projections are split by columns).
        q = rotate(self.wq(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = rotate(self.wk(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (batch, seq, heads, head_dim) by the halves' rotation."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    """RMSNorm, attention, RMSNorm, SwiGLU MLP, each with its residual."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim)
        self.attention = Attention(shape)
        self.ffn_norm = nn.RMSNorm(shape.dim)
        self.w1 = nn.Linear(shape.dim, shape.ffn, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn, bias=False)
        self.w2 = nn.Linear(shape.ffn, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, blocks, the norm and head on the last."""

    def __init__(self, shape: Shape, blocks: int, first: bool, last: bool, full_ac: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(shape.vocab, shape.dim) if first else None
        self.blocks = nn.ModuleList(Block(shape) for _ in range(blocks))
        self.norm = nn.RMSNorm(shape.dim) if last else None
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False) if last else None
        self.head_dim, self.full_ac = shape.dim // shape.heads, full_ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embedding(x) if self.embedding is not None else x
        seq = h.shape[1]
        angles = torch.outer(torch.arange(seq, device=h.device, dtype=torch.float32),
                             500000.0 ** (-torch.arange(0, self.head_dim, 2, device=h.device) / self.head_dim))
        cos, sin = angles.cos()[None, :, None, :].to(h.dtype), angles.sin()[None, :, None, :].to(h.dtype)
        for block in self.blocks:
            h = checkpoint(block, h, cos, sin, use_reentrant=False) if self.full_ac else block(h, cos, sin)
        if self.head is not None and self.norm is not None:
            h = self.head(self.norm(h))
        return h


def split(layers: int, stages: int) -> List[int]:
    """Blocks per stage: the first `layers % stages` stages take one more."""
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def parallelize(stage: Stage, tp_mesh, dp_mesh, reshard: bool) -> None:
    """Tensor parallel over tp_mesh, then FSDP2 over dp_mesh, block by block."""
    if stage.embedding is not None:
        parallelize_module(stage, tp_mesh, {"embedding": RowwiseParallel(input_layouts=Replicate())})
    if stage.head is not None:
        parallelize_module(stage, tp_mesh, {"head": ColwiseParallel()})
    plan = {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv", "w1", "w3")}
    plan.update({"attention.wo": RowwiseParallel(), "w2": RowwiseParallel()})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in stage.blocks:
        parallelize_module(block, tp_mesh, plan)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--local-batch", type=int, default=8, help="sequences a dp replica takes a step")
    p.add_argument("--microbatch", type=int, help="sequences a microbatch (default: 1 with pipeline stages, "
                                                  "else the local batch in one pass)")
    p.add_argument("--ac", choices=("full", "none"), default="full")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    shape = SHAPES[args.size]
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (args.tp * args.pp)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    index = mesh["pp"].get_local_rank()
    blocks = split(shape.layers, args.pp)
    first, last = index == 0, index == args.pp - 1
    with torch.device("meta"):
        stage = Stage(shape, blocks[index], first, last, args.ac == "full")
    parallelize(stage, mesh["tp"], mesh["dp"], reshard=args.pp == 1)
    stage.to_empty(device=device)
    for weight in stage.parameters():
        nn.init.normal_(weight, std=0.02) if weight.dim() > 1 else nn.init.ones_(weight)
    microbatch = args.microbatch or (1 if args.pp > 1 else args.local_batch)
    microbatches = args.local_batch // microbatch
    vocab_shard = shape.vocab // args.tp

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))

    schedule: Optional[Schedule1F1B] = None
    if args.pp > 1:
        # Activations passed between stages carry gradients back: their examples say so.
        hidden = torch.empty(microbatch, args.seq, shape.dim, dtype=torch.bfloat16, device="meta",
                             requires_grad=True)
        tokens = torch.empty(microbatch, args.seq, dtype=torch.long, device="meta")
        logits = torch.empty(microbatch, args.seq, vocab_shard, dtype=torch.bfloat16, device="meta",
                             requires_grad=True)
        pipe = PipelineStage(stage, index, args.pp, device, input_args=tokens if first else hidden,
                             output_args=logits if last else hidden, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(pipe, microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    for _ in range(args.steps):
        tokens = torch.randint(0, shape.vocab, (args.local_batch, args.seq), device=device)
        target = torch.randint(0, vocab_shard, (args.local_batch, args.seq), device=device)
        if schedule is None:
            for x, y in zip(tokens.chunk(microbatches), target.chunk(microbatches)):
                (loss_fn(stage(x), y) / microbatches).backward()
        elif first:
            schedule.step(tokens)
        elif last:
            schedule.step(target=target)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


def shard_bytes(size: str, tp: int, pp: int, dp: int, stage: int) -> int:
    """A rank's fp32 shard of stage `stage`'s weights, by hand from the model's shape: the stage's
    blocks (and the embedding on the first, the norm and head on the last), the projections and the
    embedding and head split over tp, everything then split over dp."""
    shape = SHAPES[size]
    head_dim = shape.dim // shape.heads
    split_over_tp = shape.dim * head_dim * (2 * shape.heads + 2 * shape.kv_heads) + 3 * shape.dim * shape.ffn
    per_rank = split(shape.layers, pp)[stage] * (split_over_tp // tp + 2 * shape.dim)  # 2 norms: whole
    if stage == 0:
        per_rank += shape.vocab * shape.dim // tp  # the embedding, by rows
    if stage == pp - 1:
        per_rank += shape.vocab * shape.dim // tp + shape.dim  # the head by rows of the vocabulary; the norm
    return per_rank // dp * 4


if __name__ == "__main__":
    main()
