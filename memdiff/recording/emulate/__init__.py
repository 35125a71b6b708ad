"""GPU memory without a GPU: run a CUDA training script on the CPU and write the snapshot the GPU would.

`gpus` and `allocator` are plain Python (the GPUs as data, the caching allocator's model);
`runtime` imports torch and runs the script's ops on the meta device while `torch.cuda` answers
as the named GPU. docs/emulate.md says how it works, what it covers and what it refuses.
"""
