"""Two AdamW steps of GPT-2 (the library's default config) under DistributedDataParallel on one
GPU, as `torchrun --nproc-per-node 2` runs it: gloo, since NCCL refuses two ranks on one device.

Rank 0 also keeps a 64 MiB buffer to the end, as a trainer that gathers every rank's logits on
rank 0 does: `memdiff ranks` must show rank 0 as the heaviest, by that buffer. With
DDP_GPT2_FAIL_RANK=N, rank N raises after its first step (torchrun then stops the others).
"""

import os

import torch
import torch.distributed as dist
import transformers as hf
from torch.nn.parallel import DistributedDataParallel

KEPT_BYTES = 64 << 20


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(hf.GPT2LMHeadModel(hf.GPT2Config()).cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept = torch.ones(KEPT_BYTES // 4, device="cuda") if rank == 0 else None
    for step in range(2):
        if step == 1 and os.environ.get("DDP_GPT2_FAIL_RANK") == str(rank):
            raise RuntimeError(f"rank {rank}: a simulated failure after the first step")
        ids = torch.randint(0, 50257, (4, 512)).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    del kept
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
