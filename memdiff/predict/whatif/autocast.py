"""`autocast=bf16|fp16`: activations and their gradients made in the forward and backward halve
(the loss excepted); a half-precision copy of the weights is made in each forward and lives
to the end of its backward (autocast's weight casts, saved for the backward), and so is the copy
of the float batch a forward's first product or convolution reads (precision.BatchReads). Where the stacks
name the ATen ops (CUDA), what autocast runs in fp32 and what its line computes after it stay
fp32 (fp32_regions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from memdiff.analyse.lifetimes import BACKWARD, FORWARD
from memdiff.predict.whatif.edit import ChangeRule, Edit, one_of
from memdiff.predict.whatif.experts import grouped_experts_backward, grouped_experts_forward
from memdiff.predict.whatif.precision import (
    PRECISIONS,
    BatchReads,
    cpu_math_attention,
    loss_note,
    loss_upcasts,
    math_note,
    not_float,
    not_float_note,
    reduction_buffers,
    reduction_note,
    slow_conv_bias_copies,
    slow_conv_note,
)
from memdiff.predict.whatif.run import (
    AUTOCAST_FP32,
    AUTOCAST_LOWER,
    AUTOCAST_SAVES_INPUT,
    MATRIX_PRODUCTS,
    SCALAR_BYTES,
    Run,
    autograd_node,
    forward_in_order,
    peak_of_set,
    python_frame,
)

# Normalisations whose output is fp32 under autocast: on CUDA's fp32 list, and on the CPU fed the
# fp32 residual stream (CPU autocast runs them in their input's dtype).
NORM_OPS = frozenset(("layer_norm", "group_norm", "rms_norm"))

# The backward ops that make the gradient of a weight autocast never casts: an embedding's (the
# lookup is on none of autocast's lists, so it reads its fp32 table), a norm's (on the fp32
# list) and a grouped product's experts' (on none: experts.py). Where the stacks name the ATen
# ops (CUDA), their weights get no half-precision copy.
UNCAST_WEIGHT_GRADS = frozenset((
    "embedding_backward", "embedding_dense_backward", "embedding_bag_backward", "_embedding_bag_backward",
    "native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward",
    "cudnn_batch_norm_backward", "_fused_rms_norm_backward", "_grouped_mm"))

# The autograd nodes that make the gradient of a weight autocast never casts, read where the stacks
# name no ATen op (the CPU route): autocast casts a weight only for an op of its lists, so not an
# embedding's table, a norm's weight, a weight scaling its input elementwise
# (`weight * x`, on no list: Llama's and T5's RMS norms; the CPU route shows their gradient as
# MulBackward0's sum), nor the experts' weights of a grouped matrix product (torch registers no
# AutocastCPU or AutocastCUDA kernel for aten::_grouped_mm).
UNCAST_WEIGHT_NODES = frozenset((
    "EmbeddingBackward0", "EmbeddingBagBackward0", "NativeLayerNormBackward0", "NativeGroupNormBackward0",
    "NativeBatchNormBackward0", "CudnnBatchNormBackward0", "FusedRmsNormBackward0", "MulBackward0",
    "GroupedMmBackward0"))

# Lookups autocast leaves alone: they read the fp32 table and give fp32 rows (by the ATen op on
# CUDA's stacks, by the built-in called on the CPU route's).
EMBEDDINGS = ("embedding", "embedding_bag", "_embedding_bag")


@dataclass
class _Fp32Regions:
    """What CUDA autocast leaves in fp32 in a run's forward (_fp32_regions)."""

    full: np.ndarray  # the forward allocations that keep their fp32 size
    casts: List[Tuple[int, int, int]]  # (start, end, size): fp32 copies of half-precision inputs, kept
    released: List[Tuple[int, int]]  # (allocation, end): half-precision inputs only such a copy kept


