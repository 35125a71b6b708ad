"""cuDNN's convolutions on the emulated GPU: the workspace each one runs with.

On a GPU, `aten::convolution` and `aten::convolution_backward` of a float tensor run cuDNN through
its v8/v9 frontend (aten/src/ATen/native/cudnn/Conv_v8.cpp, torch 2.11): `run_single_conv` makes an
execution plan for (operation, shapes, dtype, alignment, deterministic, allow_tf32) and
`run_conv_plan` asks the caching allocator for the plan's workspace right before the kernel and
frees it when the kernel returns. The forward allocates its output, copies of the input and weight
where they are not in the output's memory format, then the workspace. The backward copies
grad_output into the input's memory format where it is not (ViT's patch embedding: the gradient of
a transposed view), runs the data gradient (its output, then its workspace), then the filter
gradient (its output, then its workspace), frees the copy, and takes the bias gradient outside
cuDNN (a sum). With
`torch.backends.cudnn.benchmark` off the plan is the heuristics' first that runs; with it on, the
first call per key runs cuDNN's find, which first allocates the largest workspace among the
candidate plans and holds it while timing them, empties the cache (`conv_benchmark_empty_cache`,
on by default), then runs the fastest plan with its own workspace; later calls use the cached plan.

A workspace's size is what cuDNN's engine asks for, which no formula published by NVIDIA gives:
kernels.json's `conv` holds the sizes read from a real H100 trace per operation and shape
(`calibrated`), and estimates for other shapes, read off the same trace's engines (see there).
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from memdiff.recording.emulate.gpus import kernels
from memdiff.recording.emulate.runtime import Emulator, _Expr, op_name

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# What a GPU's stack names under the op for the outputs cuDNN's path makes, per operation.
INNER = {"fwd": ("cudnn_convolution",), "data": ("cudnn_convolution_backward_input",),
         "filter": ("cudnn_convolution_backward_weight",)}
COPY = ("_to_copy", "to_dtype_layout")  # Tensor.contiguous(memory_format) and .to(memory_format)
# The plans benchmark mode has found, per emulator (cuDNN's benchmark_cache lives for the process).
_FOUND: "weakref.WeakKeyDictionary[Emulator, Set[str]]" = weakref.WeakKeyDictionary()


class _Rules:
    """kernels.json's `conv` rules, compiled."""

    def __init__(self, table: Dict[str, Any]) -> None:
        self.calibrated: Dict[str, Dict[str, int]] = {
            arch: {key: int(size) for key, size in sizes.items()} for arch, sizes in table["calibrated"].items()}
        self.estimate: Dict[str, Dict[str, List[_Expr]]] = {
            op: {case: [_Expr(text) for text in (texts if isinstance(texts, list) else [texts])]
                 for case, texts in cases.items()}
            for op, cases in table["estimate"].items()}
        self.find = _Expr(table["find"])


@lru_cache(maxsize=None)
def rules() -> _Rules:
    """The compiled rules (read once)."""
    return _Rules(kernels()["conv"])


def _ints(values: Any) -> Tuple[int, ...]:
    return tuple(int(v) for v in values)


def key(op: str, x: torch.Tensor, w: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
        dilation: Sequence[int], groups: int) -> str:
    """The calibrated table's key for one cuDNN operation: op (fwd, data, filter), dtype, the input
    and weight shapes (as a forward convolution's x and w), stride, padding, dilation and groups."""
    def dims(values: Sequence[int]) -> str:
        return ",".join(str(v) for v in values)
    dtype = str(x.dtype).replace("torch.", "")
    return (f"{op} {dtype} x{dims(_ints(x.shape))} w{dims(_ints(w.shape))} s{dims(_ints(stride))} "
            f"p{dims(_ints(padding))} d{dims(_ints(dilation))} g{int(groups)}")


