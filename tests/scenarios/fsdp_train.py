"""Two AdamW steps of a 4-block MLP sharded with FSDP2 (`fully_shard`, gloo, CPU), as torchrun runs it.

    memdiff record -o runs/ -- python -m torch.distributed.run --nproc-per-node 2 fsdp_train.py [--no-reshard]

Each block and the root are sharded; `--no-reshard` keeps each block's all-gathered parameters
from its forward to its backward (`reshard_after_forward=False`). Rank 0 writes
`facts.json` beside the snapshots (`--facts FILE`): the model's parameter bytes and the world
size, for the tests to check memdiff's parameter and gradient bytes per rank against.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

BLOCKS = 4


class Block(nn.Module):
    """Linear(w, 2w), GELU, Linear(2w, w)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--facts", help="rank 0 writes the model's facts here")
    p.add_argument("--cuda", action="store_true", help="train on the rank's GPU, cuda:LOCAL_RANK (memdiff fit)")
    p.add_argument("--width", type=int, default=512, help="the blocks' width w (4 blocks of 4 w^2 weights)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.cuda else torch.device("cpu")
    model = nn.Sequential(*(Block(args.width) for _ in range(BLOCKS))).to(device)
    parameter_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    for block in model:
        fully_shard(block, reshard_after_forward=not args.no_reshard)
    fully_shard(model, reshard_after_forward=not args.no_reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(16, args.width, device=device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if args.facts and dist.get_rank() == 0:
        with open(args.facts, "w") as f:
            json.dump({"parameter_bytes": parameter_bytes, "world_size": dist.get_world_size()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
