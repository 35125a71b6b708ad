"""Recording: how a snapshot comes to be, before memdiff reads it.

`capture` records a block of PyTorch code in-process (CUDA, CPU, or an emulated GPU);
`rank_hook` records every rank of a launched job and `manifest` says what became of each;
`integrations` are the Hugging Face Trainer and Lightning callbacks; `emulate` runs CUDA code
with no GPU and writes the snapshot the named GPU would. The analysis
(load -> normalize -> ... -> render) reads what this package writes: snapshots, and a job's manifest
(`job.py` reads it with `manifest.read_manifest`).
"""
