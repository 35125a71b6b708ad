"""The buffers CUDA's reduction kernel allocates inside an op (sum, mean, norms, var, max, argmax).

ATen's reductions on CUDA run `gpu_reduce_kernel` (aten/src/ATen/native/cuda/Reduce.cuh, read for
torch 2.11 and 2.13, where it is the same). It lays the reduction out over threads and blocks
from the TensorIterator's shape and strides (`setReduceConfig`); when each output's inputs are
many and the outputs few (a bias gradient: 768 sums of 3072 values), it splits every output over
several blocks, which meet in global memory: a staging buffer (`ReduceConfig::global_memory_size`)
and one semaphore per block column (`semaphore_size`), both taken from the caching allocator
before the launch and given back after it. A reduction over more than 2 GiB runs as 32-bit pieces
(`with_32bit_indexing`), each with its own buffers, and a 16-bit output that cannot hold the
running sums between pieces gets an accumulation buffer for the whole op (`AccumulationBuffer`).

This module does that arithmetic: the TensorIterator's dimension order and coalescing
(aten/src/ATen/TensorIterator.cpp: `reorder_dimensions`, `coalesce_dimensions`,
`can_use_32bit_indexing`, `get_dim_to_split`, `split`) and the launch configuration. Which ops
run it, with which accumulator and vector widths, is data (kernels.json, `reductions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from memdiff.recording.emulate.gpus import Gpu

INT32_MAX = 2**31 - 1
WARP = 32
MAX_NUM_THREADS = 512  # ReduceConfig's mnt_wrapper (256 for complex128 only, which training does not reduce)
MIN_VALUES_PER_THREAD = 16  # setReduceConfig, CUDA (ROCm uses 128)
MAX_VALUES_PER_THREAD = 256


@dataclass
class ReduceIter:
    """A reduction's TensorIterator after it is built: dimensions fastest first, the reduced ones at
    the front; byte strides per operand (the outputs, then the input)."""

    shape: List[int]
    strides: List[List[int]]
    noutputs: int
    in_size: int  # the input's element size (the kernel's scalar_t)
    in_offset: int = 0  # the input's byte offset from its allocation (a view's storage offset)
    out_sizes: List[int] = field(default_factory=list)  # each output's element size

    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.strides[0] if s == 0)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def num_output_elements(self) -> int:
        n = 1
        for size, stride in zip(self.shape, self.strides[0]):
            if stride != 0 or size == 1:
                n *= size
        return n

    def can_use_32bit_indexing(self) -> bool:
        if self.numel() > INT32_MAX:
            return False
        for strides in self.strides:
            if 1 + sum((size - 1) * stride for size, stride in zip(self.shape, strides)) > INT32_MAX:
                return False
        return True

    def dim_to_split(self) -> int:
        best, dim = -1, -1
        for d in range(len(self.shape) - 1, -1, -1):
            if self.shape[d] == 0:
                continue
            for strides in self.strides:
                extent = (self.shape[d] - 1) * abs(strides[d])
                if extent > best:
                    best, dim = extent, d
        return dim

    def split(self, dim: int) -> Tuple["ReduceIter", "ReduceIter"]:
        """The first half along `dim` and the rest, as TensorIteratorBase::split narrows them."""
        first_size = self.shape[dim] // 2
        first = replace(self, shape=list(self.shape), strides=[list(s) for s in self.strides])
        first.shape[dim] = first_size
        rest = replace(self, shape=list(self.shape), strides=[list(s) for s in self.strides],
                       in_offset=self.in_offset + self.strides[-1][dim] * first_size)
        rest.shape[dim] = self.shape[dim] - first_size
        return first, rest

    def pieces(self) -> Iterator["ReduceIter"]:
        """The 32-bit pieces the kernel runs on, in the order it runs them (with_32bit_indexing)."""
        if self.can_use_32bit_indexing():
            yield self
            return
        first, rest = self.split(self.dim_to_split())
        yield from first.pieces()
        yield from rest.pieces()


def build(in_shape: Sequence[int], in_strides: Sequence[int], in_size: int, reduced: Sequence[int],
          out_strides: Sequence[Sequence[int]], out_sizes: Sequence[int], in_offset: int = 0) -> ReduceIter:
    """The TensorIterator `reduce_op` builds for an input of `in_shape` / `in_strides` (elements) reduced
    over dims `reduced`, with outputs whose strides (elements, one per input dim, as the output is
    viewed by review_reduce_result: 0 on the reduced dims) are `out_strides`."""
    ndim = len(in_shape)
    mask = set(reduced)
    operands: List[List[int]] = []
    for strides, size in zip(out_strides, out_sizes):
        # compute_strides: a size-1 dim broadcast to a larger one has stride 0
        operands.append([0 if i in mask and in_shape[i] != 1 else strides[i] * size for i in range(ndim)])
    operands.append([in_strides[i] * in_size for i in range(ndim)])
    shape = list(in_shape)
    perm = _reorder(shape, operands, len(out_strides))
    shape = [shape[p] for p in perm]
    operands = [[strides[p] for p in perm] for strides in operands]
    shape, operands = _coalesce(shape, operands)
    return ReduceIter(shape=shape, strides=operands, noutputs=len(out_strides), in_size=in_size,
                      in_offset=in_offset, out_sizes=list(out_sizes))


def _reorder(shape: List[int], operands: List[List[int]], noutputs: int) -> List[int]:
    """TensorIteratorBase::reorder_dimensions for a reduction: the permutation that puts the reduced
    dims first, then the others by ascending stride (fastest first)."""
    ndim = len(shape)
    perm = list(range(ndim - 1, -1, -1))
    if ndim <= 1:
        return list(range(ndim))

    def should_swap(d0: int, d1: int) -> int:
        for arg, strides in enumerate(operands):
            s0, s1 = strides[d0], strides[d1]
            if arg < noutputs and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm


def _coalesce(shape: List[int], operands: List[List[int]]) -> Tuple[List[int], List[List[int]]]:
    """TensorIteratorBase::coalesce_dimensions: merge adjacent dims that are one run in every operand."""
    if len(shape) <= 1:
        return shape, operands
    shape = list(shape)
    operands = [list(s) for s in operands]
    prev = 0
    for dim in range(1, len(shape)):
        s0, s1 = shape[prev], shape[dim]
        mergeable = s0 == 1 or s1 == 1 or all(s0 * st[prev] == st[dim] for st in operands)
        if mergeable:
            if shape[prev] == 1:
                for st in operands:
                    st[prev] = st[dim]
            shape[prev] *= shape[dim]
        else:
            prev += 1
            if prev != dim:
                for st in operands:
                    st[prev] = st[dim]
                shape[prev] = shape[dim]
    del shape[prev + 1:]
    return shape, [st[:prev + 1] for st in operands]


def _last_pow2(n: int) -> int:
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    return max(1, n - (n >> 1))


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass
class Launch:
    """What setReduceConfig decided that decides memory: a global reduce's staging buffer and semaphores."""

    buffer: int  # bytes, 0 when the outputs need no global reduce
    semaphores: int
    ctas_per_output: int
    grid_x: int


