"""One training step of a Llama-shaped model, written as a GPU script: built on `cuda`, bf16 weights,
AdamW, forward, backward and step. The emulator benchmark runs it under `memdiff record --emulate`.

    python benchmarks/llama_step.py --layers 32 --hidden 4096 --seq 4096   # Llama-3-8B's shape
    python benchmarks/llama_step.py --cpu      # built on the CPU in fp32, then .to(torch.bfloat16).cuda()
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=32)
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--cpu", action="store_true", help="build on the CPU, then move (as fine-tuning scripts do)")
args = p.parse_args()
config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2, num_hidden_layers=args.layers,
                     num_attention_heads=args.hidden // 128, num_key_value_heads=max(1, args.hidden // 512),
                     vocab_size=128256, max_position_embeddings=8192)
if args.cpu:
    model = LlamaForCausalLM(config).to(torch.bfloat16).cuda()
else:
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, config.vocab_size, (1, args.seq), device="cuda")
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
print(sum(p.numel() for p in model.parameters()), torch.cuda.max_memory_allocated())
