"""What keeps its size when the model's precision changes, shared by the weights and autocast
rules: the loss (upcast to fp32 by the libraries), integer and bool results, the upcasts of
variance and loss computations, the CPU's math attention.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from memdiff.analyse.lifetimes import BACKWARD
from memdiff.model import Frame
from memdiff.predict.whatif.run import (
    ATEN_OP,
    MATRIX_PRODUCTS,
    NOT_FLOAT_OPS,
    Run,
    autograd_node,
    forward_in_order,
    python_frame,
)
from memdiff.read.source import source_line
from memdiff.recording.emulate.gpus import kernels
from memdiff.recording.emulate.reductions import arg_size, kernel

PRECISIONS = ("bf16", "fp16")


# CPU attention on the profiler route: the call's frame, and what CPU flash attention allocates in it.
SDPA_CALL = "<built-in function scaled_dot_product_attention>"


FLASH_CPU_ALLOCATIONS = 2


def cpu_math_attention(run: Run) -> np.ndarray:
    """The forward allocations of CPU `scaled_dot_product_attention` calls that ran PyTorch's math
    backend: it computes half-precision inputs in fp32 ("keep query, key, value in high precision",
    unless `allow_fp16_bf16_reduction_math_sdp(True)`), so they keep their size in half precision.
    The profiler route names the call (`<built-in function scaled_dot_product_attention>`); the math
    backend makes the scores, softmax, dropout mask and products inside it (GPT-2 with attention
    dropout: 22 allocations a call), where CPU flash attention makes its output and logsumexp (2)."""
    c = run.course
    out = np.zeros(len(c.size), dtype=bool)
    if not c.origins or not len(c.origin):
        return out
    inside = np.array([bool(frames) and frames[0].name.startswith(SDPA_CALL) for frames in c.origins], dtype=bool)
    if not inside.any():
        return out
    fwd = forward_in_order(run)
    call: List[int] = []
    for k in [*fwd.tolist(), -1]:
        if k >= 0 and inside[c.origin[k]]:
            call.append(k)
            continue
        if len(call) > FLASH_CPU_ALLOCATIONS:
            out[call] = True
        call = []
    return out


def math_note(math: np.ndarray) -> str:
    """The assumption said when CPU math attention keeps its size (cpu_math_attention)."""
    if not math.any():
        return ""
    return (f"; CPU attention's math backend computes in fp32: the {int(math.sum())} allocations of its calls in "
            "the forward keep their size")


def not_float(run: Run) -> np.ndarray:
    """The allocations an op of NOT_FLOAT_OPS made (a mask, indices), and CUDA dropout's masks
    (dropout_masks): their size is not the model's dtype's."""
    return np.isin(run.op, list(NOT_FLOAT_OPS)) | dropout_masks(run)


# CUDA's dropout (`native_dropout`) returns its output and a bool mask of one byte an element,
# a quarter of an fp32 output. (The CPU's keeps its mask in the input's dtype.)
DROPOUT_OPS = frozenset(("dropout", "native_dropout"))


def dropout_masks(run: Run) -> np.ndarray:
    """The bool masks CUDA dropout keeps for its backward, where the stacks name the op: of the two
    allocations one dropout makes, the one a quarter the size of the other (fp32)."""
    out = np.zeros(len(run.course.size), dtype=bool)
    made = np.isin(run.op, list(DROPOUT_OPS))
    if not made.any():
        return out
    size = run.course.size
    fwd = forward_in_order(run, made).tolist()
    for a, b in zip(fwd[:-1], fwd[1:]):
        if run.line[a] != run.line[b] or run.born_run[a] != run.born_run[b]:
            continue
        if 4 * size[a] == size[b]:
            out[a] = True
        elif 4 * size[b] == size[a]:
            out[b] = True
    return out


def reduction_buffers(run: Run) -> np.ndarray:
    """The staging buffers and semaphores CUDA's reduction kernel takes beyond an op's result (a
    bias gradient's sum over 6,304 rows: 38.9 MB of staging for 768 sums), where the stacks name a
    reduction of the emulator's table (kernels.json `reductions`): the allocations after the op's
    first, with its stack, freed before it. They hold the accumulator, whose width the emulator's
    arg_size gives: fp32 for fp32, bf16 and fp16 inputs alike, so they keep their size."""
    c = run.course
    out = np.zeros(len(c.size), dtype=bool)
    if not c.origins or not len(c.origin):
        return out
    # per op of the table, once: whether its accumulator is as wide for 2-byte inputs as for 4-byte ones
    wide = {op: arg_size(kernel(rule), 2, True) == arg_size(kernel(rule), 4, True)
            for op, rule in kernels()["reductions"]["ops"].items()}
    same = [wide.get(next((m.group(1) for f in frames if not python_frame(f) for m in [ATEN_OP.match(f.name)] if m),
                          ""), False) for frames in c.origins]
    kept = np.array(same, dtype=bool)[c.origin]
    if not kept.any():
        return out
    order = np.argsort(c.start, kind="stable")
    for p, x in zip(order[:-1].tolist(), order[1:].tolist()):
        # Origins are kinds told apart by lifetimes too: the same frames are the same op's.
        if kept[x] and c.end[x] < c.end[p] and tuple(c.origins[c.origin[x]]) == tuple(c.origins[c.origin[p]]):
            out[x] = True
    return out


def reduction_note(staging: np.ndarray) -> str:
    """The assumption said when reductions' staging buffers keep their size (reduction_buffers)."""
    return (f"; the {int(staging.sum())} staging buffers and semaphores of CUDA reductions (a bias gradient's "
            "sum) keep their size: they hold the fp32 accumulator" if staging.any() else "")


def not_float_note(kept: np.ndarray) -> str:
    """The assumption said when bool or integer results keep their size (not_float)."""
    return (f"; the {int(kept.sum())} bool or integer results of comparisons and arg-reductions (a mask from eq) "
            "and bool masks of CUDA dropout "
            "keep their size" if kept.any() else "")


@dataclass
class Upcasts:
    """The fp32 copies half-precision RMS norms keep (variance_upcasts), and the inputs they replace."""

    copies: List[Tuple[int, int, int]]  # (start, end, size)
    released: List[Tuple[int, int]]  # (allocation, end): a norm's input, kept in the fp32 run by its pow
    inline: int = 0  # norms that upcast inline (INLINE_UPCAST), whose product keeps their input as well


# A variance of an fp32 copy made inline, on the variance's own line (T5's
# `hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)`): the copy has no name, so the
# product on the next line multiplies the input itself, in its own dtype, and keeps it for the
# backward (`hidden_states * torch.rsqrt(variance + eps)`), where Llama's idiom makes the copy on a
# line before and multiplies that. In an fp32 run the copy is the input and the two allocate alike.
INLINE_UPCAST = re.compile(r"\.(?:to\(\s*(?:dtype\s*=\s*)?torch\.float32\s*\)|float\(\s*\))\.pow\(")


def upcasts_inline(line: Tuple[Frame, ...]) -> bool:
    """Whether a variance's line of Python (a 1-tuple of its frame) upcasts its input inline
    (INLINE_UPCAST), as its source reads where this machine has the file; False where it has not."""
    text = source_line(line[0]) if line else None
    return bool(text and INLINE_UPCAST.search(text))


def variance_upcasts(run: Run) -> Upcasts:
    """The fp32 copies a half-precision model's RMS norms make and keep: the RMS-norm idiom of
    Llama, T5 and most Hugging Face models computes the variance in fp32 (of
    `hidden_states.to(torch.float32)`: `.pow(2).mean(-1)`), and `pow` keeps that fp32 copy of its
    input for the backward. The fp32 run shows the line as a `pow` then a `mean`; the copy has the
    pow's fp32 size and is kept as long as the normalised product after it (the next allocation of
    that size), which the backward frees with it. The norm's input (the last allocation of that size
    before it: the residual stream), which pow kept in the fp32 run, is then kept by nothing: it
    goes once the next norm starts (Llama's residual add after the attention has read it). Where
    the variance's line upcasts inline (upcasts_inline: T5's norm), the product after it keeps the
    input, as long as the fp32 run kept it."""
    c = run.course
    out = Upcasts([], [])
    if not (run.call == "pow").any():
        return out
    fwd = forward_in_order(run).tolist()
    pows = [i for i in range(len(fwd) - 1) if run.call[fwd[i]] == "pow" and run.call[fwd[i + 1]] == "mean"
            and run.line[fwd[i]] == run.line[fwd[i + 1]]]
    for n, i in enumerate(pows):
        k = fwd[i]
        kept = next((j for j in fwd[i + 2:] if c.size[j] == c.size[k]), None)
        if kept is None:
            continue
        out.copies.append((int(c.start[k]), int(c.end[kept]), int(c.size[k])))
        if upcasts_inline(run.line[k]):
            out.inline += 1
            continue
        source = next((j for j in reversed(fwd[:i]) if c.size[j] == c.size[k] and run.line[j] != run.line[k]
                       and run.born_run[j] == run.born_run[k]), None)
        if source is not None:
            following = fwd[pows[n + 1]] if n + 1 < len(pows) else None
            same_run = following is not None and run.born_run[following] == run.born_run[k]
            out.released.append((source, int(c.start[following]) if same_run else int(c.end[kept])))
    return out


# Hugging Face's loss functions (`ForCausalLMLoss`, `ForMaskedLMLoss`: transformers/loss/loss_utils.py),
# which compute the loss of half-precision logits in fp32 (`logits = logits.float()`).
UPCASTING_LOSS = re.compile(r"(^|/)loss_utils\.py|loss_utils\.py\(")


def loss_in_fp32(run: Run) -> bool:
    """Whether the run's loss keeps fp32 sizes in half precision: computed by a function that upcasts
    the logits (UPCASTING_LOSS on the loss's stacks), or on the CPU route (no ATen ops on the stacks),
    where T5's pair measures it so. Where CUDA runs `nn.CrossEntropyLoss` on the model's half-precision
    logits itself (T5, BERT's and ViT's classifiers), the loss runs in their dtype (the real T5 run)."""
    c = run.course
    if not (run.op != "").any():
        return True
    if not c.origins or not len(c.origin) or not run.loss.any():
        return False
    origins = np.unique(c.origin[run.loss])
    return any(UPCASTING_LOSS.search(f.file) or UPCASTING_LOSS.search(f.name) for o in origins.tolist()
               for f in c.origins[o])


def loss_upcasts(run: Run) -> List[Tuple[int, int, int]]:
    """(start, end, size) of the fp32 copy of the logits each forward's loss reads in half
    precision: Hugging Face's loss functions upcast them (`logits = logits.float()`) and autocast
    casts the input of `cross_entropy`, on its fp32 list. The fp32 run shows neither (the copy of an
    fp32 tensor is the tensor). The logits are the last matrix product before the loss's first
    allocation; the copy lives until the forward computes something else (the loss function
    returned: log_softmax keeps its output, not its input)."""
    c = run.course
    if not run.loss.any():
        return []
    fwd = forward_in_order(run).tolist()
    out = []
    i = 0
    while i < len(fwd):
        if not run.loss[fwd[i]]:
            i += 1
            continue
        first = fwd[i]
        j = i
        while j < len(fwd) and run.loss[fwd[j]] and run.born_run[fwd[j]] == run.born_run[first]:
            j += 1
        logits = next((fwd[h] for h in range(i - 1, max(i - 8, -1), -1)
                       if run.call[fwd[h]] in MATRIX_PRODUCTS
                       and run.born_run[fwd[h]] == run.born_run[first]), None)
        if logits is not None:
            end = int(c.start[fwd[j]]) if j < len(fwd) and run.born_run[fwd[j]] == run.born_run[first] \
                else int(max(c.end[fwd[h]] for h in range(i, j)))
            out.append((int(c.start[first]), end, int(c.size[logits])))
        i = j
    return out


def loss_note(upcasts: List[Tuple[int, int, int]]) -> str:
    """The assumption said when the loss reads an fp32 copy of half-precision logits (loss_upcasts)."""
    return ("; the loss reads an fp32 copy of the half-precision logits (`logits.float()`, or autocast's cast "
            f"for cross_entropy), kept while it is computed ({len(upcasts)} made)" if upcasts else "")


@dataclass(frozen=True)
class BatchRead:
    """The float batch a forward's first matrix product or convolution reads (BatchReads.at)."""

    when: int  # the event at which the product's first activation is made
    batch: int  # the allocation of the batch it reads


class BatchReads:
    """The float batch each forward's first op reads where that op (its first activation) is a matrix
    product or a convolution (a CNN's first conv2d, an MLP's first linear, a ViT's patch embedding).
    The batch is the largest input live then: the labels are one integer an example, and a product
    reads no integer tensor. In half precision the batch follows: autocast casts it to 2 bytes an
    element and saves that copy for the weight's gradient (the batch itself stays fp32, held by the
    loop); half-precision weights take it in their dtype (a product of a bf16 weight refuses an fp32
    input), so the script makes it in 2 bytes. What every forward is asked about is gathered once: a
    run of a thousand steps asks a thousand times."""

    def __init__(self, run: Run) -> None:
        c = run.course
        made = forward_in_order(run)
        made = made[run.of("activation")[made]]
        self._made = made[np.argsort(c.start[made], kind="stable")]  # the forward's activations, by start
        self._starts = c.start[self._made]
        self._inputs = np.flatnonzero(run.of("input"))
        self._run = run

    def at(self, start: int, end: int) -> Optional[BatchRead]:
        """The batch read by the forward made between events start and end; None where that forward
        starts otherwise (an embedding's lookup reads integer token ids) or no input is live."""
        k = int(np.searchsorted(self._starts, start))
        if k == len(self._made) or self._starts[k] >= end or self._run.call[self._made[k]] not in MATRIX_PRODUCTS:
            return None
        c = self._run.course
        when = int(self._starts[k])
        live = self._inputs[(c.start[self._inputs] < when) & (c.end[self._inputs] > when)]
        if not len(live):
            return None
        return BatchRead(when, int(live[np.argmax(c.size[live])]))


# The autograd node of a convolution's backward, as both routes' stacks name it.
CONVOLUTION_NODE = "ConvolutionBackward0"


def slow_conv_bias_copies(run: Run, precision: str) -> List[Tuple[int, int, int]]:
    """(start, end, size) of the fp32 copy of each convolution's output gradient that its bias
    gradient sums through, on a CPU capture's host whose convolutions in `precision` do not take
    oneDNN (memdiff.read.host: without AVX-512, bf16's). There ATen's `_slow_conv2d_backward` sums
    the half-precision gradient over (0, 2, 3), and a sum of a reduced-precision tensor on the CPU
    accumulates in an fp32 copy of it (ReduceOps.cpp's `should_use_acc_buffer`): the output
    gradient's elements at 4 bytes, made after the input's gradient and freed before the weight's
    (the head's trace). The fp32 run cannot show it: its convolutions take oneDNN, which sums in
    place. The output gradient is the backward's latest-made gradient still live when the node
    makes its first allocation (what the node before it gave it, freed once it returns); a node
    has a bias when it makes two parameter gradients, or, where gradients are kept between steps
    (no fresh `gradient`), three allocations (the input's, the weight's, the bias's)."""
    host = run.host
    c = run.course
    if host is None or not host.slow_convolutions(precision) or not c.origins or not len(c.origin):
        return []
    is_conv = np.array([autograd_node(frames) == CONVOLUTION_NODE for frames in c.origins], dtype=bool)[c.origin]
    backward = np.flatnonzero(run.phase == BACKWARD)
    backward = backward[np.argsort(c.start[backward], kind="stable")]
    grads = backward[run.of("autograd")[backward]]
    calls: List[Tuple[int, List[int]]] = []  # (the output gradient, the node's allocations)
    for k in backward[is_conv[backward]].tolist():
        if calls and c.end[calls[-1][0]] > c.start[k] and run.born_run[calls[-1][1][0]] == run.born_run[k]:
            calls[-1][1].append(k)
            continue
        live = grads[(c.start[grads] < c.start[k]) & (c.end[grads] > c.start[k])
                     & (run.born_run[grads] == run.born_run[k])]
        if len(live):
            calls.append((int(live[-1]), [k]))
    out = []
    for output_grad, made in calls:
        fresh = int(run.of("gradient")[made].sum())
        if fresh >= 2 or len(made) >= 3:
            start = int(c.start[made[0]])
            # The fp32 run's gradient is already the copy's size (every float tensor is taken as fp32 there).
            out.append((start, start + 1, int(c.size[output_grad])))
    return out


def slow_conv_note(copies: List[Tuple[int, int, int]], precision: str) -> str:
    """The assumption said when convolutions' bias gradients sum through fp32 copies (slow_conv_bias_copies)."""
    return (f"; this CPU capture's host runs {precision} convolutions without oneDNN (ATen's _slow_conv2d): each "
            f"bias gradient sums an fp32 copy of its output's gradient ({len(copies)} made)" if copies else "")