def _fp32_regions(run: Run) -> _Fp32Regions:
    """What CUDA autocast leaves in fp32 in the forward, from the ATen ops on the stacks.

    An op of autocast's fp32 list (`pow`, `layer_norm`) makes an fp32 result, and what the same
    line of Python computes after it from that result promotes to fp32 too (Hugging Face GPT-2's
    GELU: `0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))`: the pow, and the add, tanh and
    products after it). The line's result (its last allocation of the largest size: a layer norm's
    output, not its mean and rstd) goes on to a matrix product, which saves a half-precision copy
    of it in its place: it halves. An fp32 op that keeps its input for the
    backward (`pow`) keeps an fp32 copy of a half-precision one: the input is half precision when
    a product made it or the line computed it before the op. A product's output the op kept in the
    fp32 run is then kept by nothing: it is freed when the line ends (GPT-2's `c_fc` output)."""
    c = run.course
    out = _Fp32Regions(np.zeros(len(c.size), dtype=bool), [], [])
    full, casts = out.full, out.casts
    if not c.origins or not len(c.origin) or not (run.op != "").any():
        return out
    numbered: Dict[Tuple[Any, ...], int] = {}
    lines = [numbered.setdefault(tuple(f for f in frames if python_frame(f)), len(numbered)) for frames in c.origins]
    fwd = forward_in_order(run)
    region: List[int] = []  # the current line's allocations from its fp32 op on
    pending: List[Tuple[int, int]] = []  # (start, size) of its input copies, kept as long as the line's results
    inputs: List[int] = []  # products' outputs whose fp32 copy the line keeps
    prev = -1
    before_line = -1  # the allocation made before the current line's first

    def close(next_op: str, next_start: int) -> None:
        if region:
            end = int(c.end[region].max())
            casts.extend((start, end, size) for start, size in pending)
            out.released.extend((k, next_start) for k in inputs)
            if next_op in AUTOCAST_LOWER:
                # The line's result: its last allocation of the largest size (a layer norm's output,
                # not the mean and rstd it makes after it).
                largest = int(c.size[region].max())
                full[[k for k in region if c.size[k] == largest][-1]] = False
        region.clear()
        pending.clear()
        inputs.clear()

    for k in fwd.tolist():
        o = int(c.origin[k])
        op, line = run.op[k], lines[o]
        if region and (line != lines[int(c.origin[region[0]])] or run.born_run[k] != run.born_run[region[0]]):
            close(op, int(c.start[k]))
        if prev < 0 or lines[int(c.origin[prev])] != line:
            before_line = prev
        if op in AUTOCAST_FP32 or region:
            if op in AUTOCAST_SAVES_INPUT and prev >= 0 and not full[prev]:
                p_origin = int(c.origin[prev])
                if run.op[prev] in AUTOCAST_LOWER or lines[p_origin] == line:
                    pending.append((int(c.start[k]), int(c.size[k])))
                    # The product's output the line reads (GPT-2's c_fc output, whose fp32 copy pow keeps).
                    if before_line >= 0 and run.op[before_line] in AUTOCAST_LOWER and before_line not in inputs:
                        inputs.append(before_line)
            full[k] = True
            region.append(k)
        prev = k
    close("", c.events)
    return out


def _residual_adds(run: Run, block: np.ndarray) -> np.ndarray:
    """The forward's adds of the residual stream: allocations of the size the repeated blocks end
    with (each block's last forward allocation: `x = x + h`, or the layer norm after it) made by
    `add` where the stacks name the ATen ops, or on the profiler route, which names the built-ins
    a line calls but not its operators, by an operator of a line of Python (`residual + h`).
    Autocast keeps the residual stream in fp32: the embedding and the layer norms give fp32, and an
    add promotes to the wider of its inputs (GPT-2, a Llama and the cs336 transformer each keep
    their residual adds at fp32 size on the GPU; GPT-2 and Llama on the CPU)."""
    c = run.course
    out = np.zeros(len(c.size), dtype=bool)
    if not (block >= 0).any() or not c.origins or not len(c.origin):
        return out
    if (run.op != "").any():
        made = run.op == "add"
    else:
        operator = np.array([bool(frames) and python_frame(frames[0]) for frames in c.origins], dtype=bool)
        made = operator[c.origin]
    fwd = forward_in_order(run, block >= 0)
    # Each block run's last line, and the largest allocation on it (a layer norm's output, not the
    # mean and rstd it makes after it).
    ends: Dict[Tuple[int, int], Tuple[Any, int]] = {}
    for k in fwd.tolist():
        key, here = (int(block[k]), int(run.born_run[k])), run.line[k]
        was = ends.get(key)
        ends[key] = (here, max(int(c.size[k]), was[1]) if was is not None and was[0] == here else int(c.size[k]))
    if not ends:
        return out
    sizes, counts = np.unique([size for _, size in ends.values()], return_counts=True)
    width = int(sizes[counts.argmax()])
    return (run.phase == FORWARD) & made & (c.size == width) & ~c.before