def workspace(emulator: Emulator, op: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
              stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
              layout: torch.memory_format = torch.contiguous_format) -> int:
    """The bytes of the workspace cuDNN's heuristics' plan asks for: the calibrated size where a
    real trace showed this operation and shape on this GPU's architecture with torch's defaults
    (TF32 allowed, not deterministic, run in NCHW `layout`), else the estimate."""
    table = rules()
    arch = f"sm{emulator.gpu.major}{emulator.gpu.minor}"
    defaults = torch.backends.cudnn.allow_tf32 and not torch.backends.cudnn.deterministic \
        and layout == torch.contiguous_format
    if defaults:
        known = table.calibrated.get(arch, {}).get(key(op, x, w, stride, padding, dilation, groups))
        if known is not None:
            return known
    pointwise = all(int(k) == 1 for k in w.shape[2:]) and all(int(s) == 1 for s in stride) \
        and all(int(p) == 0 for p in padding)
    sizes = table.estimate[op]["pointwise" if pointwise else "other"]
    return min(size(_values(x, w, y)) for size in sizes)


def _format(t: torch.Tensor) -> torch.memory_format:
    """Tensor.suggest_memory_format: channels-last where the tensor is laid out so (and not also
    contiguous), else contiguous; cuDNN runs in the output's (forward) or input's (backward)."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def _values(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Dict[str, int]:
    """X, Y, W: the bytes of a forward convolution's input, output and weight."""
    return {"X": x.numel() * x.element_size(), "Y": y.numel() * y.element_size(), "W": w.numel() * w.element_size()}


def uses_cudnn(x: Any, w: Any, transposed: bool, groups: int) -> bool:
    """Whether PyTorch's convolution takes cuDNN's route on the GPU for these tensors (ConvUtils.h's
    use_cudnn): a float input of 3 to 5 dimensions with cuDNN enabled, not a depthwise convolution
    (PyTorch's own depthwise kernels run those, cuDNN only for some half-precision shapes)."""
    if not (isinstance(x, torch.Tensor) and x.is_meta and isinstance(w, torch.Tensor)):
        return False
    if not torch.backends.cudnn.enabled or x.dtype not in FLOATS or x.dim() not in (3, 4, 5) or x.numel() == 0:
        return False
    depthwise = not transposed and x.dim() in (4, 5) and groups > 1 and int(x.shape[1]) == groups \
        and int(w.shape[0]) % int(x.shape[1]) == 0
    return not depthwise


class _Run:
    """One cuDNN call's own memory, in the order the kernel makes it: copies of tensors not laid out
    in the memory format it runs in (`.contiguous(memory_format)`, kept until the call returns),
    and each operation's workspace (with benchmark mode's find before it at a key's first call)."""

    def __init__(self, emulator: Emulator, name: str, index: int, layout: torch.memory_format) -> None:
        self.emulator, self.name, self.index, self.layout = emulator, name, index, layout
        self.copies: List[Any] = []

    def copy(self, t: torch.Tensor, inner: Sequence[str]) -> None:
        """`t.contiguous(layout)`: a new tensor where `t` is not laid out so."""
        if not t.is_contiguous(memory_format=self.layout) and t.numel():
            frames = self.emulator.frames(self.name, (*COPY, *inner))
            self.copies.append(self.emulator.allocate(t.numel() * t.element_size(), frames, self.index))

    def release(self) -> None:
        """The call returns: its copies are freed, the last made first."""
        while self.copies:
            self.emulator.release(self.copies.pop(), self.index)

    def __call__(self, op: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int) -> None:
        emulator = self.emulator
        frames = emulator.frames(self.name, INNER[op])
        if torch.backends.cudnn.benchmark:
            found = _FOUND.setdefault(emulator, set())
            plan = f"{key(op, x, w, stride, padding, dilation, groups)} {self.layout}"
            if plan not in found:
                found.add(plan)
                self.find(rules().find(_values(x, w, y)), frames)
        size = workspace(emulator, op, x, w, y, stride, padding, dilation, groups, self.layout)
        if size > 0:
            emulator.release(emulator.allocate(size, frames, self.index), self.index)

    def find(self, size: int, frames: List[Dict[str, Any]]) -> None:
        """cuDNN's find: the largest candidate's workspace (halved until it fits, as PyTorch's
        generate_and_filter_plans does), held while the plans are timed; then emptyCache."""
        emulator = self.emulator
        while size > 0:
            try:
                block = emulator.allocate(size, frames, self.index)
            except torch.OutOfMemoryError:
                size //= 2
                continue
            emulator.release(block, self.index)
            break
        emulator.device(self.index).allocator.empty_cache()


