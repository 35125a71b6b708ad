"""Two steps of a 4-layer MLP trained by DeepSpeed's ZeRO (bf16), as `deepspeed` runs it.

    memdiff record --emulate h100 -o runs/ --ranks 0 -- \\
        deepspeed --num_gpus 2 deepspeed_train.py --stage 2 [--offload] [--optimizer adam]

The config comes from the flags: ZeRO `--stage` (0-3), `--offload` (the optimizer and its fp32
master weights on the CPU), bf16, the `--optimizer` (torch's AdamW by default, `"torch_adam": true`;
or DeepSpeed's FusedAdam, FusedLamb or FusedLion, CUDA extensions it builds as the script runs; with
--offload, "adam" is DeepSpeedCPUAdam), and reduce and all-gather buckets of `--bucket` elements, small
so the runs are fast and the buckets are seen. Rank 0 prints `facts {JSON}`: each parameter's
element count, the world size and the bucket size, for the tests' counts by hand.
"""

import argparse
import json

import deepspeed
import torch
from torch import nn

LAYERS = 4
# --optimizer: the config's "optimizer" section for each. "adam" is DeepSpeed's default on a GPU
# (FusedAdam, a CUDA extension DeepSpeed builds at run time); "lamb" and "lion" are its FusedLamb and
# FusedLion, built the same way.
OPTIMIZERS = {
    "torch": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "adam": {"type": "Adam", "params": {"lr": 1e-4}},
    "lamb": {"type": "Lamb", "params": {"lr": 1e-4}},
    "lion": {"type": "Lion", "params": {"lr": 1e-4}},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0, help="what DeepSpeed's launcher passes")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage, 0-3")
    p.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU")
    p.add_argument("--width", type=int, default=512, help="the layers' width w (4 of w^2 + w parameters)")
    p.add_argument("--bucket", type=int, default=1 << 18, help="reduce and all-gather bucket sizes, in elements")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--optimizer", default="torch", choices=sorted(OPTIMIZERS),
                   help="DeepSpeed's optimizer config: torch's AdamW, or one of DeepSpeed's fused CUDA optimizers")
    args = p.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(LAYERS)))
    numels = [t.numel() for t in model.parameters()]
    zero = {"stage": args.stage, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket}
    if args.stage == 3:
        # stage 3 gathers and prefetches by these: small, like the buckets above
        zero.update(stage3_prefetch_bucket_size=args.bucket, stage3_param_persistence_threshold=0)
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": OPTIMIZERS[args.optimizer],
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        # DeepSpeed lists FusedLamb among no ZeRO stage's tested optimizers
        "zero_allow_untested_optimizer": args.optimizer == "lamb",
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(args.steps):
        x = torch.randn(8, args.width, device=engine.device, dtype=torch.bfloat16)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
    if engine.global_rank == 0:
        # on stdout: an emulated run's files go to its overlay
        print("facts", json.dumps({"numels": numels, "world_size": engine.world_size, "bucket": args.bucket}))


if __name__ == "__main__":
    main()
