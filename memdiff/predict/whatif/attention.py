"""scaled_dot_product_attention on CUDA stacks when the model goes to half precision: the backend
the GPU picks for the half-precision call, by the emulator's own device model (sdpa_select: PyTorch's
checks per torch version, in its order for the GPU), and what PyTorch's math backend then allocates.

The math backend (`_scaled_dot_product_attention_math`) computes half-precision inputs in fp32
("keep query, key, value in high precision", unless `allow_fp16_bf16_reduction_math_sdp(True)`):
it holds fp32 copies of the query, key and value until it returns, its scores, softmax, dropout and
products are fp32, and it returns its output and the attention weights cast back to half precision.
A call the fp32 run shows on the math path keeps it in half precision unless a fused kernel that
refuses fp32 (flash, cuDNN) takes the half-precision call; which one does is the selection's answer.
A fused kernel makes none of the math path's scores, softmax, copies or masks: its output and its
softmax's log-sum-exp (fp32, one a query row), which it keeps for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from memdiff.predict.whatif.run import ATEN_OP, Run, forward_in_order, python_frame
from memdiff.recording.emulate.gpus import gpu, kernels
from memdiff.recording.emulate.sdpa_select import select, table

SDPA_FRAME = "at::_ops::scaled_dot_product_attention::call"


# The backend a recorded call ran, by the op scaled_dot_product_attention called for it.
BACKEND_OPS = {"_scaled_dot_product_attention_math": "math", "_scaled_dot_product_efficient_attention": "efficient",
               "_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_cudnn_attention": "cudnn"}


# The GPU a one-run what-if assumes the run had (a real snapshot does not name it): the H100 the
# emulator's `h100` entry describes, whose compute capability (sm90) the H200 shares.
ASSUMED_GPU = "h100"


# The dropout a call is taken to have when the trace shows it drops out: Hugging Face's default
# attention dropout (T5's dropout_rate), which cuDNN refuses (not a multiple of 1/16).
ASSUMED_DROPOUT = 0.1


HALF_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class MathCall:
    """One call the fp32 run ran on the math path and the half-precision run runs there too."""

    members: List[int]  # its forward allocations, in order
    output: int  # its result (the last product), cast back to half precision when it returns
    returns: int  # the event it returns at: the next forward allocation's
    copies: Tuple[int, int, int]  # the fp32 query, key and value it holds (bytes)
    scores: int  # the attention weights' bytes in fp32, of which it returns a half-precision copy


@dataclass
class FusedCall:
    """One call the fp32 run ran on the math path that a fused kernel takes in half precision."""

    members: List[int]  # the math path's forward allocations, none of which the kernel makes
    output: int  # the math path's result: the kernel's output, in half precision
    logsumexp: int  # the bytes of the softmax's log-sum-exp the kernel keeps (fp32, one a query row)
    until: int  # the event the call's backward frees what it kept: the math path's last saved tensor's
    inputs: List[int]  # the query, key and value the fp32 run freed in the forward, which the kernel keeps


@dataclass
class HalfAttention:
    """What the half-precision run's attention calls do differently from halving (half_attention)."""

    kept: np.ndarray  # the allocations that keep their fp32 size (the math calls' members)
    calls: List[MathCall] = field(default_factory=list)
    fused: List[FusedCall] = field(default_factory=list)  # math calls of the fp32 run a fused kernel takes


def _ops_inside(frames: Any) -> List[str]:
    """The ATen ops on a stack from the innermost frame out to the Python code, by name (`mul_Scalar`)."""
    out = []
    for f in frames:
        if python_frame(f):
            break
        m = ATEN_OP.match(f.name)
        if m:
            out.append(m.group(1))
    return out