def _shared_reads(run: Run, fp32: np.ndarray) -> List[Tuple[int, List[int]]]:
    """(an fp32 forward allocation, the products that read it) where two or more matrix products
    come straight after the line that made it: the query, key and value projections of a layer
    norm's output (the line's last allocation of its largest size: not the mean and rstd, nor an
    RMS norm's pow). Under autocast each
    product casts its fp32 input to half precision itself and keeps its own copy for the backward,
    where the fp32 run's products keep the one tensor (ViT, BERT and Llama on the CPU, the cs336
    transformer on the GPU)."""
    c = run.course
    if not fp32.any():
        return []
    fwd = forward_in_order(run).tolist()
    out = []
    i = 0
    while i < len(fwd):
        j = i + 1  # the line's allocations: fwd[i:j]
        while j < len(fwd) and run.line[fwd[j]] == run.line[fwd[i]] and run.born_run[fwd[j]] == run.born_run[fwd[i]]:
            j += 1
        made = fwd[i:j]
        largest = max(int(c.size[a]) for a in made)
        k = [a for a in made if c.size[a] == largest][-1]  # a norm's output, after its pow; before its mean
        products = []
        while j < len(fwd) and run.call[fwd[j]] in MATRIX_PRODUCTS and run.born_run[fwd[j]] == run.born_run[k]:
            products.append(fwd[j])
            j += 1
        if fp32[k] and len(products) >= 2:
            out.append((k, products))
        i = j if products else i + len(made)
    return out


def _uncast_by_node(run: Run, grads: np.ndarray) -> np.ndarray:
    """Which of the weight gradients `grads` an UNCAST_WEIGHT_NODES node made, where the stacks
    name no ATen op (the CPU route; CUDA's are read by UNCAST_WEIGHT_GRADS). A gradient summed
    from two reads of its weight (its innermost frame `aten::add`: a tied embedding, which the
    output projection reads too, a product that casts it) is not one of them."""
    c = run.course
    out = np.zeros(len(grads), dtype=bool)
    if not c.origins or not len(c.origin):
        return out
    for i, k in enumerate(grads.tolist()):
        frames = c.origins[c.origin[k]]
        out[i] = (not run.op[k] and autograd_node(frames) in UNCAST_WEIGHT_NODES
                  and frames[0].name != "aten::add")
    return out


