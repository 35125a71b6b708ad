"""Mixture-of-experts routing under emulation: the ops a router and its experts run whose meta kernels
do not run them as CUDA does.

`torch._grouped_mm` (torch.nn.functional.grouped_mm: Hugging Face's default experts implementation,
torchtitan's MoE) runs CUTLASS's bf16 kernel only on sm90 and sm100 with bf16 operands; every other
call (fp32 or fp16 experts, any dtype on an A100 or L4) takes `_grouped_mm_fallback`
(native/GroupedMMUtils.h, torch 2.13): the output made as the fast path makes it, the offsets read to
the host, then one cuBLAS `mm_out` per group into its rows. The meta kernel checks for the fast path's
bf16 and refuses the rest, so the emulator makes the fallback's output itself: nothing else is
allocated on the device (the offsets' copy is host memory), but the products run on cuBLAS, whose
handle's workspace the first one makes.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from memdiff.recording.emulate.gpus import Gpu, kernels


def grouped_mm_fallback(args: Sequence[Any], kwargs: Dict[str, Any], gpu: Gpu) -> bool:
    """Whether `_grouped_mm_cuda` (cuda/GroupedBlas.cpp, torch 2.13) takes its fallback for this call:
    its fast path needs an sm90 or sm100 GPU (_scaled_mm_allowed_device) and bf16 operands and output."""
    a, b = args[0], args[1]
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    bf16 = a.dtype == b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16)
    return not (bf16 and gpu.major in (9, 10))


def grouped_mm_output(args: Sequence[Any], kwargs: Dict[str, Any]) -> torch.Tensor:
    """The output of `_grouped_mm_fallback`, as create_grouped_gemm_output_tensor makes it
    (native/GroupedMMUtils.h, torch 2.13): (offsets' groups x) rows x columns, the rows' stride
    padded to 16 bytes for TMA, in mat_a's dtype; the checks of _grouped_mm_validate_inputs that
    decide what runs (dtypes, dimensions, contraction, offsets' presence and dtype)."""
    a, b = args[0], args[1]
    offs: Optional[torch.Tensor] = args[2] if len(args) > 2 else kwargs.get("offs")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    allowed = (torch.bfloat16, torch.float32, torch.float16)
    torch._check(a.dtype in allowed, lambda: f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {a.dtype}")
    torch._check(b.dtype in allowed, lambda: f"Expected mat_b to be Float32, BFloat16 or Float16 matrix, got {b.dtype}")
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3), lambda: "mat_a and mat_b have to be 2 or 3d")
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not (a2 and b2):
        torch._check(a.size(-1) == b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is not None) == (a2 or b2),
                 lambda: "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32, lambda: "Offsets have to be 1D int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(out_dtype in (None, a.dtype), lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    if a2 and b2:
        assert offs is not None
        size = [int(offs.size(0)), int(a.size(0)), int(b.size(1))]
    elif a2:
        assert offs is not None
        torch._check(offs.size(0) == b.size(0), lambda: "matrix batch sizes have to match")
        size = [int(a.size(0)), int(b.size(-1))]
    elif b2:
        assert offs is not None
        torch._check(offs.size(0) == a.size(0), lambda: "matrix batch sizes have to match")
        size = [int(a.size(1)), int(b.size(1))]
    else:
        torch._check(a.size(0) == b.size(0), lambda: "batched dimension has to match")
        size = [int(a.size(0)), int(a.size(1)), int(b.size(-1))]
    alignment = 16 // a.element_size()
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=a.dtype, device=a.device)


# -- ops whose output size depends on values -------------------------------------------------------

# Ops the meta device cannot run (no shapes without data) that a router or a sampler calls. Each is run
# by `data_sized`: on the host copies where the inputs' values are known (values.py), else at the
# size the GPU allocates whatever the values are, or refused where that size has no bound.
DATA_SIZED = {"_unique2", "unique_consecutive", "unique_dim", "unique_dim_consecutive", "bincount",
              "repeat_interleave"}


class Sized:
    """An op run by `data_sized`: its outputs (meta tensors), their host values where known, and the
    buffers its CUDA kernel allocates beyond them (scratch.py's steps)."""

    def __init__(self, out: Any, values: Optional[list], steps: list) -> None:
        self.out = out
        self.values = values
        self.steps = steps


def _shrunk(capacity: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of `shape` over a storage of `capacity` elements: CUDA's unique allocates an
    output for every input element, then `resize_`s it down to the count, which keeps the storage."""
    t = torch.empty(capacity, dtype=dtype, device="meta")
    return t.resize_(list(shape)) if list(shape) != [capacity] else t


def unique(base: str, args: Sequence[Any], kwargs: Dict[str, Any], known: Optional[torch.Tensor],
           func: Any) -> Sized:
    """_unique2 and unique_consecutive without `dim` on CUDA: UniqueCub.cu (torch 2.13), all of whose
    allocations are sized by the input, not by its values. Beyond the outputs: the sorted copy, for
    the inverse the sort's arange and index output and the inclusive scan's int64 copy, cub's
    temporary storage (radix sort, scan, unique or run-length encoding) and the 8 B count. The
    output (and counts, when asked for) keeps a storage of every input element, `resize_`d down to
    the distinct values' count; a bool input counts its true values instead (two-element outputs).
    The count is the host values' where known, else every element (an upper bound: the memory is the
    same, only the shape differs)."""
    from memdiff.recording.emulate.scratch import cub_radix_sort_pairs, cub_scan

    x = args[0]
    names = ("sorted", "return_inverse", "return_counts") if base == "_unique2" else \
        ("return_inverse", "return_counts", "dim")
    call = dict(zip(names, args[1:]))
    call.update(kwargs)
    consecutive = base == "unique_consecutive"
    inverse, counts = bool(call.get("return_inverse", False)), bool(call.get("return_counts", False))
    if call.get("dim") is not None:
        return unique_dim(x, int(call["dim"]), inverse, counts, known, consecutive)
    n = x.numel()
    values = list(func(known, *args[1:], **kwargs)) if known is not None else None
    k = int(values[0].numel()) if values is not None else (min(n, 2) if x.dtype == torch.bool else n)
    boolean = x.dtype == torch.bool and not consecutive and n > 0
    capacity = 2 if boolean else n
    out = _shrunk(capacity, [k], x.dtype)
    inv = torch.empty(x.shape if inverse or n == 0 else (0,), dtype=torch.long, device="meta")
    if boolean or counts:
        cnt = _shrunk(capacity, [k], torch.long)
    else:
        cnt = torch.empty(0, dtype=torch.long, device="meta")
    steps: list = []
    if n == 0:
        return Sized((out, inv, cnt), values, steps)
    elem = x.element_size()
    if boolean:
        # the count of true values (DeviceArray<int>) and cub's reduce's temporary storage
        steps += [("alloc", "num_true", 4, ()), ("alloc", "reduce_temp", cub_scan(n), ()),
                  ("free", "reduce_temp"), ("free", "num_true")]
        return Sized((out, inv, cnt), values, steps)
    if not consecutive:
        steps.append(("alloc", "sorted", n * elem, ("empty",)))
        bits = elem * 8
        if inverse:
            steps += [("alloc", "range", n * 8, ("arange",)), ("alloc", "sorted_indices", n * 8, ("empty",)),
                      ("alloc", "sort_temp", cub_radix_sort_pairs(n, bits, elem, 8), ()), ("free", "sort_temp"),
                      ("free", "range")]
        else:
            steps += [("alloc", "sort_temp", cub_radix_sort_pairs(n, bits, elem, 0), ()), ("free", "sort_temp")]
    if inverse:
        loc = ("inv_loc", n * 4) if consecutive else ("inv_loc_out", n * 8)
        steps += [("alloc", loc[0], loc[1], ("empty",)), ("alloc", "scan_temp", cub_scan(n), ()),
                  ("free", "scan_temp"), ("free", loc[0])]
    steps += [("alloc", "length", 8, ("empty",)), ("alloc", "unique_temp", cub_scan(n), ()),
              ("free", "unique_temp"), ("free", "length")]
    if not consecutive:
        if inverse:
            steps.append(("free", "sorted_indices"))
        steps.append(("free", "sorted"))
    return Sized((out, inv, cnt), values, steps)


def unique_dim(x: torch.Tensor, dim: int, inverse: bool, counts: bool, known: Optional[torch.Tensor],
               consecutive: bool) -> Sized:
    """unique over a dimension (cuda/Unique.cu unique_dim_cuda_template, torch 2.13): the distinct
    slices gathered by index_select, so the output is sized by their count (every slice where the
    values are unknown); the inverse has one index per slice, the counts one per distinct slice.
    Its thrust sort's buffers are not modelled."""
    values = None
    if known is not None:
        run = torch.unique_consecutive if consecutive else torch.unique
        values = list(run(known, return_inverse=True, return_counts=True, dim=dim))
    dim %= max(1, x.dim())
    k = int(values[0].shape[dim]) if values is not None else int(x.shape[dim])
    shape = list(x.shape)
    shape[dim] = k
    out = torch.empty(shape, dtype=x.dtype, device="meta")
    inv = torch.empty((int(x.shape[dim]),) if inverse else (0,), dtype=torch.long, device="meta")
    cnt = torch.empty((k,) if counts else (0,), dtype=torch.long, device="meta")
    if values is not None:
        empty = torch.empty(0, dtype=torch.long)
        values = [values[0], values[1] if inverse else empty, values[2] if counts else empty]
    return Sized((out, inv, cnt), values, [])


_TABLE = kernels()["routing"]  # the thresholds, with their sources
APPLY_THREADS = int(_TABLE["apply_threads"])
MULTI_BLOCK_BINS = int(_TABLE["multi_block_bins"])
GLOBAL_BINS = int(_TABLE["global_bins"])


def histogram_partial(n: int, nbins: int, out_elem: int) -> int:
    """Bytes of CUDA_tensor_histogram's per-block partial histograms (cuda/SummaryOps.cu, torch 2.13):
    from 100 bins (past what shared memory takes) and under 1,000 (where it adds into the output
    directly) each block of 512 elements keeps its own copy of the bins, zeroed: grid x nbins."""
    if n == 0 or not MULTI_BLOCK_BINS <= nbins < GLOBAL_BINS:
        return 0
    return -(-n // APPLY_THREADS) * nbins * out_elem


def bincount(args: Sequence[Any], kwargs: Dict[str, Any], known: Optional[torch.Tensor],
             known_weights: Optional[torch.Tensor], say: Any) -> Sized:
    """bincount on CUDA (cuda/SummaryOps.cu _bincount_cuda_template, torch 2.13): the input's min and
    max read to the host (one-element reductions), nbins = max(max + 1, minlength) zeroed counts
    (int64, or the weights' float/double), the histogram kernel's partial copies. Where the input's
    values are unknown, nbins is `minlength` (a router's count of experts, whose ids lie below it),
    said once; without minlength there is no size to give, and the emulator refuses the call."""
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = int(args[2]) if len(args) > 2 else int(kwargs.get("minlength", 0))
    dtype = torch.long if weights is None else \
        (weights.dtype if weights.dtype == torch.float32 else torch.float64)
    values = None
    if x.numel() == 0:
        nbins = minlength
    elif known is not None:
        nbins = max(int(known.max()) + 1, minlength)
        if weights is None or known_weights is not None:
            values = [torch.bincount(known, known_weights, minlength)]
    elif minlength > 0:
        nbins = minlength
        say(f"bincount of values the emulator does not have: sized by its minlength ({minlength} bins), the "
            f"size a GPU gives when every value is below it")
    else:
        raise ValueError("bincount of values the emulator does not have (computed on the device) and no "
                         "minlength: its size is the largest value + 1; pass minlength (the number of bins "
                         "the values lie below)")
    out = torch.empty(nbins, dtype=dtype, device="meta")
    steps: list = []
    doubled = weights is not None and weights.dtype != torch.float32 and x.numel() > 0
    if doubled:  # _bincount_cuda: weights of any other dtype are summed as `weights.to(kDouble)`
        steps.append(("alloc", "weights_double", x.numel() * 8, ("_to_copy", "to")))
    if x.numel():
        elem = x.element_size()
        if x.dtype != torch.uint8:
            steps += [("alloc", "min", elem, ("min",)), ("free", "min")]
        steps += [("alloc", "max", elem, ("max",)), ("free", "max")]
        partial = histogram_partial(x.numel(), nbins, out.element_size())
        if partial:
            steps += [("alloc", "partial_output", partial, ("zeros",)), ("free", "partial_output")]
    if doubled:
        steps.append(("free", "weights_double"))
    return Sized(out, values, steps)


def histc_steps(args: Sequence[Any], kwargs: Dict[str, Any]) -> list:
    """histc on CUDA (cuda/SummaryOps.cu _histc_cuda_template, torch 2.13): the input's min and max
    read to the host when min == max (the range taken from the data), and the histogram kernel's
    partial copies (histogram_partial); the output is the meta kernel's."""
    x = args[0]
    bins = int(args[1]) if len(args) > 1 else int(kwargs.get("bins", 100))
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    steps: list = []
    if x.numel() == 0:
        return steps
    if float(low) == float(high):
        steps += [("alloc", "min", x.element_size(), ("min",)), ("free", "min"),
                  ("alloc", "max", x.element_size(), ("max",)), ("free", "max")]
    partial = histogram_partial(x.numel(), bins, x.element_size())
    if partial:
        steps += [("alloc", "partial_output", partial, ("zeros",)), ("free", "partial_output")]
    return steps


# -- sort ------------------------------------------------------------------------------------------

SMALL_SORT = int(_TABLE["small_sort"])  # slices up to this long sort in place
LARGE_SEGMENT = int(_TABLE["large_segment"])  # one cub sort per slice from this length
FULL_SORT_SEGMENTS = int(_TABLE["full_sort_segments"])  # fewer slices sort as one by value, then by slice


def _sort_dim(x: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    """The dimension sort runs over: sort(self, dim, descending) or sort.stable(self, *, stable, dim, ...)."""
    dim = kwargs.get("dim")
    if dim is None and len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
        dim = args[1]
    return int(dim if dim is not None else -1) % max(1, x.dim())


def sort_plan(x: Any, dim: int) -> list:
    """What sort allocates on CUDA beyond its values and indices (cuda/Sort.cpp sort_cuda_kernel and
    cuda/SortStable.cu, torch 2.13), for a slice of nsort elements along `dim`:
    up to 4,096, fillSliceWithIndex's `arange(nsort)` (int64), then an in-place sort;
    beyond, a copy of the input with `dim` innermost and temporary values and indices when `dim` is not
    innermost, then by the number of slices: one (or slices of a million) cub radix sort per slice
    over a shared `arange` of its indices; fewer than 128 one global sort of (slice, index) int2 pairs
    (two numel x 8 B buffers, the sort's own key output, its temporary storage) and a sort of those by
    slice over ceil(log2(slices)) bits; more, a reverse index per element and cub's segmented sort,
    whose temporary storage is not modelled. cub's radix sort temporary storage is
    scratch.cub_radix_sort_pairs (an ESTIMATE fitted to 64-bit sorts, DERIVED for other widths)."""
    from memdiff.recording.emulate.scratch import cub_radix_sort_pairs

    n = x.numel()
    nsort = int(x.shape[dim]) if x.dim() else 1
    if n == 0 or nsort <= 1 and x.dim() == 0:
        return []
    if nsort <= SMALL_SORT:
        return [("alloc", "range", nsort * 8, ("arange",)), ("free", "range")]
    elem = x.element_size()
    steps: list = []
    innermost = all(int(s) == 1 for s in x.shape[dim + 1:])
    if not (innermost and x.is_contiguous()):
        steps.append(("alloc", "self", n * elem, ("empty_strided",)))
    if not innermost:
        steps += [("alloc", "values_tmp", n * elem, ("empty_strided",)),
                  ("alloc", "indices_tmp", n * 8, ("empty_strided",))]
    segments = n // nsort
    if segments == 1 or nsort >= LARGE_SEGMENT:
        steps.append(("alloc", "indices", nsort * 8, ()))
        for _ in range(segments):
            steps += [("alloc", "sort_temp", cub_radix_sort_pairs(nsort, elem * 8, elem, 8), ()),
                      ("free", "sort_temp")]
        steps.append(("free", "indices"))
    elif segments < FULL_SORT_SEGMENTS:
        bits = max(1, (segments - 1).bit_length())
        steps += [("alloc", "indices_and_segment", n * 8, ()), ("alloc", "indices_and_segment2", n * 8, ()),
                  ("alloc", "keys_out", n * elem, ()),
                  ("alloc", "sort_temp", cub_radix_sort_pairs(n, elem * 8, elem, 8), ()),
                  ("free", "sort_temp"), ("free", "keys_out"),
                  ("alloc", "segment_sort_temp", cub_radix_sort_pairs(n, bits, 8, 0), ()),
                  ("free", "segment_sort_temp"), ("free", "indices_and_segment2"), ("free", "indices_and_segment")]
    else:
        steps += [("alloc", "reverse_indices", n * 8, ()), ("free", "reverse_indices")]
    for label in ("indices_tmp", "values_tmp", "self"):
        if any(s[0] == "alloc" and s[1] == label for s in steps):
            steps.append(("free", label))
    return steps


def sort(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> list:
    """sort and argsort (aten::sort, both overloads): sort_plan."""
    x = args[0]
    return sort_plan(x, _sort_dim(x, args, kwargs))


def histc(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> list:
    """histc: histc_steps."""
    return histc_steps(args, kwargs)


def cumsum(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> list:
    """cumsum on CUDA (native/ReduceOps.cpp impl_func_cum_ops, cuda/ScanUtils.cuh scan_dim, torch
    2.13): the input converted to the output's dtype first (`self.to(result.scalar_type())`: an int
    count summed as int64, or into a `dtype=` asked for), then, where the scan runs over every element
    (a 1-D tensor: a router's per-expert counts into offsets), cub's inclusive scan with its
    temporary storage (scratch.cub_scan, an ESTIMATE); other dimensions scan in blocks, in place."""
    from memdiff.recording.emulate.scratch import cub_scan

    x = args[0]
    dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
    n = x.numel()
    if x.dim() == 0 or n == 0 or not isinstance(out, torch.Tensor):
        return []
    steps: list = []
    if out.dtype != x.dtype:
        steps.append(("alloc", "converted", n * out.element_size(), ("_to_copy", "to")))
    if n == int(x.shape[dim % x.dim()]):
        steps += [("alloc", "scan_temp", cub_scan(n), ()), ("free", "scan_temp")]
    if out.dtype != x.dtype:
        steps.append(("free", "converted"))
    return steps


def nonzero(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> list:
    """nonzero on CUDA (cuda/Nonzero.cu nonzero_cuda_out_impl, torch 2.13), one chunk (under 2**31
    elements): a contiguous copy of a strided input, the device's count (an int per chunk), cub's
    reduce and select-flagged temporary storage (scratch.cub_scan, an ESTIMATE for both), freed before
    the op returns."""
    from memdiff.recording.emulate.scratch import cub_scan

    x = args[0]
    n = x.numel()
    steps: list = []
    if not x.is_contiguous():
        steps.append(("alloc", "self", n * x.element_size(), ("clone", "contiguous")))
    steps += [("alloc", "num_nonzeros", 4, ()), ("alloc", "reduce_temp", cub_scan(n), ()), ("free", "reduce_temp")]
    if x.dim() > 0:
        steps += [("alloc", "select_temp", cub_scan(n), ()), ("free", "select_temp")]
    steps.append(("free", "num_nonzeros"))
    if not x.is_contiguous():
        steps.append(("free", "self"))
    return steps


def multinomial(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> list:
    """multinomial drawing one sample, or without replacement (native/Distributions.cpp multinomial_out,
    torch 2.13: the Gumbel route, on CUDA as on the CPU): `q = empty_like(self).exponential_()`,
    `self / q` into q, then argmax into the output, or for several samples topk into the output and
    `vals`, a tensor of the output's shape in the probabilities' dtype. With replacement and several
    samples CUDA runs its own kernel (cuda/MultinomialKernel.cu), not modelled."""
    x = args[0]
    samples = int(args[1]) if len(args) > 1 else int(kwargs.get("num_samples", 1))
    replacement = bool(args[2]) if len(args) > 2 else bool(kwargs.get("replacement", False))
    if replacement and samples > 1 or x.numel() == 0:
        return []
    steps: list = [("alloc", "q", x.numel() * x.element_size(), ("empty_like",))]
    if samples > 1 and isinstance(out, torch.Tensor):
        steps += [("alloc", "vals", out.numel() * x.element_size(), ("empty",)), ("free", "vals")]
    steps.append(("free", "q"))
    return steps


def topk(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> list:
    """topk's sort of its results past 4,096 of them (cuda/TensorTopK.cpp topk_out_cuda, torch 2.13;
    an expert-choice router's capacity): `sortedIndices` and `sortedValues` like the results, the
    sort's own buffers (sort_plan), then `indices.gather(dim, sortedIndices)` copied back, freed before
    the op returns. Up to 4,096 results sort in place. The selection kernels' own buffers (the
    multi-block radix select) are not modelled."""
    x = args[0]
    k = int(args[1]) if len(args) > 1 else int(kwargs.get("k", 1))
    dim = (int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))) % max(1, x.dim())
    ordered = bool(args[4]) if len(args) > 4 else bool(kwargs.get("sorted", True))
    if not isinstance(out, (tuple, list)) or not ordered or k <= SMALL_SORT:
        return []
    values, indices = out[0], out[1]
    if values.numel() <= 1:
        return []
    steps: list = [("alloc", "sortedIndices", indices.numel() * 8, ("empty_like",)),
                   ("alloc", "sortedValues", values.numel() * values.element_size(), ("empty_like",))]
    steps += sort_plan(values, dim)
    steps += [("alloc", "gathered", indices.numel() * 8, ("gather",)), ("free", "gathered"),
              ("free", "sortedValues"), ("free", "sortedIndices")]
    return steps


RULES = {"sort": sort, "topk": topk, "histc": histc, "cumsum": cumsum, "nonzero": nonzero, "multinomial": multinomial}


def repeat_interleave(args: Sequence[Any], kwargs: Dict[str, Any], known: Optional[torch.Tensor]) -> Sized:
    """repeat_interleave(repeats) without output_size (each index repeated its count of times, the
    form torch.repeat_interleave(x, counts) reaches): the output has sum(repeats) elements, computed
    from the counts' values where they are known. Counts made on the device have no values and no
    bound, so the emulator refuses the call and asks for output_size, which the meta kernel takes."""
    if known is None:
        raise ValueError("repeat_interleave of counts the emulator does not have (computed on the device) and no "
                         "output_size: its size is their sum; pass output_size")
    value = torch.repeat_interleave(known)
    return Sized(torch.empty(value.shape, dtype=value.dtype, device="meta"), [value], [])

