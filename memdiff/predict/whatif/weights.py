"""`weights=bf16|fp16`: parameters, gradients, optimizer state and activations in 2 bytes, and the
float batch a forward's first product or convolution reads (it must be in the weights' dtype); the
loss (upcast to fp32 by the libraries), other inputs (token ids, labels), BLAS workspaces and
one-element tensors keep their size.
"""

from __future__ import annotations

from typing import Set

from memdiff.analyse.lifetimes import FORWARD
from memdiff.predict.whatif.attention import HalfAttention, half_attention
from memdiff.predict.whatif.edit import ChangeRule, Edit, one_of
from memdiff.predict.whatif.precision import (
    PRECISIONS,
    BatchReads,
    Upcasts,
    cpu_math_attention,
    loss_in_fp32,
    loss_note,
    loss_upcasts,
    math_note,
    not_float,
    not_float_note,
    reduction_buffers,
    reduction_note,
    slow_conv_bias_copies,
    slow_conv_note,
    variance_upcasts,
)
from memdiff.predict.whatif.run import SCALAR_BYTES, Run


def apply_weights(run: Run, edit: Edit, value: str) -> None:
    """Keep the parameters, and what follows their dtype, in `value` (bf16 or fp16)."""
    c = run.course
    # A BLAS workspace is sized by the library per handle (CUBLAS_WORKSPACE_CONFIG), whatever the dtype.
    # The loss keeps fp32 where the library upcasts the logits for it; else it runs in their dtype.
    upcast = loss_in_fp32(run)
    halved = run.of("parameter", "gradient", "optimizer_state", "optimizer_temporary", "activation",
                    "temporary", "recomputed_activation", "autograd", "other") & ~(run.loss & upcast) & ~run.indices \
        & (c.size > SCALAR_BYTES)
    kept = halved & not_float(run)
    staging = halved & reduction_buffers(run)
    halved &= ~kept & ~staging
    math = cpu_math_attention(run)
    attention = half_attention(run, value)
    halved &= ~math & ~attention.kept
    edit.size[halved] = edit.size[halved] // 2
    batches = half_batches(run, edit)
    math_in_fp32(run, edit, attention)
    fused_in_half(run, edit, attention)
    upcasts = variance_upcasts(run)
    for start, end, size in upcasts.copies:
        edit.add(start, end, size, "activation")
    logits = loss_upcasts(run) if upcast else []
    for start, end, size in logits:
        edit.add(start, end, size, "activation")
    for k, end in upcasts.released:
        edit.end[k] = min(int(edit.end[k]), end)
    convolutions = slow_conv_bias_copies(run, value)
    for start, end, size in convolutions:
        edit.add(start, end, size, "autograd")
    edit.assumptions.append(f"{value} weights: parameters, gradients, optimizer state and activations in 2 bytes; "
                            + ("the loss (computed in fp32 by Hugging Face's loss functions), " if upcast else
                               "the loss too (the model's own cross entropy on its logits, no upcast); ")
                            + (f"the float batch the first product or convolution reads ({len(batches)} "
                               "made) in 2 bytes too, as that product takes its weight's dtype; other "
                               if batches else "")
                            + "inputs, int64 indices (max pooling's), "
                            "BLAS workspaces and one-element tensors keep their size; every float tensor is assumed "
                            "fp32 in the run" + not_float_note(kept) + reduction_note(staging) + math_note(math)
                            + variance_note(upcasts) + loss_note(logits) + attention_note(attention)
                            + slow_conv_note(convolutions, value))


def half_batches(run: Run, edit: Edit) -> Set[int]:
    """Halve the float batch each forward's first matrix product or convolution reads (BatchReads): a
    product of half-precision weights refuses an fp32 input, so the script makes the batch in their
    dtype (`x.to(device, torch.bfloat16)`), where the fp32 run kept it in 4 bytes. The batches halved."""
    reads = BatchReads(run)
    batches = {read.batch for s in run.spans if s.phase == FORWARD
               for read in [reads.at(s.start_event, s.end_event + 1)] if read is not None}
    for k in batches:
        edit.size[k] = run.course.size[k] // 2
    return batches


def variance_note(upcasts: Upcasts) -> str:
    """The assumption said of the RMS norms' fp32 copies (variance_upcasts)."""
    if not upcasts.copies:
        return ""
    out = (f"; each of the {len(upcasts.copies)} RMS norms that computes its variance as pow then mean keeps an fp32 "
           "copy of its input (the variance is computed in fp32)")
    if upcasts.inline == len(upcasts.copies):
        return out + (", beside the input, which the product after it multiplies and keeps (its source upcasts "
                      "inline: `.to(torch.float32).pow(2)`)")
    out += ", in place of the input where the product after it multiplies the copy"
    if upcasts.inline:
        out += (f"; {upcasts.inline} of them upcast inline (`.to(torch.float32).pow(2)`, as their source reads) "
                "and keep the input too, which their product multiplies")
    return out


def math_in_fp32(run: Run, edit: Edit, attention: HalfAttention) -> None:
    """What each attention call on the math path holds in fp32 in half precision (half_attention):
    its fp32 query, key and value until it returns; its output, fp32 until it returns, then a
    half-precision copy as long as the run kept the output; the half-precision copy of the
    attention weights it returns beside it, dropped at once."""
    c = run.course
    for call in attention.calls:
        begin = int(c.start[call.members[0]])
        for size in call.copies:
            edit.add(begin, call.returns, size, "activation")
        out = call.output
        edit.add(int(c.start[out]), call.returns, call.scores // 2, "activation")
        edit.add(call.returns, int(edit.end[out]), int(c.size[out]) // 2, "activation")
        edit.end[out] = min(int(edit.end[out]), call.returns)


def fused_in_half(run: Run, edit: Edit, attention: HalfAttention) -> None:
    """What each attention call a fused kernel takes in half precision makes instead of the math
    path's (half_attention): its output (the math path's result, halved) and the softmax's log-sum-exp,
    kept from the call to its backward, and its query, key and value kept as long, which the fp32 run
    freed once the math path had its copies; none of the math path's scores, softmax, copies or masks."""
    c = run.course
    for call in attention.fused:
        others = [m for m in call.members if m != call.output]
        edit.size[others] = 0
        edit.add(int(c.start[call.output]), call.until, call.logsumexp, "activation")
        for k in call.inputs:
            edit.end[k] = max(int(edit.end[k]), call.until)


def attention_note(attention: HalfAttention) -> str:
    """The assumption said of the attention calls' backends in half precision (half_attention)."""
    out = ""
    if attention.calls:
        out += (f"; {len(attention.calls)} scaled_dot_product_attention calls run PyTorch's math backend in half "
                "precision too (the emulator's backend selection, for an H100 and the newest torch it knows, "
                "with the fp32 run's backend telling what the trace cannot show of the mask): it computes in "
                "fp32, holding fp32 copies of the query, key and value, and casts its output back")
    if attention.fused:
        out += (f"; {len(attention.fused)} calls the fp32 run ran on the math path take a fused kernel in half "
                "precision (the emulator's backend selection): each makes its output and its softmax's fp32 "
                "log-sum-exp, kept for its backward, and none of the math path's scores, softmax or copies")
    return out


RULE = ChangeRule("weights", one_of("weights", PRECISIONS),
                  lambda run, edit, value: apply_weights(run, edit, str(value)))
