"""Two AdamW steps of an MLP stack split into pipeline stages (torch.distributed.pipelining), as torchrun runs it.

    memdiff record --emulate h100 -o runs/ -- torchrun --nproc-per-node 2 pipeline_train.py --schedule 1f1b

The model is `--blocks` residual MLP blocks of width `--width`; each rank holds one stage of
`blocks / stages` consecutive blocks (`--schedule gpipe` or `1f1b`), or two (`interleaved`: stages
`rank` and `rank + world`, ScheduleInterleaved1F1B). A batch of `--batch` rows runs as
`--microbatches` microbatches. The stages are built by hand (PipelineStage), with no example input, so
torch infers each stage's shapes from the first microbatch and sends them on (`send_object_list`), as
torchtitan's stages do. The tests work out each stage's weights and activations from these shapes.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B


class Block(nn.Module):
    """x + Linear(2w, w)(GELU(Linear(w, 2w)(x)))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss."""
    return (output - target).square().mean()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    p.add_argument("--blocks", type=int, default=4, help="a multiple of the stages")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=8)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    per_rank = 2 if args.schedule == "interleaved" else 1
    stages_total = world * per_rank
    per_stage = args.blocks // stages_total
    torch.manual_seed(0)
    stages, modules = [], []
    for k in range(per_rank):
        index = rank + k * world
        module = nn.Sequential(*(Block(args.width) for _ in range(per_stage))).to(device)
        stages.append(PipelineStage(module, index, stages_total, device))
        modules.append(module)
    if args.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=squared_error)
    else:
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = kind(stages[0], args.microbatches, loss_fn=squared_error)
    opt = torch.optim.AdamW([w for m in modules for w in m.parameters()], lr=1e-3)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    for _ in range(2):
        x = torch.randn(args.batch, args.width, device=device)
        target = torch.randn(args.batch, args.width, device=device)
        if first and last:
            schedule.step(x, target=target)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=target)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
