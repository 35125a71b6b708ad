"""A training script for the 1B Llama of ../shared/cuda-truth/families.py (`llama1b-bf16`: the same
LlamaConfig, bf16 weights, AdamW), taking its micro-batch as a flag: what `memdiff fit` searches in
benchmarks/fit_llama1b.py.

    python benchmarks/llama1b_train.py --batch 2 --seq 2048 --steps 2
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                     tie_word_embeddings=True)
model = LlamaForCausalLM(config).to("cuda").to(torch.bfloat16)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"trained {args.steps} steps at batch {args.batch}, sequence {args.seq}")
