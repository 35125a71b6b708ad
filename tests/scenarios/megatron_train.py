"""Two training steps of a small GPT built by Megatron-core, as `torchrun` runs it on GPUs.

    memdiff record --emulate h100 -o runs/ -- \\
        torchrun --nproc-per-node 2 megatron_train.py --tp 2 [--pp 1] [--cp 1] [--ep 1]

The world is split by Megatron's parallel_state into tensor (--tp), pipeline (--pp), context (--cp)
and expert (--ep, with --experts) parallel groups; the ranks left over are data parallel. The
model is Megatron's GPTModel with its local layer spec (Megatron's own modules, no
TransformerEngine), wrapped in Megatron's DistributedDataParallel and trained in bf16 by
Megatron's optimizer (torch's Adam underneath, without apex or TransformerEngine;
--distributed-optimizer shards its state over the data-parallel ranks), stepped by Megatron's
schedule (get_forward_backward_func: 1F1B across the stages when --pp > 1). The tokens are random
ids made on the GPU, or (--mock-data) Megatron's mock data (MockGPTDataset) moved there a microbatch
at a time. Each rank prints `facts {JSON}`: its parameter elements, counted on its own model, and
the sizes, for the tests.
"""

import argparse
import json
import os
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

# TransformerConfig's switches for Megatron's fused kernels, off by default in megatron-core
FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
           "persist_layer_norm", "apply_rope_fusion", "cross_entropy_loss_fusion")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --experts)")
    p.add_argument("--experts", type=int, default=0, help="experts of each layer's MoE; 0: a dense MLP")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step (a pipeline's in flight)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mock-data", action="store_true", help="Megatron's MockGPTDataset, not random ids on the GPU")
    p.add_argument("--distributed-optimizer", action="store_true", help="shard Adam's state over data-parallel ranks")
    p.add_argument("--fusion", action="append", default=[], choices=FUSIONS,
                   help="a fused kernel of TransformerConfig to turn on (Megatron-LM's training turns them on)")
    return p.parse_args()


def batches(args: argparse.Namespace, device: torch.device):
    """Microbatches on the GPU, forever: random ids made there, with next-token labels and a full loss
    mask; or (--mock-data) Megatron's mock GPT data (random documents of its NullTokenizer's ids, cut
    into samples of --seq tokens) loaded on the host and moved to the GPU."""
    if not args.mock_data:
        while True:
            tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device=device)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                   "position_ids": torch.arange(args.seq, device=device).expand(args.micro_batch, -1),
                   "loss_mask": torch.ones(args.micro_batch, args.seq, device=device)}
    # imported here: the random ids need none of it (a second or two of imports a rank)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    from torch.utils.data import DataLoader

    config = GPTDatasetConfig(random_seed=1234, sequence_length=args.seq, split="1,0,0",
                              tokenizer=NullTokenizer(args.vocab - 1), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    samples = args.steps * args.microbatches * args.micro_batch
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [samples, None, None], lambda: True, config).build()
    while True:
        for batch in DataLoader(train, batch_size=args.micro_batch):
            yield {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def loss_of(loss_mask: torch.Tensor, losses: torch.Tensor):
    """The mean token loss, as Megatron's schedule wants it: (loss, its reduced form for logging)."""
    loss = (losses.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(data, model):
    """One microbatch through this rank's stage; the last stage returns the per-token losses."""
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_of, batch["loss_mask"])


def main() -> None:
    args = arguments()
    if args.experts:
        from megatron.core.transformer.moe import moe_utils

        # megatron-core 0.16.1's router reads TransformerEngine's GEMM by name even when TE is not
        # installed (a NameError, on a GPU as here): None is what its check expects then
        moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp, expert_model_parallel_size=args.ep)
    # Megatron's RNG tracker: each tensor-parallel rank initializes its own shard of the weights
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts or None,
        moe_router_topk=min(2, args.experts or 2), bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        attention_backend="local", **{name: True for name in args.fusion},
        # MoE models' linears have no bias (Mixtral's, DeepSeek's); 0.16.1's experts with a bias
        # add it in place to RowParallelLinear's output, which autograd refuses without EP or TP
        add_bias_linear=not args.experts)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.experts or None),
        vocab_size=args.vocab, max_sequence_length=args.seq,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())
    model.to(device)
    numel = sum(p.numel() for p in model.parameters())
    # as Megatron-LM's training does: its norms and position embeddings are made in fp32, and
    # Float16Module casts them, and the first stage's inputs, to bf16
    model = Float16Module(config, model)
    model = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=args.distributed_optimizer),
        module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=args.distributed_optimizer),
        [model])

    data = batches(args, device)
    forward_backward = get_forward_backward_func()
    for _ in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                         num_microbatches=args.microbatches, seq_length=args.seq,
                         micro_batch_size=args.micro_batch, forward_only=False)
        optimizer.step()

    # this rank's parameter elements, from its own model; on stdout: an emulated run's files go to its overlay
    # and the elements of Megatron's flat gradient (and parameter) buffers, padded as Megatron pads them
    buffered = sum(buffer.numel for buffer in model.buffers + model.expert_parallel_buffers)
    print("facts", json.dumps({"rank": dist.get_rank(), "numel": numel, "buffered": buffered,
                               "dp": parallel_state.get_data_parallel_world_size(),
                               "activation": [args.seq, args.micro_batch, args.hidden]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
