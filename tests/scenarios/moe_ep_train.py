"""Two AdamW steps of a small mixture-of-experts transformer with its experts sharded over the ranks
(expert parallelism), as torchrun runs it.

    memdiff record --emulate h100 -o runs/ -- torchrun --nproc-per-node 2 moe_ep_train.py

The model is `--layers` pre-norm blocks of width `--dim`: causal self-attention, then a mixture of
`--experts` experts (each a GELU MLP of `--hidden`) of which every token takes `--top-k`. The
attention, the norms and the routers are replicated on every rank (the shared weights); the experts
are split over the expert-parallel group, `experts / ep` consecutive experts a rank: the `ep`
dimension of a (`dp`, `ep`) device mesh, the whole world unless `--ep` gives fewer ranks (then `dp`
replicas of each expert, whose gradients are averaged over `dp`; the shared weights' over all
ranks). Each rank routes its own `--batch` x `--seq` tokens as expert parallelism does: `topk` of
the router's logits, the token count of each expert on the device (`bincount`), an all-to-all of
those counts (`dist.all_to_all_single`), then the counts read back (`.tolist()`) as the split sizes
of the all-to-all of the tokens themselves (`all_to_all_single_autograd`, whose backward is the
reverse all-to-all). The rank's experts run on the tokens it received, grouped by expert, and a
second all-to-all sends the results back to the tokens' ranks, which weigh and add each token's `k`
results.

Rank 0 prints `facts {JSON}`: the bytes of the shared weights and of one rank's experts, and the rows
a rank's dispatch buffer holds in each layer (tokens x k) with the world size.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh


class Experts(nn.Module):
    """This rank's experts: one GELU MLP each, their weights stacked."""

    def __init__(self, count: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(count, dim, hidden) * dim ** -0.5)
        self.down = nn.Parameter(torch.randn(count, hidden, dim) * hidden ** -0.5)

    def forward(self, rows: torch.Tensor, sizes: list) -> torch.Tensor:
        """`rows` grouped by expert, `sizes[e]` rows for local expert e."""
        outs = [nn.functional.gelu(part @ self.up[e]) @ self.down[e] for e, part in enumerate(rows.split(sizes))]
        return torch.cat(outs)


class MoE(nn.Module):
    """A router over all experts (replicated) and this rank's share of them, with the token dispatch."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.k, self.experts, self.group = k, experts, group
        self.ep = group.size()
        self.local = experts // self.ep
        self.router = nn.Linear(dim, experts, bias=False)
        self.mine = Experts(self.local, dim, hidden)
        self.received = 0  # rows the last dispatch brought to this rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores, chosen = self.router(x).topk(self.k, dim=-1)
        weights = scores.softmax(dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the token's rows sorted by expert: rank by rank
        rows = x[order // self.k]
        counts = torch.bincount(flat, minlength=self.experts)
        # counts_in[r * local + e]: the rows rank r sends this rank's expert e
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=self.group)
        send = counts.view(self.ep, self.local).sum(dim=1).tolist()
        receive = counts_in.view(self.ep, self.local).sum(dim=1).tolist()
        got = all_to_all_single_autograd(rows, receive, send, self.group)
        self.received = got.shape[0]
        # The received rows come rank by rank, each rank's by expert: group them by expert
        expert_of = torch.arange(self.local, device=x.device).repeat(self.ep)
        by_expert = torch.repeat_interleave(expert_of, counts_in).argsort(stable=True)
        done = torch.empty_like(got)
        done[by_expert] = self.mine(got[by_expert], counts_in.view(self.ep, self.local).sum(dim=0).tolist())
        back = all_to_all_single_autograd(done, send, receive, self.group)
        mixed = torch.empty_like(back)
        mixed[order] = back
        out = (mixed.view(-1, self.k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        return out.view(shape)


class Block(nn.Module):
    """x + attention(norm(x)), then + moe(norm(x))."""

    def __init__(self, dim: int, heads: int, hidden: int, experts: int, k: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.moe = MoE(dim, hidden, experts, k, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.norm2(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8, help="a multiple of the expert-parallel degree")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ep", type=int, default=0, help="the expert-parallel degree (default: the world size)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    ep = args.ep or world
    mesh = init_device_mesh("cuda", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block(args.dim, args.heads, args.hidden, args.experts, args.top_k, mesh.get_group("ep"))
                             for _ in range(args.layers))).to(device)
    expert_params = {id(p) for block in blocks for p in block.moe.mine.parameters()}
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(args.batch, args.seq, args.dim, device=device)
        blocks(x).square().mean().backward()
        # The replicated weights' gradients averaged over every rank, the experts' over their replicas
        for p in blocks.parameters():
            replicas = mesh.get_group("dp") if id(p) in expert_params else dist.group.WORLD
            if dist.get_world_size(replicas) > 1:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=replicas)
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        nbytes = {True: 0, False: 0}
        for p in blocks.parameters():
            nbytes[id(p) in expert_params] += p.numel() * p.element_size()
        print("facts " + json.dumps({
            "shared_bytes": nbytes[False], "expert_bytes": nbytes[True], "world": world, "ep": ep,
            "tokens": args.batch * args.seq, "top_k": args.top_k, "dim": args.dim, "layers": args.layers,
            "received": [block.moe.received for block in blocks]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
