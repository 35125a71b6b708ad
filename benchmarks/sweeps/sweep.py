"""One training step of every model of a zoo, in one process: the sweep of issue 58 (docs/emulate.md, Sweeps).

    memdiff record --emulate h100 -o /tmp/zoo.pickle -- python benchmarks/sweeps/sweep.py --zoo torchvision \
        > torchvision.jsonl

Each model is built on `cuda`, trains one step (forward, loss, backward, AdamW step,
zero_grad(set_to_none=True)) and is dropped; its exception is caught, so one process (one import of
torch and the zoo) serves the whole zoo. One JSON line per model on stdout (files the script writes
under emulation go to memdiff's overlay, not the disk), a line of progress on stderr: `ok`,
`refused` (the emulator's one-line refusal, which names the op), `skipped` (the zoo cannot make it
small) or `failed` (the exception's first line and its innermost frame), with the model's facts and
what torch.cuda's allocator says around the step. The facts are checked: after the step the
allocator holds at least the weights and AdamW's two states (exp_avg and exp_avg_sq, each the bytes
of the parameters that got a gradient), and once the model and optimizer are dropped it holds what
it held before the model was built (cuBLAS's workspaces, which a GPU keeps for the process's life,
are made by a warm-up step before the first model). `--device meta` runs the same steps in torch
alone, without memdiff, to tell a failure of the emulator from one of the model at this config.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional

from case import Case, Skip


def _zoo(name: str) -> Iterator[Case]:
    if name == "torchvision":
        import zoo_torchvision
        return zoo_torchvision.cases()
    if name == "transformers":
        import zoo_transformers
        return zoo_transformers.cases()
    if name == "timm":
        import zoo_timm
        return zoo_timm.cases()
    raise SystemExit(f"sweep.py: unknown zoo {name!r} (torchvision, transformers, timm)")


def _refusal_type() -> Optional[type]:
    """memdiff's refusal under emulation (exit 2 when uncaught); None when memdiff is not installed."""
    try:
        from memdiff.recording.emulate.runtime import EmulationError
    except ImportError:
        return None
    return EmulationError


def _where(exc: BaseException) -> str:
    """The innermost frame of the exception, as file:line (the file from its package folder on)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    path = last.filename.replace("\\", "/")
    for root in ("/site-packages/", "/memdiff/", "/benchmarks/"):
        if root in path:
            path = path.split(root, 1)[1]
            break
    return f"{path}:{last.lineno} {last.name}"


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _train(case: Case, torch: Any, device: str, record: Dict[str, Any], before: int) -> None:
    """Build `case`, train it one step and fill `record`; the model and optimizer are this function's
    locals, so that they go when it returns or raises."""
    with torch.device(device):  # the model and the batch the zoo makes
        model = case.build()
        model.to(device)  # buffers a builder made on the host from numpy or lists
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        record["weights_bytes"] = _nbytes(list(model.parameters()) + list(model.buffers()))
        record["trainable_bytes"] = _nbytes(trainable)
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        loss = case.loss(model)
        loss.backward()
        del loss
        # AdamW keeps state only for the parameters the loss reached (a gradient); unused ones have none
        record["stepped_bytes"] = _nbytes(p for p in trainable if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device == "cuda":  # the weights and the optimizer's state, still held
        record["allocated_after_step"] = torch.cuda.memory_allocated() - before


def step(case: Case, torch: Any, device: str = "cuda") -> Dict[str, Any]:
    """One training step of `case` on `device`; the record of one JSON line. On "meta" (no emulation,
    no allocator: the triage of a failure, docs/emulate.md) the record has no memory figures."""
    record: Dict[str, Any] = {"name": case.name}
    on_gpu = device == "cuda"
    gc.collect()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    start = time.process_time()
    try:
        _train(case, torch, device, record, before)
        if on_gpu:
            record["peak"] = torch.cuda.max_memory_allocated() - before
        record["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 (each model's failure is a result of the sweep)
        refusal = _refusal_type()
        record["status"] = "skipped" if isinstance(exc, Skip) else \
            "refused" if refusal is not None and isinstance(exc, refusal) else "failed"
        record["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
        record["where"] = _where(exc)
        traceback.clear_frames(exc.__traceback__)  # the failed step's frames hold the model
        del exc
    gc.collect()
    if on_gpu:
        record["left_after_drop"] = torch.cuda.memory_allocated() - before
    record["cpu_s"] = round(time.process_time() - start, 2)
    return record


def problems(record: Dict[str, Any]) -> List[str]:
    """The facts a finished step breaks (empty when it holds them all)."""
    out = []
    if record["status"] == "ok" and "peak" in record:
        held = record["weights_bytes"] + 2 * record["stepped_bytes"]
        if record["allocated_after_step"] < held:
            out.append(f"after the step the allocator holds {record['allocated_after_step']} B, under the weights "
                       f"and AdamW's states ({held} B)")
        if record["peak"] < record["allocated_after_step"]:
            out.append("the peak is under what is held")
        if record["left_after_drop"] != 0:
            out.append(f"{record['left_after_drop']} B still allocated once the model is dropped")
    return out


def warm_up(torch: Any) -> None:
    """A small product forward and backward: cuBLAS's workspaces (one per handle, the backward's thread
    has its own) are made once and kept, on a GPU as under emulation, and belong to no model."""
    layer = torch.nn.Linear(8, 8, device="cuda")
    layer(torch.randn(4, 8, device="cuda")).sum().backward()
    del layer
    gc.collect()


def main(argv: Optional[List[str]] = None) -> int:
    """Run the zoo's steps and write one JSON line per model; exit 1 when a fact check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", required=True, choices=["torchvision", "transformers", "timm"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "meta"],
                        help="cuda (under memdiff record --emulate, or a GPU); meta: torch alone, to triage a failure")
    parser.add_argument("--only", default="", help="comma-separated model names (default: the whole zoo)")
    args = parser.parse_args(argv)
    import torch

    only = {n for n in args.only.split(",") if n}
    broken = 0
    if args.device == "cuda":
        warm_up(torch)
    for case in _zoo(args.zoo):
        if only and case.name not in only:
            continue
        record = step(case, torch, args.device)
        record["problems"] = problems(record)
        broken += bool(record["problems"])
        print(json.dumps(record), flush=True)
        print(record["status"], case.name, record.get("error", ""), *record["problems"], file=sys.stderr, flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