def _calls(run: Run) -> List[Tuple[str, List[int], List[List[str]]]]:
    """(backend, forward allocations, each one's ops) of each scaled_dot_product_attention call of the
    forward that the stacks name (CUDA's C++ frames), in order."""
    c = run.course
    if not c.origins or not len(c.origin):
        return []
    ops = [_ops_inside(frames) for frames in c.origins]
    inside = np.array([bool(o) and o[-1] == "scaled_dot_product_attention" for o in ops], dtype=bool)
    if not inside.any():
        return []
    out: List[Tuple[str, List[int], List[List[str]]]] = []
    call: List[int] = []
    for k in [*forward_in_order(run).tolist(), -1]:
        if k >= 0 and inside[c.origin[k]] and (not call or run.born_run[k] == run.born_run[call[0]]):
            call.append(k)
            continue
        if call:
            mine = [ops[c.origin[j]] for j in call]
            backend = next((BACKEND_OPS[o[-2]] for o in mine if len(o) > 1 and o[-2] in BACKEND_OPS), "")
            out.append((backend, call, mine))
        call = [k] if k >= 0 and inside[c.origin[k]] else []
    return out


def _facts(run: Run, members: List[int], ops: List[List[str]]) -> Optional[Tuple[Dict[str, Any], Tuple[int, ...]]]:
    """What PyTorch's checks read of a math call, from its allocations (fp32): the query, key and value
    shapes from the scaled query and key (its first two products by a scalar), the scores (its first
    batched product) and the rows _safe_softmax tests ((B*H, Sq) bools); causal where it builds its
    own mask, dropout where it drops out; and the bytes of its scaled query and key, its scores and
    which allocation is its output. None when the trace does not show them all. Batch and heads are
    one number here (B*H): the checks compare them, the trace cannot split them."""
    c = run.course
    size = {k: int(c.size[k]) for k in members}
    direct = [o[-3] if len(o) > 2 else "" for o in ops]  # the op the math backend called
    # The key's scaling is the argument of the first matmul: the emulator's stacks put it inside.
    scaled = [k for k, d, o in zip(members, direct, ops)
              if d.startswith("mul") or (d == "matmul" and o[0].startswith("mul"))]
    products = [k for k, o in zip(members, ops) if o and o[0] == "bmm"]
    rows = next((k for k, o in zip(members, ops) if o and o[0].startswith("all")), None)
    if len(scaled) < 2 or len(products) < 2 or rows is None:
        return None
    r = size[rows]  # B*H*Sq
    if size[products[0]] % (4 * r) or size[scaled[0]] % (4 * r) or size[products[-1]] % (4 * r):
        return None
    sk, dq, dv = size[products[0]] // (4 * r), size[scaled[0]] // (4 * r), size[products[-1]] // (4 * r)
    if not (sk and dq and size[scaled[1]] % (4 * sk * dq) == 0):
        return None
    heads = size[scaled[1]] // (4 * sk * dq)  # B*H
    if not heads or r % heads:
        return None
    sq = r // heads
    every = {name for o in ops for name in o}
    # Grouped-query heads: the key and value repeated to the query's heads inside the call
    # (repeat_interleave, a copy the math backend makes itself; the emulator's stacks name only the copy).
    gqa = any(d.startswith("repeat_interleave") or d == "clone" for d in direct)
    return {"enabled_cudnn": True, "enabled_flash": True, "enabled_efficient": True, "enabled_math": True,
            "deterministic": False, "four_d": True, "same_dtype": True,
            # With grouped-query heads, fewer key and value heads than the query's (how many, the copies hide).
            "bq": 1, "bk": 1, "bv": 1, "hq": heads, "hk": 1 if gqa else heads, "hv": 1 if gqa else heads,
            "sq": sq, "sk": sk,
            "dq": dq, "dk": dq, "dv": dv, "qkv_last_stride_1": True, "q_offset": 0, "k_offset": 0, "v_offset": 0,
            "empty": False, "grad": True, "dropout": ASSUMED_DROPOUT if "native_dropout" in every else 0.0,
            "causal": "tril" in every, "gqa": gqa}, \
        (size[scaled[0]], size[scaled[1]], size[products[0]], products[-1])


