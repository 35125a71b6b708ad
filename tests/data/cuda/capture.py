"""Capture this folder's CUDA snapshots on one GPU (see README.md); run from the repository root:

    python tests/data/cuda/capture.py OUTDIR [RUN ...]

GPT-2 from the library's default config (124M weights), batch 4, seq 512, three AdamW steps,
recorded by `memdiff.recording.capture.record` (the caching allocator's history with C++ stacks), with
and without the changes teams make to a loop; and a torchrun job of two ranks recorded by
`memdiff record -o DIR/`. Every file is gzipped.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GPT2 = ["--model", "gpt2", "--config", "full", "--vocab", "50257", "--positions", "1024", "--batch", "4",
        "--seq", "512", "--device", "cuda"]
RUNS = {
    "gpt2-base": [],
    "gpt2-base-again": [],  # the same run twice: a diff of the two must read as no change
    "gpt2-keep-grads": ["--keep-grads"],  # zero_grad(set_to_none=False)
    "gpt2-ema": ["--ema"],
    "gpt2-clip": ["--clip"],
    "gpt2-retain-graph": ["--retain-graph"],
    "gpt2-adagrad": ["--optimizer", "adagrad"],  # state made in the constructor
    "gpt2-warm": ["--warmup", "1"],  # recording starts after a warm-up step: AdamW's state is older
    "gpt2-autocast": ["--autocast"],
    "gpt2-batch8": ["--batch", "8"],
    "gpt2-checkpoint": ["--checkpoint"],
    "gpt2-log-tensor": ["--log-loss", "tensor"],  # a validation loss kept with its graph: a leak
    "gpt2-keep-weights": ["--keep-weights"],  # weight copies kept between backward() and step(): a leak
    "gpt2-fused": ["--optimizer", "adamw-fused"],
    "gpt2-generate": ["--generate"],
    # What-if heads (memdiff whatif's changes really made, to pair with gpt2-base):
    "gpt2-bf16": ["--bf16"],  # weights=bf16
    "gpt2-fp16": ["--fp16"],  # weights=fp16
    "gpt2-sgd": ["--optimizer", "sgd"],
    "gpt2-sgd-momentum": ["--optimizer", "sgd-momentum"],
    "gpt2-amsgrad": ["--optimizer", "adamw-amsgrad"],
    "gpt2-rmsprop": ["--optimizer", "rmsprop"],
    "gpt2-adafactor": ["--optimizer", "adafactor"],
    "gpt2-accum2": ["--batch", "2", "--accum", "2"],  # accumulate=2: two micro-batches of half the batch
    "gpt2-checkpoint-half": ["--checkpoint-fraction", "0.5"],  # checkpoint=0.5: every other block
    "gpt2-compile": ["--compile"],  # torch.compile (Inductor), compiled by a forward and backward before recording
    "gpt2-oom": ["--batch", "512"],  # out of memory in the first forward: the snapshot is written all the same
}
FAILS = {"gpt2-oom"}


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TRANSFORMERS_VERBOSITY": "error"}

    def run(name: str) -> str:
        done = subprocess.run([sys.executable, str(ROOT / "tests/scenarios/train.py"), *GPT2, *RUNS[name],
                               "--out", str(out / f"{name}.pickle")], env=env, capture_output=True, text=True)
        if (done.returncode != 0) == (name in FAILS):
            return ""
        return f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}"

    chosen = sys.argv[2:]  # some runs only; by default every run and the job
    names = chosen or list(RUNS)
    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [f for f in pool.map(run, [n for n in names if n not in FAILS]) if f]
    # Alone: a run that fills the GPU would starve the others.
    failed += [f for f in map(run, [n for n in names if n in FAILS]) if f]
    print("\n".join(failed), file=sys.stderr)
    ranks = out / "ddp"
    if not chosen:
        subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", f"{ranks}/", "--", "torchrun",
                        "--nproc-per-node", "2", str(HERE / "ddp_gpt2.py")], env=env, check=True, cwd=out)
    for path in [*out.glob("*.pickle"), *ranks.glob("*.pickle")]:  # memdiff reads them gzipped
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
    manifest = ranks / "memdiff-job.json"
    if manifest.exists():  # the job's record names the files as they are now
        job = json.loads(manifest.read_text())
        for rank in job["ranks"]:
            rank["file"] += ".gz"
        manifest.write_text(json.dumps(job, indent=1) + "\n")


if __name__ == "__main__":
    main()
