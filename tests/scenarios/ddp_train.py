"""Two AdamW steps of the example GPT under DistributedDataParallel (gloo, CPU), as torchrun runs it.

Rank 0 also keeps a buffer to the end, as a trainer that gathers every rank's logits on rank 0
does: `memdiff ranks` must show rank 0 as the heaviest with this buffer's site at the top.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from memdiff.examples.gpt import GPT, Config

KEPT_BYTES = 8 << 20


def keep_rank0_buffer() -> torch.Tensor:
    """The extra memory only rank 0 holds."""
    return torch.ones(KEPT_BYTES // 4)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    c = Config(n_layer=2, n_embd=64, vocab_size=512, block_size=64)
    model = DistributedDataParallel(GPT(c))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = keep_rank0_buffer() if rank == 0 else None
    for _ in range(2):
        idx = torch.randint(0, c.vocab_size, (4, 32))
        loss = model(idx, torch.randint(0, c.vocab_size, (4, 32)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    del kept
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
