"""What CUDA kernels of training runs allocate inside an op beyond their outputs, other than the
reduction kernel's buffers (reductions.py) and attention's (kernels.json `ops`).

Each rule reads the op's arguments and gives its steps after the outputs are allocated: ("alloc",
label, bytes, inner ops) and ("free", label). The sizes come from the kernels' sources (torch 2.11 and
2.13, named at each rule) and were checked against real H100 traces where a window has the op;
cub's temporary storage has no formula in PyTorch's sources and is an ESTIMATE fitted to them.

The audit of the other kernels training runs use. Allocating nothing beyond their outputs, checked
where a real H100 window runs them (gpt2-*, bert-base, vit-base, llama-base, llama1b-bf16, t5-base:
the emulated windows hold the same blocks in these ops):
- log_softmax forward and backward, softmax forward (cuda/SoftMax.cu): shared memory only;
- nll_loss forward and backward, so cross_entropy (cuda/Loss.cu): output and total_weight only;
- native_layer_norm, and its backward up to 65,536 rows (cuda/layer_norm_kernel.cu);
- native_dropout and its backward (cuda/Dropout.cu): output and bool mask;
- the _foreach_* arithmetic of AdamW, SGD, Adagrad, RMSprop (multi_tensor_apply: metadata by argument);
- _fused_adamw_ (cuda/FusedAdamWKernel.cu): in place.
- cross_entropy with label_smoothing: log_softmax, nll_loss and a sum of the log-probabilities, each
  an op the dispatch mode sees (native/LossNLL.cpp), nothing inside them beyond the above;
- topk over slices the single-block radix select takes (cuda/TensorTopK.cu should_use_multiblock:
  e.g. under 20,000 elements for up to 20 slices, under 400 past 4,000 slices: every MoE router's
  few experts): nothing but a contiguous copy of a strided input, the k values then sorted in place
  (sortKeyValueInplace) when k is small;
- index_put_ with accumulate=True (the backward of `x[idx]`), modelled below: checked against
  cs336-medium-ctx128-train's real H100 trace (512 ids into a 10,000-row table).
A router's and a sampler's kernels are modelled in routing.py from their sources, with no real
window to hold them to (derived, not measured): sort's arange, copies and cub sorts (cuda/Sort.cpp,
SortStable.cu), cumsum's dtype conversion and cub scan (cuda/ScanUtils.cuh), nonzero's count and cub
buffers (cuda/Nonzero.cu), unique's sorted copy, sort, scan and run-length encoding (cuda/UniqueCub.cu),
bincount's and histc's min/max and per-block histograms (cuda/SummaryOps.cu), multinomial's Gumbel
buffer (native/Distributions.cpp), grouped_mm's fallback output (native/GroupedMMUtils.h), topk's
out-of-place sort of more than 4,096 results (cuda/TensorTopK.cpp).
Not modelled, as no window has them to hold the sizes to: topk's multi-block path (a top-k sampler
over a vocabulary: kthValues, ks_to_find, desired, per-block digit counts and two cub scans by key,
sized from the SM count), cub's segmented sort's temporary
storage (sort over 128 or more slices longer than 4,096), multinomial with replacement and several
samples (cuda/MultinomialKernel.cu), the CUTLASS bf16 grouped_mm's workspace on sm90, index_put_ by
boolean masks, embedding_dense_backward with scale_grad_by_freq's count scan. index_add_ (a router's
combine) allocates nothing beyond its output (cuda/Indexing.cu index_add_cuda_impl: indexFunc kernels,
or scatter_add_ over an expanded view of the index); under deterministic algorithms it runs index_put_
with accumulate over `source * alpha`, not modelled. scatter_add_ and scatter_reduce_ were not audited
against cuda/ScatterGatherKernel.cu.
torch.nn.RMSNorm and F.rms_norm run `_fused_rms_norm`'s CUDA kernel (rmsnorm.py gives the meta
device its outputs): its and its backward's contiguous copies of strided inputs and, past 65,536 rows,
the backward's per-block partial sums of the weight's gradient are modelled below, from
cuda/layer_norm_kernel.cu (read at a fork of pytorch main, cyyever/pytorch 0660972; no real trace
holds the op). Hugging Face's RMSNorm modules are their own pow, mean, rsqrt and mul on both.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

from memdiff.recording.emulate import reductions
from memdiff.recording.emulate.gpus import Gpu

Step = Tuple[Any, ...]


class _Plan:
    """A kernel's steps as its rule lists them, each buffer freed in reverse at the op's end unless freed
    before (`done`)."""

    def __init__(self) -> None:
        self.steps: List[Step] = []
        self.live: List[str] = []

    def alloc(self, label: str, size: int, inner: Tuple[str, ...] = ()) -> None:
        """The kernel allocates `size` bytes as `label` (`inner`: the ops the allocation runs under)."""
        self.steps.append(("alloc", label, size, inner))
        self.live.append(label)

    def free(self, label: str) -> None:
        """The kernel frees `label`."""
        self.steps.append(("free", label))
        self.live.remove(label)

    def done(self) -> List[Step]:
        """The steps, with what is still live freed in reverse order of allocation."""
        for label in reversed(list(self.live)):
            self.free(label)
        return self.steps

# embedding_dense_backward_cuda (cuda/Embedding.cu): up to this many indices it runs one kernel over
# the features; beyond, it sorts the indices and reduces per segment (cuda/EmbeddingBackwardKernel.cu).
DIRECT_INDICES = 3072
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: rows of a segment one partial sum covers
MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4  # EmbeddingBackwardKernel.cu: the fused atomic kernel's threshold
MAX_BLOCK_SIZE = 1024  # cuda/SortingCommon.cuh
# cub::DeviceRadixSort's single-tile path (CCCL's radix sort policy for sm_80 and sm_90: 256 threads x
# 19 nominal 4-byte items, scaled to 9 for 8-byte keys and values): one block sorts up to this many
# and the temporary storage is 1 B. Real H100 traces agree: 512 indices sort in one tile
# (cs336-medium-ctx128-train, _index_put_impl_), 4,096 do not (llama1b-bf16, embedding backward).
SINGLE_TILE_ITEMS = 256 * 9


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def cub_radix_sort_pairs(n: int, bits: int = 64, key_bytes: int = 8, value_bytes: int = 8) -> int:
    """ESTIMATE of cub::DeviceRadixSort::SortPairs' temporary storage for n int64 keys and values over
    `bits` bits (cuda/cub.cuh radix_sort_pairs; SortKeys with value_bytes 0): the keys' and values'
    alternate buffers (16 B each for int64 pairs; other widths DERIVED from that layout, not measured),
    per-tile digit counts, a 2,048 B digit histogram per 8-bit pass, plus cub's 255 B of alignment
    slack. Fitted to real H100 traces of 64-bit sorts (torch 2.11): 4,096 indices 83,455 B
    (llama1b-bf16) and 16,384 indices 283,135 B (t5-base) exactly, 147,456 indices 2,408,959 B
    (t5-base) 0.2% over; the histogram's share per pass is read off cub's onesweep layout (256
    digits of 8 B), not measured for fewer bits."""
    if n <= SINGLE_TILE_ITEMS:
        return 1  # one block sorts it in shared memory: cub asks for 1 B so the pointer is not null
    passes = max(1, -(-bits // 8))
    return _up((key_bytes + value_bytes) * n + n // 4 + 256 + 2048 * passes, 256) + 255


def cub_scan(n: int) -> int:
    """ESTIMATE of cub's decoupled look-back scans' temporary storage (unique_by_key, exclusive_sum)
    over n items: a tile state per 3,840 items beside a fixed part, plus 255 B of alignment slack.
    Fitted to real H100 traces (torch 2.11): 1,279 B up to 16,384 items, 1,791 B at 147,456."""
    return _up(768 + 16 * -(-n // 3840), 256) + 255


def _contiguous(x: Any) -> bool:
    return bool(x.is_contiguous())


def _viewable_flat(x: Any) -> bool:
    """Whether x.reshape(-1) is a view (else it copies)."""
    try:
        x.view(-1)
    except RuntimeError:
        return False
    return True


def embedding(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """aten::embedding (native/Embedding.cpp): weight.index_select(0, indices.reshape(-1)); reshape
    copies indices that are not one run (an expanded position or token-type id buffer)."""
    indices = args[1] if len(args) > 1 else kwargs["indices"]
    if indices.dim() == 1 or _viewable_flat(indices):
        return []
    size = indices.numel() * indices.element_size()
    return [("alloc", "indices", size, ("clone", "reshape")), ("free", "indices")]


def embedding_dense_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """embedding_dense_backward_cuda (cuda/Embedding.cu) and embedding_backward_cuda_kernel
    (cuda/EmbeddingBackwardKernel.cu): contiguous copies of the indices and the gradient, and past
    3,072 indices the sort's and the segment reduction's buffers, freed in reverse at the op's end.
    Checked against real H100 traces (torch 2.11): llama1b-bf16's token embedding (4,096 indices,
    the two-pass kernel) and t5-base's position-bias tables (16,384 and 147,456 indices, the fused
    kernel)."""
    grad, indices = args[0], args[1]
    num_weights = int(args[2])
    scale = bool(args[4]) if len(args) > 4 else bool(kwargs.get("scale_grad_by_freq", False))
    n = indices.numel()
    isz = indices.element_size()
    plan = _Plan()
    alloc, free = plan.alloc, plan.free

    if not _contiguous(indices):
        alloc("indices", n * isz, ("clone", "contiguous"))
    if not _contiguous(grad):
        alloc("grad", grad.numel() * grad.element_size(), ("clone", "contiguous"))
    if n <= DIRECT_INDICES and not scale:
        return plan.done()
    alloc("sorted_indices", n * isz)
    alloc("orig_indices", n * isz)
    alloc("range", n * isz, ("arange",))
    alloc("sort_temp", cub_radix_sort_pairs(n))
    free("sort_temp")
    free("range")
    if scale:
        alloc("count", n * isz)  # and the scan by key's own temporaries, not modelled
    # embedding_backward_cuda_kernel
    width = grad.shape[-1] if grad.dim() else 1
    acc = 8 if grad.element_size() == 8 else 4  # acc_type: fp32 for fp16, bf16 and fp32
    alloc("segment_offsets", n * isz)
    alloc("num_of_segments", 8)
    alloc("dummy", n * isz)
    alloc("unique_temp", cub_scan(n))
    free("unique_temp")
    free("dummy")
    max_segments = min(n, num_weights)
    alloc("partials_per_segment", max_segments * isz)
    alloc("partials_per_segment_offset", max_segments * isz)
    alloc("scan_temp", cub_scan(max_segments))
    free("scan_temp")
    alloc("num_of_partial_segments", 8)
    max_partial = n // NROWS_PER_THREAD + max_segments
    alloc("partial_segment_offset", max_partial * isz)
    # Few segments of many rows (a position-bias table): one fused kernel adds every partial sum
    # atomically (in fp32 for 16-bit gradients); else the partial sums are kept, then scattered.
    warped = -(-width // 32) * 32
    scatter_grid = -(-max_segments * warped // min(warped, MAX_BLOCK_SIZE))
    fused = scatter_grid < gpu.multi_processor_count * MAX_ATOMIC_ACCUM_BLOCKS_PER_SM \
        and max_partial > scatter_grid * 4
    if fused:
        alloc("partial_to_segment_idx", max_partial * isz)
        if grad.element_size() == 2:
            alloc("grad_weight_acc", num_weights * width * 4, ("zeros",))
            free("grad_weight_acc")
    else:
        alloc("grad_weight_per_segment", max_partial * width * acc)
    return plan.done()


def softmax_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """softmax_backward_cuda_out (cuda/SoftMax.cu): `Tensor tmp = grad * output;` before the kernel,
    in the two's promoted dtype, freed at the op's end."""
    import torch

    grad, output = args[0], args[1]
    dtype = torch.promote_types(grad.dtype, output.dtype)
    size = max(grad.numel(), output.numel()) * dtype.itemsize
    return [("alloc", "tmp", size, ("mul_Tensor",)), ("free", "tmp")]


def _gamma_partials(m: int, n: int, dtype: Any, labels: Sequence[str], gpu: Gpu) -> List[Step]:
    """LaunchGammaBetaBackwardCUDAKernel (cuda/layer_norm_kernel.cu), shared by layer norm's and RMS
    norm's backward: past 65,536 rows of fewer than 32 x half the SMs' features, per-block partial
    sums of each gradient in `labels` (gamma's, and beta's for layer norm; in the weight's dtype),
    then `blocks.sum(0)`, a reduction whose result replaces the gradient first made (its own
    buffers: reductions.py). Nothing below that size."""
    import torch

    if not (m > 64 * 1024 and n // 32 < gpu.multi_processor_count // 2):
        return []
    blocks_x = -(-n // 32)
    blocks_y = min((64 * 1024 // 2) // blocks_x, -(-m // 32))
    steps: List[Step] = []
    for label in labels:
        steps.append(("alloc", label, blocks_y * n * dtype.itemsize, ()))
    rule = reductions.table()["sum_dim_IntList"]
    partial = torch.empty((blocks_y, n), dtype=dtype, device="meta")
    result = torch.empty((n,), dtype=dtype, device="meta")
    for label in labels:
        summed = f"{label}_sum"
        steps.append(("alloc", summed, n * dtype.itemsize, ("sum_dim_IntList",)))
        for piece in reductions.plan(rule, partial, [result], [0], False, gpu).pieces:
            if piece.buffer:
                steps += [("alloc", "staging", piece.buffer, ("sum_dim_IntList",)),
                          ("alloc", "semaphores", piece.semaphores, ("sum_dim_IntList",)),
                          ("free", "semaphores"), ("free", "staging")]
        steps.append(("free", summed))  # the gradient made first, which the sum's result replaces
    for label in reversed(labels):
        steps.append(("free", label))
    return steps


def _rows(x: Any, shape: Sequence[Any]) -> Tuple[int, int]:
    """The rows M and features N of a norm over `shape`, the input's last dimensions."""
    n = 1
    for size in shape:
        n *= int(size)
    return (x.numel() // n if n else 0), n


def layer_norm_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """native_layer_norm_backward: gamma's and beta's partial sums past 65,536 rows (_gamma_partials)."""
    x, shape, weight = args[1], args[2], args[5]
    mask = args[7] if len(args) > 7 else kwargs.get("output_mask", [True, True, True])
    m, n = _rows(x, shape)
    wanted = [bool(mask[1]) and weight is not None, bool(mask[2]) and len(args) > 6 and args[6] is not None]
    labels = [label for label, want in zip(("dgamma_blocks", "dbeta_blocks"), wanted) if want]
    if not labels:
        return []
    return _gamma_partials(m, n, (weight if weight is not None else args[6]).dtype, labels, gpu)


def _contiguous_copy(plan: _Plan, label: str, t: Any) -> None:
    """`expect_contiguous()` / `contiguous()` of a strided tensor: a copy, kept to the op's end."""
    if not _contiguous(t):
        plan.alloc(label, t.numel() * t.element_size(), ("clone", "contiguous"))


def fused_rms_norm(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """_fused_rms_norm_cuda (cuda/layer_norm_kernel.cu): `input.expect_contiguous()` copies a strided
    input for the kernel, freed at the op's end; Y and rstd are its outputs (rmsnorm.py)."""
    plan = _Plan()
    _contiguous_copy(plan, "input", args[0])
    return plan.done()


def fused_rms_norm_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """_fused_rms_norm_backward_cuda (cuda/layer_norm_kernel.cu): a contiguous copy of a strided input,
    dX and dgamma (its outputs), then RMSNormBackwardKernelImpl's `dY.contiguous()` and, past
    65,536 rows, gamma's partial sums (_gamma_partials; no beta in RMS norm)."""
    grad, x, shape, weight = args[0], args[1], args[2], args[4]
    mask = args[5] if len(args) > 5 else kwargs.get("output_mask", [True, True])
    plan = _Plan()
    _contiguous_copy(plan, "input", x)
    _contiguous_copy(plan, "grad_out", grad)
    m, n = _rows(x, shape)
    labels = ["dgamma_blocks"] if bool(mask[1]) and weight is not None else []
    if labels:  # each of the partial sums' buffers is freed inside: the copies stay to the op's end
        plan.steps.extend(_gamma_partials(m, n, weight.dtype, labels, gpu))
    return plan.done()


def foreach_norm(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """foreach_tensor_norm_cuda (cuda/ForeachReduceOp.cu): one partial norm per 65,536-element chunk
    (kChunkSize) of every tensor, in a zeroed fp32 (opmath) buffer as long as the longest tensor's
    chunks times the tensors. Checked against gpt2-clip's real H100 trace (148 gradients, the
    longest 589 chunks: 348,688 B)."""
    tensors = [t for t in args[0] if t is not None]
    if not tensors:
        return []
    chunks = max(-(-t.numel() // 65536) for t in tensors)
    opmath = 8 if tensors[0].element_size() == 8 else 4
    return [("alloc", "output_per_tensor", len(tensors) * chunks * opmath, ("zeros",)),
            ("free", "output_per_tensor")]


def _broadcast_numel(tensors: Sequence[Any]) -> int:
    import torch

    shape = torch.broadcast_shapes(*(tuple(t.shape) for t in tensors))
    n = 1
    for size in shape:
        n *= int(size)
    return n


def index_backward() -> bool:
    """Whether the op runs in IndexBackward0 (the backward of `x[idx]`). On the GPU its formula,
    index_backward (autograd/FunctionsManual.cpp), calls `_index_put_impl_(zeros, indices, grad,
    accumulate=True, unsafe=True)` into the zeros it made; on the meta device the same formula takes
    its subclass branch, a functional `index_put`, which would copy the zeros first."""
    import torch

    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ == "IndexBackward0"


def index_put_in_place(args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """IndexBackward0's index_put as the GPU runs it: into its zeros, no copy (index_backward)."""
    import torch

    return torch.ops.aten._index_put_impl_.default(args[0], args[1], args[2], True, True)


def index_put_accumulate(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """index_put_ with accumulate=True on CUDA: `_index_put_impl_` (native/TensorAdvancedIndexing.cpp)
    hands it to index_put_with_sort_kernel (cuda/Indexing.cu), read at pytorch/pytorch d4c7181 (the
    function unchanged in its allocations since the cub sort replaced thrust's for CUDA >= 11.3).
    It is the backward of advanced indexing (`x[idx]`: IndexBackward0's index_put). Inside it:
    makeLinearIndex turns int32 indices into int64 copies and, per indexed dimension,
    wrapIndexOnce checks the range with `index.max()` and `index.min()` (8 B each; skipped when
    `unsafe`), then `index.remainder(size) * stride` (two N x 8 B tensors, the first freed at once;
    a second dimension's is added into the first and freed); a value that is broadcast or not
    contiguous is copied; then `sorted_indices` and `orig_indices` (N x 8 B), `arange(N)` and
    cub's radix sort over the bits of the largest linear index, freed in reverse at the end.
    Boolean masks (indices by nonzero) are not modelled."""
    import torch

    self, indices, value = args[0], args[1], args[2]
    accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
    if not accumulate and not torch.are_deterministic_algorithms_enabled():
        return []
    unsafe = bool(args[4]) if len(args) > 4 else bool(kwargs.get("unsafe", False)) or index_backward()
    given = [(d, t) for d, t in enumerate(indices) if t is not None]
    if not given or any(t.dtype not in (torch.int64, torch.int32) for _, t in given):
        return []
    n = _broadcast_numel([t for _, t in given])
    dims = [d for d, _ in given]
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    slice_size = 1
    for size in self.shape[dims[-1] + 1:] if adjacent else [s for d, s in enumerate(self.shape) if d not in dims]:
        slice_size *= int(size)
    before = 1
    for size in self.shape[:dims[0]] if adjacent else ():
        before *= int(size)
    plan = _Plan()
    alloc, free = plan.alloc, plan.free

    elem = self.element_size()
    if not self.is_contiguous():
        alloc("self", self.numel() * elem, ("clone", "contiguous"))
    for k, (_, t) in enumerate(given):
        if t.dtype == torch.int32:
            alloc(f"long_{k}", t.numel() * 8, ("_to_copy", "to"))
    for k, _ in enumerate(given):
        if not unsafe:
            for check in ("max", "min"):
                alloc(check, 8, (check,))
                free(check)
        alloc(f"wrapped_{k}", n * 8, ("remainder_Scalar",))
        alloc(f"linear_{k}", n * 8, ("mul_Scalar",))
        free(f"wrapped_{k}")
        if k:
            free(f"linear_{k}")  # added into the first dimension's linear index
    for k, (_, t) in enumerate(given):
        if t.dtype == torch.int32:
            free(f"long_{k}")  # the int64 copies die with the list makeLinearIndex made them in
    needed = n * before * slice_size
    if value.numel() < needed or not value.is_contiguous():
        alloc("value", max(value.numel(), needed) * value.element_size(), ("clone", "contiguous"))
    if n and slice_size:
        if not adjacent:
            alloc("src", self.numel() * elem, ("clone", "contiguous"))
        alloc("sorted_indices", n * 8, ("empty_like",))
        alloc("orig_indices", n * 8, ("empty_like",))
        alloc("range", n * 8, ("arange",))
        bits = max(1, (max(1, self.numel() - 1) // slice_size).bit_length())
        alloc("sort_temp", cub_radix_sort_pairs(n, bits))
        free("sort_temp")
        free("range")
    return plan.done()


RULES: Dict[str, Callable[[Sequence[Any], Dict[str, Any], Any, Gpu], List[Step]]] = {
    "embedding": embedding,
    "embedding_dense_backward": embedding_dense_backward,
    "_softmax_backward_data": softmax_backward,
    "native_layer_norm_backward": layer_norm_backward,
    "_fused_rms_norm": fused_rms_norm,
    "_fused_rms_norm_backward": fused_rms_norm_backward,
    "_foreach_norm": foreach_norm,
    "index_put": index_put_accumulate,
    "index_put_": index_put_accumulate,
    "_index_put_impl_": index_put_accumulate,
}


def run(emulator: Any, name: str, args: Sequence[Any], kwargs: Dict[str, Any], out: Any, index: Any) -> None:
    """Allocate and free on GPU `index` what op `name` (already run, its outputs `out` allocated) makes
    inside it, in the order its kernel does."""
    play(emulator, name, RULES[name](args, kwargs, out, emulator.gpu), index)


def play(emulator: Any, name: str, steps: List[Step], index: Any) -> None:
    """Allocate and free on GPU `index` the buffers `steps` lists, inside op `name`."""
    if not steps:
        return
    index = emulator.device(index).index
    live: Dict[str, Any] = {}
    for step in steps:
        if step[0] == "alloc":
            _, label, size, inner = step
            live[label] = emulator.allocate(size, emulator.frames(name, inner), index)
        else:
            emulator.release(live.pop(step[1]), index)