def _output_vec_size(it: ReduceIter) -> int:
    """get_output_vec_size: 4, halved until the input's address, the output dim's size and the
    input's other strides are multiples of it."""
    vec = 4
    values = [it.in_offset // it.in_size, it.shape[it.num_reduce_dims()]]
    out_dim = it.num_reduce_dims()
    values += [s // it.in_size for j, s in enumerate(it.strides[-1]) if j != out_dim]
    for n in values:
        while n % vec:
            vec //= 2
    return vec


def launch(it: ReduceIter, arg_size: int, input_vec_size: int, gpu: Gpu) -> Launch:
    """setReduceConfig (Reduce.cuh) for one 32-bit piece, and the global buffers it asks for."""
    num_outputs = it.num_output_elements()
    inputs_per_output = it.numel() // num_outputs
    ndim = len(it.shape)
    reduce_dims = it.num_reduce_dims()
    in_strides = it.strides[-1]
    output_vec = 1
    if ndim > 0:
        on_fastest = reduce_dims == ndim or in_strides[0] < in_strides[reduce_dims]
        if on_fastest:
            dim0, dim1, fastest = inputs_per_output, num_outputs, in_strides[0]
        else:
            dim0, dim1, fastest = num_outputs, inputs_per_output, in_strides[reduce_dims]
    else:
        on_fastest, fastest, dim0, dim1 = True, it.in_size, 1, 1
    if fastest == it.in_size:
        if on_fastest and dim0 >= 128 and reduce_dims == 1:  # vectorized along the input
            dim0 //= input_vec_size
        elif not on_fastest:
            output_vec = _output_vec_size(it)
            dim0 //= output_vec
    # set_block_dimension
    max_threads = MAX_NUM_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input = step_output = 1
    block_x_reduce = split_warps = False
    if ndim == 0 or on_fastest:
        block_x_reduce = True
        step_input *= block_width
    else:
        step_output *= block_width
    values_per_thread = _div_up(inputs_per_output, step_input)
    if values_per_thread >= min(block_height * 16, MAX_VALUES_PER_THREAD):
        split_warps = True
        step_input *= block_height
    else:
        step_output *= block_height
    grid_x = _div_up(num_outputs // output_vec, step_output)
    target_grid = gpu.multi_processor_count * (gpu.max_threads_per_multi_processor // num_threads)
    values_per_thread = _div_up(inputs_per_output, step_input)
    ctas = 1
    if split_warps and values_per_thread >= MAX_VALUES_PER_THREAD and grid_x <= target_grid:
        ctas = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
                   _div_up(values_per_thread, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return Launch(buffer=0, semaphores=0, ctas_per_output=1, grid_x=grid_x)
    size = arg_size * num_outputs * ctas
    if not block_x_reduce:
        size *= block_width * output_vec
    return Launch(buffer=size, semaphores=4 * grid_x, ctas_per_output=ctas, grid_x=grid_x)


def accumulation_buffer(it: ReduceIter, arg_size: int, accumulates_in_output: bool) -> int:
    """The AccumulationBuffer gpu_reduce_kernel makes for a reduction run in 32-bit pieces whose
    output cannot hold the running values: as many accumulators as the output spans."""
    if accumulates_in_output or it.can_use_32bit_indexing():
        return 0
    out_size = it.out_sizes[0]
    if out_size >= arg_size:
        return 0  # the output itself holds them
    span = out_size
    for size, stride in zip(it.shape, it.strides[0]):
        span = max(span, size * stride)
    return (span // out_size) * arg_size


@dataclass(frozen=True)
class Kernel:
    """How one op runs gpu_reduce_kernel (kernels.json `reductions`)."""

    dims: Optional[Tuple[int, str]]  # the argument holding the reduced dims, [position, name] (None: all of them)
    keepdim: Optional[Tuple[int, str]]  # the argument holding keepdim (None: not kept)
    outputs: int  # the outputs the kernel writes (var_mean and max.dim write two)
    arg: str  # the accumulator: acc (opmath of the input), welford, pair (value and index), scalar (the input's)
    vt0: int
    vec16: int  # input_vec_size for 16-bit inputs (the others use vt0)
    cast: bool  # the input is cast to the output's dtype first (make_reduction_from_out_ty), unless 16-bit to fp32


def kernel(rule: Dict[str, Any]) -> Kernel:
    """A kernels.json `reductions` entry."""
    dims, keepdim = rule["dims"], rule["keepdim"]
    return Kernel(dims=(dims[0], dims[1]) if dims else None, keepdim=(keepdim[0], keepdim[1]) if keepdim else None,
                  outputs=rule["outputs"], arg=rule["arg"],
                  vt0=rule["vt0"], vec16=rule["vec16"], cast=rule["cast"])


def arg_size(rule: Kernel, in_dtype_size: int, is_float: bool) -> int:
    """sizeof(arg_t): fp16, bf16 and fp32 accumulate in fp32, fp64 and integers in their own width;
    Welford's state is (mean, m2, int32 n, nf); value-and-index pairs are 8-byte aligned."""
    acc = 4 if is_float and in_dtype_size <= 4 else max(in_dtype_size, 4 if is_float else 8)
    if rule.arg == "acc":
        return acc
    if rule.arg == "welford":
        return 16 if acc == 4 else 32
    if rule.arg == "pair":
        return 16
    return in_dtype_size


@dataclass
class Buffers:
    """What one reduction op allocates beyond its outputs, in the GPU's order: a cast copy of the
    input (make_reduction's self.to), the accumulation buffer, then per 32-bit piece a staging buffer
    and semaphores freed after its launch."""

    cast: int = 0
    accumulation: int = 0
    pieces: List[Launch] = field(default_factory=list)


def plan(rule: Kernel, x: Any, outs: Sequence[Any], dims: Any, keepdim: bool, gpu: Gpu) -> Buffers:
    """The buffers op `rule` allocates for input tensor `x` with output tensors `outs` (torch tensors
    on the meta device), reduced over `dims` (None or empty: all)."""
    import torch

    ndim = x.dim()
    found = Buffers()
    if x.numel() == 0 or ndim == 0 or not outs:
        return found
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced = list(range(ndim))
    else:
        reduced = sorted({int(d) % ndim for d in ([dims] if isinstance(dims, int) else dims)})
    out = outs[0]
    low = x.dtype in (torch.float16, torch.bfloat16)
    in_dtype = x.dtype
    if rule.cast and x.dtype != out.dtype and not (low and out.dtype == torch.float32):
        in_dtype = out.dtype
        found.cast = x.numel() * in_dtype.itemsize  # self.to(out dtype): dense, as `to` keeps a dense layout
    in_size = in_dtype.itemsize
    if in_dtype != x.dtype:
        in_strides: List[int] = _contiguous(list(x.shape)) if not _dense(x) else list(x.stride())
        offset = 0
    else:
        in_strides, offset = list(x.stride()), x.storage_offset() * in_size
    out_strides = []
    for o in outs[: rule.outputs]:
        strides = list(o.stride())
        if not keepdim:  # review_reduce_result: the reduced dims back, with stride 0
            for d in reduced:
                strides.insert(d, 0)
        out_strides.append([0 if d in reduced else strides[d] for d in range(ndim)])
    it = build(list(x.shape), in_strides, in_size, reduced, out_strides,
               [o.element_size() for o in outs[: rule.outputs]], offset)
    is_float = in_dtype.is_floating_point
    size = arg_size(rule, in_size, is_float)
    same_16bit = low and in_dtype == out.dtype
    accumulates = rule.arg in ("acc", "scalar") and not same_16bit
    found.accumulation = accumulation_buffer(it, size, accumulates)
    vec = rule.vec16 if in_size == 2 else rule.vt0
    for piece in it.pieces():
        if piece.numel() == 0:
            continue
        found.pieces.append(launch(piece, size, vec, gpu))
    return found


def _contiguous(shape: List[int]) -> List[int]:
    strides, run = [], 1
    for size in reversed(shape):
        strides.append(run)
        run *= max(size, 1)
    return strides[::-1]


def _dense(x: Any) -> bool:
    """Whether a tensor covers its span without gaps or overlaps (`to` then keeps its strides)."""
    pairs = sorted((s, n) for s, n in zip(x.stride(), x.shape) if n != 1)
    run = 1
    for stride, size in pairs:
        if stride != run:
            return False
        run *= size
    return True


def table() -> Dict[str, Kernel]:
    """The ops that run gpu_reduce_kernel, by the name a CUDA snapshot's frame gives them (kernels.json)."""
    from memdiff.recording.emulate.gpus import kernels

    return {name: kernel(rule) for name, rule in kernels()["reductions"]["ops"].items() if not name.startswith("_")}


def _argument(args: Sequence[Any], kwargs: Dict[str, Any], where: Optional[Tuple[int, str]], default: Any) -> Any:
    if where is None:
        return default
    index, name = where
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def run(emulator: Any, name: str, rule: Kernel, args: Sequence[Any], kwargs: Dict[str, Any], out: Any,
        index: Optional[int]) -> None:
    """Allocate and free on GPU `index` what op `name` (already run, its outputs `out` allocated) makes
    inside its reduction kernel, in the order the GPU's trace shows them."""
    import torch

    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    dims = _argument(args, kwargs, rule.dims, None)
    keepdim = bool(_argument(args, kwargs, rule.keepdim, False))
    _allocate(emulator, name, (), plan(rule, args[0], outs, dims, keepdim, emulator.gpu), index)


@dataclass(frozen=True)
class Inside:
    """An op that runs a reduction of its own inside it (kernels.json `reductions.inside`)."""

    reduction: str  # the op whose kernel it runs, as the GPU's stack names it
    input: int  # the argument reduced
    keep: Tuple[int, ...]  # the dims not reduced
    when: Tuple[int, str, int]  # the bool-list argument ([position, name]) and its item that asks for it
    output: int  # the op's output the reduction writes


def inside() -> Dict[str, Inside]:
    """The ops that reduce inside them, by the name a CUDA snapshot's frame gives them."""
    from memdiff.recording.emulate.gpus import kernels

    rules = kernels()["reductions"]["inside"]
    return {name: Inside(reduction=r["reduction"], input=r["input"], keep=tuple(r["keep"]),
                         when=(r["when"][0], r["when"][1], r["when"][2]), output=r["output"])
            for name, r in rules.items() if not name.startswith("_")}


def run_inside(emulator: Any, name: str, rule: Inside, kernels: Dict[str, Kernel], args: Sequence[Any],
               kwargs: Dict[str, Any], out: Any, index: Optional[int]) -> None:
    """The buffers of the reduction op `name` runs inside it (convolution_backward's bias gradient),
    when the argument that asks for it does."""
    flags = _argument(args, kwargs, (rule.when[0], rule.when[1]), None)
    if not flags or not flags[rule.when[2]]:
        return
    x = args[rule.input]
    result = out[rule.output] if isinstance(out, (tuple, list)) else None
    if result is None:
        return
    dims = [d for d in range(x.dim()) if d not in rule.keep]
    found = plan(kernels[rule.reduction], x, [result], dims, False, emulator.gpu)
    _allocate(emulator, name, (rule.reduction,), found, index)


def _allocate(emulator: Any, name: str, inner: Tuple[str, ...], found: Buffers, index: Optional[int]) -> None:
    if not (found.cast or found.accumulation or any(p.buffer for p in found.pieces)):
        return
    index = emulator.device(index).index
    frames = emulator.frames(name, inner)
    cast = emulator.allocate(found.cast, emulator.frames(name, ("_to_copy", *inner)), index) if found.cast else None
    accumulation = emulator.allocate(found.accumulation, frames, index) if found.accumulation else None
    for piece in found.pieces:
        if piece.buffer:
            staging = emulator.allocate(piece.buffer, frames, index)
            semaphores = emulator.allocate(piece.semaphores, frames, index)
            # at::DataPtr destructors at the end of gpu_reduce_kernel: the later one first
            emulator.release(semaphores, index)
            emulator.release(staging, index)
    if accumulation is not None:
        emulator.release(accumulation, index)
    if cast is not None:
        emulator.release(cast, index)
