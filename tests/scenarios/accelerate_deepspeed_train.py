"""Two steps of a 4-layer MLP trained by accelerate with DeepSpeed's ZeRO, as `accelerate launch
--use_deepspeed` runs it.

    memdiff record --emulate h100 -o runs/ --ranks 0,3 -- accelerate launch --use_deepspeed \\
        --num_processes 4 --deepspeed_config_file ds.json --mixed_precision bf16 accelerate_deepspeed_train.py

The Accelerator takes DeepSpeed's settings from the environment accelerate's launcher gives each rank
(ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE, ACCELERATE_MIXED_PRECISION). The
optimizer is torch's AdamW, made on the CPU model before `prepare` moves it, as accelerate's examples
do: DeepSpeed's ZeRO takes it over, with the weights it was given, which must be the moved ones.
Each rank prints `facts {JSON}`: its rank, the world size and ZeRO stage DeepSpeed's engine runs, each
parameter's element count, and the elements of the fp32 partition DeepSpeed gave this rank.
"""

import json

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LAYERS, WIDTH, STEPS = 4, 256, 2


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)))
    numels = [t.numel() for t in model.parameters()]
    data = DataLoader(TensorDataset(torch.randn(8 * STEPS, WIDTH)), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer, data = accelerator.prepare(model, optimizer, data)
    for (x,) in data:
        # DeepSpeed's bf16 engine holds bf16 weights and casts no input (accelerate adds no autocast
        # under DeepSpeed): the batch takes the weights' dtype, or CUDA's product refuses it.
        loss = engine(x.to(next(engine.parameters()).dtype)).float().square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    # on stdout: an emulated run's files go to its overlay
    print("facts", json.dumps({
        "rank": engine.global_rank, "world_size": engine.world_size, "stage": engine.zero_optimization_stage(),
        "numels": numels, "partition": engine.optimizer.single_partition_of_fp32_groups[0].numel()}), flush=True)


if __name__ == "__main__":
    main()