def _track(emulator: Emulator, out: Any, name: str, inner: Sequence[str], index: int) -> None:
    if isinstance(out, torch.Tensor) and out.is_meta and out.untyped_storage().nbytes():
        emulator.track(out.untyped_storage(), name, inner, index)


def convolution(emulator: Emulator, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], mode: Any) -> Any:
    """aten::convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
    groups): the output, copies of the weight and input where they are not in the output's memory
    format, then the workspace (ConvShared.cpp's cudnn_convolution_forward_out). A transposed
    convolution is cuDNN's data gradient."""
    x, w = args[0], args[1]
    stride, padding, dilation, transposed, _, groups = args[3:9]
    if not uses_cudnn(x, w, bool(transposed), int(groups)):
        return None
    out = func(*args, **kwargs)
    name, index = op_name(func), emulator.placement.for_new(args, kwargs)
    op = "data" if transposed else "fwd"
    _track(emulator, out, name, INNER[op], index)
    run = _Run(emulator, name, index, _format(out))
    run.copy(w, INNER[op])
    run.copy(x, INNER[op])
    if transposed:  # the output plays the forward's input, the input its output
        run(op, out, w, x, stride, padding, dilation, int(groups))
    else:
        run(op, x, w, out, stride, padding, dilation, int(groups))
    run.release()
    return out


def convolution_backward(emulator: Emulator, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                         mode: Any) -> Any:
    """aten::convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask): grad_output in the input's memory format (a
    copy where it is not: a transposed view's gradient), the input's gradient and its workspace, the
    weight's gradient and its workspace, then, outside cuDNN, the bias's, in the order a GPU makes them."""
    grad_output, x, w = args[0], args[1], args[2]
    stride, padding, dilation, transposed, _, groups, mask = args[4:11]
    if not uses_cudnn(x, w, bool(transposed), int(groups)):
        return None
    name, index = op_name(func), emulator.placement.for_new(args, kwargs)
    run = _Run(emulator, name, index, _format(x))
    run.copy(grad_output, ("cudnn_convolution_backward",))
    head = args[:10]
    results: List[Optional[torch.Tensor]] = [None, None, None]
    # A transposed convolution's input gradient is a forward convolution of grad_output, and its
    # weight gradient has grad_output as the forward's input.
    fx, fy = (grad_output, x) if transposed else (x, grad_output)
    for i, op in ((0, "fwd" if transposed else "data"), (1, "filter")):
        if mask[i]:
            part = func(*head, [j == i for j in range(3)], **kwargs)[i]
            _track(emulator, part, name, INNER[op], index)
            run(op, fx, w, fy, stride, padding, dilation, int(groups))
            results[i] = part
    run.release()
    if mask[2]:
        # outside cuDNN: a sum over all but the channels, run as an op of its own (through `mode`,
        # the dispatch mode this kernel runs under) so that the rules of sums apply to it
        emulator.context.append(name)
        try:
            with mode:
                results[2] = torch.sum(grad_output, [0, *range(2, grad_output.dim())])
        finally:
            emulator.context.pop()
    return tuple(results)


# Each kernel takes the emulator, the op, its arguments and the dispatch mode it runs under; None: not cuDNN's route.
KERNELS: Dict[str, Callable[[Emulator, Any, Tuple[Any, ...], Dict[str, Any], Any], Any]] = {
    "convolution": convolution, "convolution_backward": convolution_backward}