# What the trace cannot show of a call, from the least to the most it takes: no mask; a mask the
# fused kernels take; one that requires grad (T5's learned position bias); one whose last stride
# is not 1 (T5's bias, permuted from (Sq, Sk, H) under transformers 5.17).
MASKS: Tuple[Dict[str, Any], ...] = (
    {"mask": False},
    {"mask": True, "mask_grad": False, "mask_last_stride_1": True},
    {"mask": True, "mask_grad": True, "mask_last_stride_1": True},
    {"mask": True, "mask_grad": False, "mask_last_stride_1": False},
    {"mask": True, "mask_grad": True, "mask_last_stride_1": False},
)


def half_backend(known: Dict[str, Any], value: str, observed: str) -> Optional[str]:
    """The backend the GPU picks for a call in `value` precision, by the emulator's selection: the
    call's facts completed with the first mask (MASKS) under which the fp32 call picks the backend
    the run shows (`observed`); None when none does."""
    gpu_model = gpu(ASSUMED_GPU)
    _, rules = table(_newest())
    for mask in MASKS:
        facts = {**known, "mask_dim": 4 if mask["mask"] else 0, "mask_b": 1, "mask_h": 1,
                 "mask_q": known["sq"], "mask_k": known["sk"], "mask_bool": False, "mask_grad": False,
                 "mask_last_stride_1": True, **mask, "major": gpu_model.major, "minor": gpu_model.minor}
        fp32, _ = select(rules, {**facts, "dtype": "float32", "esize": 4})
        if fp32 == observed:
            return select(rules, {**facts, "dtype": HALF_NAMES[value], "esize": 2})[0]
    return None


def _newest() -> str:
    """The newest torch version kernels.json has a table for: the run's torch is not in its snapshot."""
    known = [name for name in kernels()["sdpa_select"] if not name.startswith("_")]
    return max(known, key=lambda name: tuple(int(p) for p in name.split(".")))


def _read_and_freed(run: Run, members: List[int], query: int) -> List[int]:
    """The query, key and value of a math call that the fp32 run freed in the forward: the math path
    reads them into copies of its own (the scaled query, the repeated key and value), where a fused
    kernel keeps them for its backward. The query is the last tensor live at the call with the scaled
    query's bytes (`query`); the key and value, what the forward made after it, live at the call."""
    c = run.course
    begin = int(c.start[members[0]])
    here = run.born_run[members[0]]
    live = np.flatnonzero((c.start < begin) & (c.end > begin) & (run.born_run == here) & (run.end_run == here))
    q = live[c.size[live] == query]
    if not len(q):
        return []
    first = int(c.start[q].max())
    return live[c.start[live] >= first].tolist()


def half_attention(run: Run, value: str) -> HalfAttention:
    """The forward's attention calls the fp32 run ran on the math path that run on it in `value`
    precision too (by half_backend), with what each keeps in fp32 and adds."""
    c = run.course
    out = HalfAttention(np.zeros(len(c.size), dtype=bool))
    fwd = forward_in_order(run).tolist()
    place = {k: i for i, k in enumerate(fwd)}
    for backend, members, ops in _calls(run):
        if backend != "math":
            continue
        read = _facts(run, members, ops)
        if read is None:
            continue
        known, (q, k, scores, output) = read
        if half_backend(known, value, "math") != "math":
            saved = [m for m in members if run.end_run[m] != run.born_run[m] and m != output]
            until = int(c.end[saved].max()) if saved else int(c.end[output])
            out.fused.append(FusedCall(members, output, 4 * known["hq"] * known["sq"], until,
                                       _read_and_freed(run, members, q)))
            continue
        after = place[members[-1]] + 1
        returns = int(c.start[fwd[after]]) if after < len(fwd) else int(c.end[members[-1]])
        # The value's fp32 copy: the output's bytes with the key's length for the query's (k / q = Sk / Sq).
        v = int(c.size[output]) * k // q
        out.calls.append(MathCall(members, output, returns, (q, k, v), scores))
        out.kept[members] = True
    return out