def apply_autocast(run: Run, edit: Edit, value: str) -> None:
    """Run the forward and backward under autocast to `value` (bf16 or fp16)."""
    block = run.block
    c = run.course
    work = run.of("activation", "temporary", "recomputed_activation", "autograd") \
        & np.isin(run.phase, [FORWARD, BACKWARD]) & ~run.loss & ~run.indices & (c.size > SCALAR_BYTES)
    kept = work & not_float(run)
    staging = work & reduction_buffers(run)
    residual = _residual_adds(run, block)
    work &= ~kept & ~staging
    work &= ~residual
    looked_up = np.isin(run.call, EMBEDDINGS) & (run.phase == FORWARD)
    work &= ~looked_up
    # The experts a grouped product runs stay fp32 (experts.py), forward and backward.
    experts = grouped_experts_forward(run) | grouped_experts_backward(run)
    work &= ~experts
    regions = _fp32_regions(run)
    full, casts = regions.full, regions.casts
    math = cpu_math_attention(run)
    work &= ~full & ~math
    edit.size[work] = edit.size[work] // 2
    for start, end, size in casts:
        edit.add(start, end, size, "activation")
    for k, end in regions.released:
        edit.end[k] = min(int(edit.end[k]), end)
    logits = loss_upcasts(run)
    for start, end, size in logits:
        edit.add(start, end, size, "activation")
    convolutions = slow_conv_bias_copies(run, value)
    for start, end, size in convolutions:
        edit.add(start, end, size, "autograd")
    shared = _shared_reads(run, (residual | np.isin(run.call, list(NORM_OPS))) & (run.phase == FORWARD))
    for k, products in shared:
        # The fp32 tensor itself is then kept by nothing: each product's half-size copy is.
        edit.size[k] = c.size[k] // 2
        for _ in products[1:]:
            edit.add(int(c.start[products[0]]), int(c.end[k]), int(c.size[k]) // 2, "activation")
    # The most parameter bytes live at once: an update in place makes a new version of each every step.
    params = peak_of_set(c, np.flatnonzero(run.of("parameter")))
    grads = np.flatnonzero(run.of("gradient") & (run.phase == BACKWARD))
    uncast = np.isin(run.op[grads], list(UNCAST_WEIGHT_GRADS)) | _uncast_by_node(run, grads)
    # Weights no op casts (embeddings, norms) take no copy in a forward no backward follows either.
    params -= max((int(c.size[grads[uncast & (c.start[grads] >= s.start_event) & (c.start[grads] <= s.end_event)]]
                       .sum()) for s in run.spans if s.phase == BACKWARD), default=0)
    alone = 0  # forwards no backward follows
    batch_reads, batch_copies = BatchReads(run), 0  # the batch's casts, and how many were added
    for step in run.steps:
        # One forward per backward (a micro-batch): the forward runs before each backward run.
        first: Optional[int] = None
        last_forward_end = 0
        for p in [*step.phases, None]:
            if p is not None and p.phase == FORWARD:
                first = p.start_event if first is None else first
                last_forward_end = p.end_event
            elif p is not None and p.phase == BACKWARD and first is not None:
                # Each weight's cast is saved for its backward: freed when its gradient is made
                # (where the run made it); without gradients in the run, when the backward starts.
                within = (c.start[grads] >= p.start_event) & (c.start[grads] <= p.end_event)
                mine = grads[within]
                for g in grads[within & ~uncast].tolist():
                    edit.add(first, int(c.start[g]) + 1, int(edit.size[g]) // 2, "autocast_weights")
                if not len(mine):
                    edit.add(first, p.start_event, params // 2, "autocast_weights")
                read = batch_reads.at(first, p.start_event)
                if read is not None:
                    # The first product casts the fp32 batch and saves the copy for its weight's
                    # gradient, kept as the first layer's weight cast is: the backward makes the
                    # first layer's last.
                    edit.add(read.when, int(c.start[mine].max()) + 1 if len(mine) else p.start_event,
                             int(c.size[read.batch]) // 2, "activation")
                    batch_copies += 1
                first = None
            elif first is not None:
                # No backward follows (an evaluation, a forward measured alone): autocast still
                # caches the cast of every weight that requires grad, until the context exits,
                # which the trace shows no sooner than the forward's end.
                edit.add(first, last_forward_end + 1, params // 2, "autocast_weights")
                alone += 1
                first = None
    edit.assumptions.append(f"{value} autocast: activations of the forward and their gradients in the backward "
                            "halve (the loss stays fp32); weights, gradients and optimizer state stay fp32; each "
                            "forward casts every weight to 2 bytes, each cast kept until its weight's gradient "
                            "is made in the backward"
                            + (" (embeddings and norms excepted: autocast casts no weight of theirs)"
                               if uncast.any() else "")
                            + (f" (in the {alone} forward{'s' if alone > 1 else ''} no backward follows, "
                               "to the forward's end: autocast caches the casts until it exits)" if alone else "")
                            + (f"; the residual stream's {int(residual.sum())} adds stay fp32 (an add promotes "
                               "to its wider input)" if residual.any() else "")
                            + (f"; each of the {sum(len(p) for _, p in shared)} products that read one of "
                               f"{len(shared)} fp32 tensors (a norm's output) keeps its own half-size copy of it"
                               if shared else "")
                            + (f"; the float batch's {value} copy that each forward's first product or convolution "
                               f"makes and saves ({batch_copies} made), kept to its weight's gradient"
                               if batch_copies else "")
                            + (f"; the {int(looked_up.sum())} embedding lookups stay fp32 (autocast casts no "
                               "table)" if looked_up.any() else "")
                            + (f"; the experts' {int(experts.sum())} allocations of their grouped products stay fp32 "
                               "(grouped_mm is on no autocast list: the tokens go to the experts' fp32 weights, which "
                               "it does not cast)" if experts.any() else "")
                            + ("; where the stacks name the ATen ops (CUDA), what autocast runs in fp32 (pow, "
                               "layer_norm, ...) and what the same line computes after it stay fp32"
                               + (f", with an fp32 copy of a half-precision input the op keeps ({len(casts)} made)"
                                  if casts else "")
                               if full.any() else "") + not_float_note(kept) + reduction_note(staging)
                            + loss_note(logits) + math_note(math) + slow_conv_note(convolutions, value))


RULE = ChangeRule("autocast", one_of("autocast", PRECISIONS),
                  lambda run, edit, value: apply_autocast(run, edit, str(value)),
                  excludes=(("weights", "autocast and half-precision weights together: the weights are already in 2 "
                                        "bytes"),))
