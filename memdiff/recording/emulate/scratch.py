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
Not modelled, as no window has them to hold the sizes to: cub's temporary storage in cumsum past a
block's length (cuda/ScanUtils.cuh), sort and topk (cuda/Sort.cpp, cuda/TensorTopK.cu), index_put_
with accumulate=True (cuda/Indexing.cu sorts its indices), embedding_dense_backward with
scale_grad_by_freq's count scan, and _fused_rms_norm (Hugging Face's RMSNorm modules run as pow,
mean, rsqrt and mul).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

from memdiff.recording.emulate import reductions
from memdiff.recording.emulate.gpus import Gpu

Step = Tuple[Any, ...]

# embedding_dense_backward_cuda (cuda/Embedding.cu): up to this many indices it runs one kernel over
# the features; beyond, it sorts the indices and reduces per segment (cuda/EmbeddingBackwardKernel.cu).
DIRECT_INDICES = 3072
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: rows of a segment one partial sum covers
MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4  # EmbeddingBackwardKernel.cu: the fused atomic kernel's threshold
MAX_BLOCK_SIZE = 1024  # cuda/SortingCommon.cuh


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def cub_radix_sort_pairs(n: int) -> int:
    """ESTIMATE of cub::DeviceRadixSort::SortPairs' temporary storage for n int64 keys and values over
    all 64 bits (cuda/cub.cuh radix_sort_pairs): the keys' and values' alternate buffers (16 B each),
    per-tile digit counts, plus cub's 255 B of alignment slack. Fitted to real H100 traces (torch 2.11):
    4,096 indices 83,455 B (llama1b-bf16) and 16,384 indices 283,135 B (t5-base) exactly, 147,456
    indices 2,408,959 B (t5-base) 0.2% over."""
    return _up(16 * n + n // 4 + 16640, 256) + 255


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
    steps: List[Step] = []
    live: List[str] = []

    def alloc(label: str, size: int, inner: Tuple[str, ...] = ()) -> None:
        steps.append(("alloc", label, size, inner))
        live.append(label)

    def free(label: str) -> None:
        steps.append(("free", label))
        live.remove(label)

    if not _contiguous(indices):
        alloc("indices", n * isz, ("clone", "contiguous"))
    if not _contiguous(grad):
        alloc("grad", grad.numel() * grad.element_size(), ("clone", "contiguous"))
    if n <= DIRECT_INDICES and not scale:
        for label in reversed(list(live)):
            free(label)
        return steps
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
    for label in reversed(list(live)):
        free(label)
    return steps


def softmax_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """softmax_backward_cuda_out (cuda/SoftMax.cu): `Tensor tmp = grad * output;` before the kernel,
    in the two's promoted dtype, freed at the op's end."""
    import torch

    grad, output = args[0], args[1]
    dtype = torch.promote_types(grad.dtype, output.dtype)
    size = max(grad.numel(), output.numel()) * dtype.itemsize
    return [("alloc", "tmp", size, ("mul_Tensor",)), ("free", "tmp")]


def layer_norm_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any, gpu: Gpu) -> List[Step]:
    """native_layer_norm_backward past 65,536 rows of fewer than 32 x half the SMs' features
    (cuda/layer_norm_kernel.cu LaunchGammaBetaBackwardCUDAKernel): per-block partial sums of gamma's
    and beta's gradients (in their dtype), then `dgamma_blocks.sum(0)`, a reduction whose result
    replaces the gradient first made (its own buffers: reductions.py)."""
    import torch

    x, shape, weight = args[1], args[2], args[5]
    mask = args[7] if len(args) > 7 else kwargs.get("output_mask", [True, True, True])
    n = 1
    for size in shape:
        n *= int(size)
    m = x.numel() // n if n else 0
    wanted = [bool(mask[1]) and weight is not None, bool(mask[2]) and len(args) > 6 and args[6] is not None]
    if not (m > 64 * 1024 and n // 32 < gpu.multi_processor_count // 2) or not any(wanted):
        return []
    blocks_x = -(-n // 32)
    blocks_y = min((64 * 1024 // 2) // blocks_x, -(-m // 32))
    dtype = weight.dtype
    steps: List[Step] = []
    labels = [label for label, want in zip(("dgamma_blocks", "dbeta_blocks"), wanted) if want]
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


RULES: Dict[str, Callable[[Sequence[Any], Dict[str, Any], Any, Gpu], List[Step]]] = {
    "embedding": embedding,
    "embedding_dense_backward": embedding_dense_backward,
    "_softmax_backward_data": softmax_backward,
    "native_layer_norm_backward": layer_norm_backward,
    "_foreach_norm": foreach_norm,
}


def run(emulator: Any, name: str, args: Sequence[Any], kwargs: Dict[str, Any], out: Any, index: Any) -> None:
    """Allocate and free on GPU `index` what op `name` (already run, its outputs `out` allocated) makes
    inside it, in the order its kernel does."""
    steps = RULES[name](args, kwargs, out, emulator.gpu)
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
