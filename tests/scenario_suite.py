"""The scenario suite: models other people wrote, trained with the changes teams make, captured on CPU.

Each scenario is a model and the flags of tests/scenarios/train.py. Captures run in two
processes, one per core, each importing torch and transformers once (record_jobs), and are
kept for the session. Ground truth comes from PyTorch, never from memdiff: the `category` the
profiler route writes on every allocation, and the step and phase each trace entry happened
in, from record_function scopes the script opens (`--truth`).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

TRAIN = Path(__file__).resolve().parent / "scenarios" / "train.py"
DONE = "scenario-suite: recorded"  # train.py's answer to each run of `--jobs -`

# name: (model, flags). `base` runs also write ground truth.
BASES = {f"{m}-base": (m, ["--truth"]) for m in ("gpt2", "bert", "llama", "mlp", "cnn")}
CHANGES = {
    # The optimizer step holds the peak: parameters, gradients and AdamW state all live.
    "mlp-small-batch": ("mlp", ["--batch", "1", "--truth"]),
    "bert-frozen": ("bert", ["--freeze", "--truth"]),
    # Issue 42 item 9: frozen layers and Hugging Face gradient checkpointing: the recomputation in the
    # backward is autograd to PyTorch's data flow, made by forward code.
    "bert-frozen-checkpoint": ("bert", ["--freeze", "--checkpoint", "--truth"]),
    # Issue 60: the whole body frozen (embeddings, every layer, the pooler), only the classifier trained:
    # frozen layers save nothing for the backward, so their forward outputs are freed by the next layer.
    "bert-frozen-encoder": ("bert", ["--freeze-encoder", "--truth"]),
}
FAMILIES = ("gpt2", "bert", "llama")
for _m in FAMILIES:
    CHANGES.update({
        f"{_m}-batch2x": (_m, ["--batch", "8"]),
        f"{_m}-autocast": (_m, ["--autocast"]),
        f"{_m}-sgd": (_m, ["--optimizer", "sgd-momentum"]),
        f"{_m}-checkpoint": (_m, ["--checkpoint"]),
        f"{_m}-debug": (_m, ["--debug-projections"]),
        f"{_m}-accum": (_m, ["--accum", "2"]),
        f"{_m}-log-item": (_m, ["--log-loss", "item"]),
        f"{_m}-log-tensor": (_m, ["--log-loss", "tensor"]),
        f"{_m}-eval-no-grad": (_m, ["--eval", "no-grad"]),
        f"{_m}-eval-grad": (_m, ["--eval", "grad"]),
    })
# Issue 26: six more families (an encoder-decoder, a mixture of experts, a vision model, a
# recurrent one, GPT-NeoX, DistilBERT) with ground truth, and the loops at the edges.
NEW_FAMILIES = ("t5", "mixtral", "neox", "distilbert", "vit", "lstm")
EDGE_BASES = {f"{m}-base": (m, ["--truth"]) for m in NEW_FAMILIES}
EDGES = {
    # Optimizer state older than the trace: made in the constructor, or in a warm-up step.
    "mlp-adagrad": ("mlp", ["--optimizer", "adagrad"]),
    "t5-adagrad": ("t5", ["--optimizer", "adagrad"]),
    "mlp-amsgrad-warm": ("mlp", ["--optimizer", "adamw-amsgrad", "--warmup", "1", "--truth"]),
    "mixtral-warm": ("mixtral", ["--warmup", "1", "--truth"]),
    "t5-fused-warm": ("t5", ["--optimizer", "adamw-fused", "--warmup", "1"]),
    # A leak made between backward() and step().
    "lstm-keep-weights": ("lstm", ["--keep-weights"]),
    # zero_grad between forward and backward, with and without set_to_none.
    "gpt2-zero-grad-mid": ("gpt2", ["--zero-grad", "before-backward", "--keep-loss", "--truth"]),
    "gpt2-zero-grad-mid-keep": ("gpt2", ["--zero-grad", "before-backward", "--keep-grads", "--keep-loss", "--truth"]),
    # set_to_none=False on a model that peaks in its optimizer step: the peak holds, the forward grows.
    "mlp-keep-grads": ("mlp", ["--keep-grads"]),
    # A model and optimizer that live only inside a test: one step.
    "mlp-inside": ("mlp", ["--inside", "--steps", "1", "--truth"]),
    # Other loops teams run.
    "vit-bf16": ("vit", ["--bf16"]),
    "distilbert-ema": ("distilbert", ["--ema"]),
    "t5-ema-before": ("t5", ["--ema-before"]),
    "neox-clip": ("neox", ["--clip"]),
    "neox-fused": ("neox", ["--optimizer", "adamw-fused"]),
    "mixtral-foreach": ("mixtral", ["--optimizer", "adamw-foreach"]),
    "lstm-retain-graph": ("lstm", ["--retain-graph"]),
    "t5-zero-grad-first-keep": ("t5", ["--zero-grad", "first", "--keep-grads"]),
    "gpt2-generate": ("gpt2", ["--generate"]),
}
# Issue 32: the same model compiled by torch.compile (Inductor on CPU) at two sequence lengths:
# memdiff's example GPT, one layer, two steps, so that compiling stays quick.
COMPILED = {
    "gpt-compile": ("gpt", ["--compile", "--steps", "2", "--seq", "64"]),
    "gpt-compile-seq128": ("gpt", ["--compile", "--steps", "2", "--seq", "128"]),
    # Issue 42: Llama at two sequence lengths whose backward graphs allocate differently (Inductor
    # reuses a freed buffer at one length and not the other, and allocates in another order), with
    # a small vocabulary so that the backward's peak holds many of its buffers.
    "llama-compile-seq32": ("llama", ["--compile", "--steps", "2", "--seq", "32", "--vocab", "64"]),
    "llama-compile-seq64": ("llama", ["--compile", "--steps", "2", "--seq", "64", "--vocab", "64"]),
}
# Issue 37: repeats of one loop whose memory depends on the data (each batch its own sequence
# length, drawn with a different seed per run, as data order differs between runs): a real spread.
REPEATS = {f"gpt2-repeat-{k}": ("gpt2", ["--lengths-seed", str(k)]) for k in (1, 2, 3)}
# Issue 34: memdiff whatif's pairs. The base is a run of the suite; the head is the same loop with
# the change really made. The plain torch models run wider batches, so that their activations and
# not their optimizer step hold the peak.
WHATIF_BASES = {"mlp-wide": ("mlp", ["--batch", "256", "--steps", "2"]),
                "cnn-wide": ("cnn", ["--batch", "32", "--steps", "2"]),
                # torch.nn.TransformerEncoder's layers, called one by one (issue 42 item 4).
                "tenc-base": ("tenc", []),
                # Issue 60: Qwen2 (Llama's layout, biased query, key and value projections, tied head).
                "qwen2-base": ("qwen2", [])}
WHATIF_HEADS: Dict[str, Tuple[str, List[str]]] = {}
# (base, change, head): heads named <base>-wi-<slug> are captured here; others are the suite's own.
WHATIF_PAIRS: List[Tuple[str, str, str]] = []


def _whatif_pair(base: str, change: str, flags: Optional[List[str]] = None, head: Optional[str] = None) -> None:
    model, base_flags = SCENARIOS_SO_FAR[base] if base in SCENARIOS_SO_FAR else WHATIF_BASES[base]
    if head is None:
        head = f"{base}-wi-{re.sub(r'[^a-z0-9]+', '-', change)}"
        kept = [f for f in base_flags if f != "--truth"]
        if "--accum" in (flags or []):  # K micro-batches of 1/K the batch
            batch = int(kept[kept.index("--batch") + 1]) if "--batch" in kept else 4
            k = int(flags[flags.index("--accum") + 1]) if flags else 1
            kept = [f for i, f in enumerate(kept) if f != "--batch" and (i == 0 or kept[i - 1] != "--batch")]
            kept += ["--batch", str(batch // k)]
        WHATIF_HEADS[head] = (model, kept + list(flags or []))
    WHATIF_PAIRS.append((base, change, head))


SCENARIOS_SO_FAR: Dict[str, Tuple[str, List[str]]] = {**BASES, **CHANGES, **EDGE_BASES, **EDGES, **COMPILED, **REPEATS}
for _base in ("gpt2-base", "llama-base"):
    _m = _base.split("-")[0]
    _whatif_pair(_base, "checkpoint", head=f"{_m}-checkpoint")
    _whatif_pair(_base, "checkpoint=0.5", ["--checkpoint-fraction", "0.5"])
    _whatif_pair(_base, "weights=bf16", ["--bf16"])
    _whatif_pair(_base, "autocast=bf16", head=f"{_m}-autocast")
    _whatif_pair(_base, "optimizer=sgd-momentum", head=f"{_m}-sgd")
    _whatif_pair(_base, "optimizer=adafactor", ["--optimizer", "adafactor"])
    _whatif_pair(_base, "accumulate=2", ["--accum", "2"])
for _change, _flags in (("weights=fp16", ["--fp16"]), ("optimizer=sgd", ["--optimizer", "sgd"]),
                        ("optimizer=adagrad", ["--optimizer", "adagrad"]),
                        ("optimizer=adamw-amsgrad", ["--optimizer", "adamw-amsgrad"]),
                        ("optimizer=rmsprop", ["--optimizer", "rmsprop"]), ("zero-grad=zeros", ["--keep-grads"])):
    _whatif_pair("gpt2-base", _change, _flags)
for _base in ("mlp-wide", "cnn-wide"):
    for _change, _flags in (("checkpoint", ["--checkpoint"]), ("weights=bf16", ["--bf16"]),
                            ("autocast=bf16", ["--autocast"]), ("accumulate=2", ["--accum", "2"])):
        _whatif_pair(_base, _change, _flags)
_whatif_pair("mlp-wide", "optimizer=sgd-momentum", ["--optimizer", "sgd-momentum"])
# Issue 42 item 4: an encoder-decoder repeats two stacks and its layers inside them (the layers are
# what checkpointing wraps), and torch.nn.TransformerEncoder checkpointed in part.
for _base in ("t5-base", "tenc-base"):
    _whatif_pair(_base, "checkpoint", ["--checkpoint"])
    _whatif_pair(_base, "checkpoint=0.5", ["--checkpoint-fraction", "0.5"])
_whatif_pair("mlp-wide", "zero-grad=zeros", ["--keep-grads"])
# Issue 42 item 3: autocast on families it was not tuned to: a ViT (its layer norms' output read by
# the query, key and value projections, each keeping its own bf16 copy) and a mixture of experts.
for _base in ("vit-base", "mixtral-base"):
    _whatif_pair(_base, "autocast=bf16", ["--autocast"])
_whatif_pair("qwen2-base", "weights=bf16", ["--bf16"])
# Issue 42 item 4: T5 with bf16 weights, whose forward and backward peaks are 1% apart (compared
# phase by phase in test_whatif, not as a pair).
WHATIF_HEADS["t5-bf16"] = ("t5", ["--bf16"])
# A regression bought back (`--whatif`): the batch doubled, then checkpointed or accumulated in two
# micro-batches of the old batch, as the report suggests.
_whatif_pair("gpt2-batch2x", "checkpoint", ["--checkpoint"])
_whatif_pair("gpt2-batch2x", "accumulate=2", ["--accum", "2"])
# The other way: a run that keeps its gradients, and the one that frees them; SGD with momentum,
# and Adam or AdamW in its place.
WHATIF_PAIRS.append(("gpt2-base-wi-zero-grad-zeros", "zero-grad=none", "gpt2-base"))
WHATIF_PAIRS.append(("gpt2-sgd", "optimizer=adamw", "gpt2-base"))
WHATIF_HEADS["gpt2-sgd-wi-optimizer-adam"] = ("gpt2", ["--optimizer", "adam"])
WHATIF_PAIRS.append(("gpt2-sgd", "optimizer=adam", "gpt2-sgd-wi-optimizer-adam"))
WHATIF_PAIRS.append(("mlp-wide-wi-zero-grad-zeros", "zero-grad=none", "mlp-wide"))

# Issue 32: the loops teams write, on families already captured (and ConvNeXt and BART, new).
LOOPS = {
    # A validation loop of 4 batches after the steps, in torch.no_grad() and without it.
    "gpt2-val": ("gpt2", ["--val-batches", "4", "--truth"]),
    "gpt2-val-grad": ("gpt2", ["--val-batches", "4", "--val-grad", "--truth"]),
    # The training losses summed as tensors after backward(): their graphs are freed.
    "gpt2-sum-loss": ("gpt2", ["--sum-loss"]),
    # Plain SGD, to compare with gpt2-sgd (SGD with momentum).
    "gpt2-sgd-plain": ("gpt2", ["--optimizer", "sgd"]),
    # A frozen model with LoRA adapters of rank 8 on the nn.Linear of its layers.
    "bert-lora": ("bert", ["--lora", "8"]),
    # An EMA made before recording with torch.optim.swa_utils.AveragedModel.
    "convnext-base": ("convnext", []),
    "convnext-ema-averaged": ("convnext", ["--ema-averaged"]),
    # zero_grad(set_to_none=False): the gradients live through the next forward.
    "distilbert-keep-grads": ("distilbert", ["--keep-grads", "--truth"]),
    "bart-base": ("bart", ["--truth"]),
    "bart-keep-grads": ("bart", ["--keep-grads", "--truth"]),
    # Issue 42 item 8, as a reviewer tries it: recorded after a warm-up step, so the kept gradients
    # are older than the trace (the backward accumulates into them in place).
    "bart-warm": ("bart", ["--warmup", "1", "--truth"]),
    "bart-keep-grads-warm": ("bart", ["--warmup", "1", "--keep-grads", "--truth"]),
    # Issue 42: AdamW's foreach update (_multi_tensor_adam's _foreach_sqrt), with ground truth.
    "gpt2-foreach": ("gpt2", ["--optimizer", "adamw-foreach", "--truth"]),
}
# Issue 42: plain SGD's update allocates nothing (in place); its step shows by the weights' new versions.
WHATIF_PAIRS.append(("gpt2-sgd-plain", "optimizer=sgd-momentum", "gpt2-sgd"))
# Issue 60: zero_grad(set_to_none=False) on an encoder-decoder whose embedding is tied to its output
# projection (its gradient is a first sum the backward replaces).
WHATIF_PAIRS.append(("bart-base", "zero-grad=zeros", "bart-keep-grads"))
SCENARIOS: Dict[str, Tuple[str, List[str]]] = {**SCENARIOS_SO_FAR, **WHATIF_BASES, **WHATIF_HEADS, **LOOPS}

# memdiff's built-in categories that split one of PyTorch's data-flow categories (its profiler's
# `category`) by what made the memory: activation checkpointing's recomputation is forward code run
# for the backward, autograd to PyTorch (docs/categories.md, "Measured against PyTorch's categories").
PYTORCH_CATEGORY = {"recomputed_activation": "autograd"}
# PyTorch's data-flow categories in memdiff's terms: its `temporary` (what one op allocates and frees
# before it returns) is memdiff's own, in every phase (issue 60).
PYTORCH_TO_MEMDIFF = {"autograd_detail": "autograd", "unknown": "other", None: "other"}


def capture(names: Sequence[str], folder: Path) -> Dict[str, Path]:
    """Capture the named scenarios into `folder` (skipping those already there); name -> snapshot."""
    paths = {name: folder / f"{name}.pickle" for name in names}
    todo: Dict[str, List[List[str]]] = {}
    for name in names:
        if paths[name].exists():
            continue
        model, flags = SCENARIOS[name]
        argv = ["--model", model, "--out", str(paths[name])]
        for flag in flags:
            argv += [flag, str(folder / f"{name}.truth.json")] if flag == "--truth" else [flag]
        todo.setdefault(model, []).append(argv)

    record_jobs(todo, folder)
    return paths


def record_jobs(todo: Dict[str, List[List[str]]], folder: Path) -> None:
    """Record each of train.py's argument lists in `todo` (model -> its runs), logging into `folder`.

    Two processes, one per core, each record family after family as they take them from a queue
    (the families with the most runs first, so that the last to finish is a short one and neither
    core idles at the end behind a long family). Each process pays for importing torch,
    transformers and Dynamo once, not once per family: a run records the same in either (all 123
    runs' peaks, categories, traces and ground truth compared equal)."""
    families: "queue.Queue[str]" = queue.Queue()
    for model in sorted(todo, key=lambda model: -len(todo[model])):
        families.put(model)

    def worker(number: int) -> None:
        with open(folder / f"capture-{number}.log", "w+") as log:
            process = subprocess.Popen([sys.executable, str(TRAIN), "--jobs", "-"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, text=True,
                                       env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            assert process.stdin is not None and process.stdout is not None
            try:
                while True:
                    try:
                        model = families.get_nowait()
                    except queue.Empty:
                        break
                    for argv in todo[model]:
                        try:
                            process.stdin.write(json.dumps(argv) + "\n")
                            process.stdin.flush()
                        except BrokenPipeError:
                            raise RuntimeError(_failed(model, argv, process, log)) from None
                        # what the run prints is read up to its DONE line; none before the end is a failure
                        if not any(line.startswith(DONE) for line in iter(process.stdout.readline, "")):
                            raise RuntimeError(_failed(model, argv, process, log))
            finally:
                process.stdin.close()
                process.wait()

    if todo:
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(worker, range(min(2, len(todo)))))


def _failed(model: str, argv: List[str], process: "subprocess.Popen[str]", log: Any) -> str:
    """What a capture process that ended before recording `argv` said (the end of its stderr)."""
    process.wait()
    log.seek(0)
    return f"capturing {model} ({' '.join(argv)}) failed, exit {process.returncode}:\n{log.read()[-3000:]}"


def truth_of(snapshot: Path) -> List[Tuple[Optional[int], Optional[str]]]:
    """(step, phase) of every trace entry, from the run's record_function scopes."""
    rows = json.loads(snapshot.with_suffix(".truth.json").read_text())["entries"]
    return [(step, phase) for step, phase in rows]


# Where PyTorch's label is arguable, memdiff documents its own (docs/categories.md): update
# temporaries of built-in optimizers (PyTorch: temporary, unknown, activation, parameter or input) are
# `optimizer_temporary`;
# Hugging Face cache tensors (PyTorch: input) are `activation`, made by the forward.
ARGUABLE = ((re.compile(r"torch/optim/\w+\.py\(\d+\): _(single_tensor|multi_tensor|fused)_"), "optimizer_temporary"),
            (re.compile(r"transformers/cache_utils\.py"), "activation"))


def documented_label(e: Dict[str, Any]) -> Optional[str]:
    """memdiff's documented label for an allocation whose PyTorch label is arguable, else None."""
    for frame in e.get("frames") or []:
        for pattern, label in ARGUABLE:
            if pattern.search(frame.get("name", "")):
                return label
    return None


def pytorch_categories_at(trace: List[Dict[str, Any]], event: int, documented: bool = False) -> Counter:
    """Bytes per PyTorch category (in memdiff's terms) of the in-trace memory live after `event`;
    with `documented`, arguable labels are replaced by the ones memdiff documents.

    In-trace memory is what the trace shows an allocation for: allocations still open, and
    tensors made before recording that the trace later writes a new version of (the free is
    followed by the version's allocation, which carries PyTorch's category). Memory the
    trace never mentions has no category from PyTorch and is left out.
    """
    open_: Dict[int, Dict[str, Any]] = {}
    live: Dict[int, Dict[str, Any]] = {}
    totals: Counter = Counter()
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            open_[e["addr"]] = e
        elif e["action"] == "free_completed":
            known = open_.pop(e["addr"], None)
            if known is None and i > event:
                after = trace[i + 1] if i + 1 < len(trace) else {}
                if after.get("action") == "alloc" and after.get("addr") == e["addr"]:
                    totals[PYTORCH_TO_MEMDIFF.get(after.get("category"), after.get("category"))] += e["size"]
        if i == event:
            live = dict(open_)
    for e in live.values():
        label = PYTORCH_TO_MEMDIFF.get(e.get("category"), e.get("category"))
        totals[(documented and documented_label(e)) or label] += e["size"]
    return totals


def whatif_rows(paths: Dict[str, Path]) -> List[Dict[str, Any]]:
    """Each of WHATIF_PAIRS predicted by memdiff whatif from its base, against its head as measured
    (the head's own peak and phase, read by memdiff's summary of the head's capture)."""
    from memdiff.api import summarize, whatif

    rows = []
    for base, change, head in WHATIF_PAIRS:
        predicted = whatif(paths[base], change).devices[0].changes[0]
        measured = summarize(paths[head]).devices[0]
        base_peak = summarize(paths[base]).devices[0].peak_bytes
        error = (None if predicted.predicted_peak_bytes is None
                 else 100.0 * (predicted.predicted_peak_bytes - measured.peak_bytes) / measured.peak_bytes)
        rows.append({"base": base, "change": change, "head": head, "base_peak": base_peak,
                     "predicted": predicted.predicted_peak_bytes, "predicted_phase": predicted.predicted_peak_phase,
                     "measured": measured.peak_bytes, "measured_phase": measured.phase_at_peak, "error_pct": error,
                     "reason": predicted.reason})
    return rows


def facts(runs: Dict[str, Path], name: str) -> Dict[str, Any]:
    """What train.py wrote beside a capture (RUN.pickle.facts.json): facts from the model and optimizer."""
    return json.loads(Path(str(runs[name]) + ".facts.json").read_text())


def summaries_of(runs: Dict[str, Path]) -> Dict[str, Any]:
    """Each capture's Summary, classified by the shipped rules."""
    from memdiff.analyse.classify import load_rules
    from memdiff.read.inputs import read_summary

    rules = load_rules()
    return {name: read_summary(str(path), rules) for name, path in runs.items()}
