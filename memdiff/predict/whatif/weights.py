"""`weights=bf16|fp16`: parameters, gradients, optimizer state and activations in 2 bytes; the
loss (upcast to fp32 by the libraries), inputs, BLAS workspaces and one-element tensors keep
their size.
"""

from __future__ import annotations

from memdiff.predict.whatif.edit import ChangeRule, Edit, one_of
from memdiff.predict.whatif.precision import (
    PRECISIONS,
    cpu_math_attention,
    loss_note,
    loss_upcasts,
    math_note,
    not_float,
    not_float_note,
    variance_upcasts,
)
from memdiff.predict.whatif.run import SCALAR_BYTES, Run


def apply_weights(run: Run, edit: Edit, value: str) -> None:
    """Keep the parameters, and what follows their dtype, in `value` (bf16 or fp16)."""
    c = run.course
    # A BLAS workspace is sized by the library per handle (CUBLAS_WORKSPACE_CONFIG), whatever the dtype.
    halved = run.of("parameter", "gradient", "optimizer_state", "optimizer_temporary", "activation",
                    "recomputed_activation", "autograd", "other") & ~run.loss & ~run.indices & (c.size > SCALAR_BYTES)
    kept = halved & not_float(run)
    halved &= ~kept
    math = cpu_math_attention(run)
    halved &= ~math
    edit.size[halved] = edit.size[halved] // 2
    upcasts = variance_upcasts(run)
    for start, end, size in upcasts.copies:
        edit.add(start, end, size, "activation")
    logits = loss_upcasts(run)
    for start, end, size in logits:
        edit.add(start, end, size, "activation")
    for k, end in upcasts.released:
        edit.end[k] = min(int(edit.end[k]), end)
    edit.assumptions.append(f"{value} weights: parameters, gradients, optimizer state and activations in 2 bytes; "
                            "the loss (computed in fp32 by the libraries), inputs, int64 indices (max pooling's), "
                            "BLAS workspaces and one-element tensors keep their size; every float tensor is assumed "
                            "fp32 in the run" + not_float_note(kept) + math_note(math)
                            + (f"; each of the {len(upcasts.copies)} RMS norms that computes its variance as pow then "
                               "mean keeps an fp32 copy of its input in its place (the variance is computed in fp32)"
                               if upcasts.copies else "") + loss_note(logits))


RULE = ChangeRule("weights", one_of("weights", PRECISIONS),
                  lambda run, edit, value: apply_weights(run, edit, str(value)))
