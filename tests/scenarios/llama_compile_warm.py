"""A compiled Llama trained with AdamW on CUDA, as a team records it once it is warm: run it under
`memdiff record --steps 1:3`, so that the weights, AdamW's moments (made by the first step), the
cuBLAS workspaces and the compiled graphs are all older than the trace (issue 60).

    memdiff record --emulate h200 --steps 1:3 -o run.pickle -- python llama_compile_warm.py FACTS

A 2-layer, 512-wide `LlamaConfig` with a 32000-token vocabulary and no biases: its attention
projections are 512 x 512 float32, 1 MiB each, a cuBLASLt workspace's size. Writes FACTS (JSON),
the model's and the optimizer's own bytes: the weights and buffers (each storage once) and the
optimizer's state tensors on the GPU (foreach AdamW keeps its step counters on the CPU).
"""

import json
import sys

import torch
import transformers as hf

torch.manual_seed(0)
model = hf.LlamaForCausalLM(hf.LlamaConfig(
    vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=512)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
compiled = torch.compile(model)
for _ in range(3):
    ids = torch.randint(0, 32000, (2, 128), device="cuda")
    compiled(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


storages = {t.untyped_storage().data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
state = [t for per in optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor)]
with open(sys.argv[1], "w") as f:
    json.dump({"weights_bytes": sum(t.untyped_storage().nbytes() for t in storages.values()),
               "state_bytes_on_device": sum(nbytes(t) for t in state if t.is_cuda),
               "tied": model.lm_head.weight is model.model.embed_tokens.weight}, f)
