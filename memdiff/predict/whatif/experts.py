"""A mixture of experts run over grouped matrix products, which autocast leaves in fp32: what of it
keeps its size under `autocast=` (the forward inside the experts, and the backward of their
grouped products and of the gating between them).

transformers' `grouped_mm_experts_forward` (integrations/moe.py, Mixtral's default experts) runs
the experts through `torch.nn.functional.grouped_mm`, which is on none of autocast's lists (torch
registers no AutocastCPU or AutocastCUDA kernel for aten::_grouped_mm), and it casts the tokens
to the experts' weights' dtype first (`input.to(weight.dtype)`, its `_grouped_mm`): under autocast
the fp32 weights make the experts run in fp32, on a GPU as on the CPU.
"""

from __future__ import annotations

import re
from typing import List, Optional

import numpy as np

from memdiff.analyse.lifetimes import BACKWARD, FORWARD
from memdiff.predict.whatif.run import Run, autograd_node

# The function that runs the experts, in the file transformers ships it in.
GROUPED_EXPERTS_FILE = re.compile(r"(^|/)transformers/integrations/moe\.py$")
GROUPED_EXPERTS = "grouped_mm_experts_forward"

# The autograd node of a grouped matrix product (its gradients of the tokens and the weights).
GROUPED_NODE = "GroupedMmBackward0"

# The nodes of the products autocast casts (its lower-precision list: linear's mm and addmm, bmm,
# convolutions, attention): one of them between two grouped products' nodes is outside the experts.
CAST_PRODUCT_NODE = re.compile(r"^(Mm|Addmm|Addbmm|Bmm|Baddbmm|Convolution\w*|ScaledDotProduct\w*)Backward\d*$")


def grouped_experts_forward(run: Run) -> np.ndarray:
    """The forward allocations made inside transformers' grouped-mm experts (GROUPED_EXPERTS):
    they keep their size under autocast."""
    c = run.course
    if not c.origins or not len(c.origin):
        return np.zeros(len(c.size), dtype=bool)
    inside = np.array([any(f.name == GROUPED_EXPERTS and GROUPED_EXPERTS_FILE.search(f.file or "") for f in frames)
                       for frames in c.origins], dtype=bool)
    return inside[c.origin] & (run.phase == FORWARD)


def grouped_experts_backward(run: Run) -> np.ndarray:
    """The backward allocations of the experts' grouped products (GROUPED_NODE) and what the
    backward makes between two of them with no cast product's node in between (the gating's
    gradients: SiluBackward0, MulBackward0, SplitBackward0): the gradient of an fp32 tensor is
    fp32, so they keep their size under autocast. The backward stacks show no Python, so the
    experts' function cannot name them; the weighted sum after the down projection and the gather
    of the tokens before the up projection lie outside the two nodes, and still halve."""
    c = run.course
    out = np.zeros(len(c.size), dtype=bool)
    if not c.origins or not len(c.origin):
        return out
    node = np.array([autograd_node(frames) for frames in c.origins], dtype=object)[c.origin]
    if not (node == GROUPED_NODE).any():
        return out
    backward = np.flatnonzero(run.phase == BACKWARD)
    backward = backward[np.lexsort((c.start[backward], run.born_run[backward]))]
    since: Optional[List[int]] = None  # the backward allocations since the last grouped product's node
    last_run = -1
    for k in backward.tolist():
        if run.born_run[k] != last_run:
            since, last_run = None, int(run.born_run[k])
        if node[k] == GROUPED_NODE:
            out[k] = True
            if since:
                out[since] = True
            since = []
        elif CAST_PRODUCT_NODE.match(node[k]):
            since = None  # a product autocast casts: what follows is outside the experts
        elif since is not None:
            since.append(k)
    return out
