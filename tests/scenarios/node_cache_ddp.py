"""A plain DDP script, as torchrun runs it on each of several nodes, whose first local rank of every node
builds a node-local cache (a shard of the dataset kept on its GPU for the node's ranks, as a script does
under `if LOCAL_RANK == 0:`); the global rank 0 does nothing more than any node's first rank.

Rank 0's layout (no mesh, no group but the world's) cannot show that role: `memdiff record --ranks auto`
picks it by the rank's place in its node (memdiff/recording/pick.py). Each rank prints, as its last line,
`rank R local L cache N` from torch's own rank and torchrun's LOCAL_RANK: the ground truth of which
ranks hold the cache, and of its bytes.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

CACHE_BYTES = 40 << 20  # the node-local cache, exactly: a uint8 tensor of this many elements


def main() -> None:
    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    cache = torch.empty(CACHE_BYTES, dtype=torch.uint8, device="cuda") if local == 0 else None
    model = DistributedDataParallel(torch.nn.Linear(256, 256).cuda())
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    held = 0 if cache is None else cache.numel() * cache.element_size()
    os.write(1, f"rank {dist.get_rank()} local {local} cache {held}\n".encode())
    del cache
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
