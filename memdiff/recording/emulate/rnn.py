"""cuDNN's RNNs on the emulated GPU: `nn.LSTM`, `nn.GRU` and `nn.RNN` allocate as PyTorch's cuDNN
route does on a GPU (aten/src/ATen/native/cudnn/RNN.cpp), on the CPU build of torch (which has no
cuDNN, so its meta tensors would take the generic per-step path) and on the CUDA build (whose
`_cudnn_rnn_flatten_weight` asks the driver for a cuDNN handle before any dispatch).

- `flatten_parameters()` (run by `.cuda()`, `.to()` and construction on the device) makes one flat
  weight buffer and turns every parameter into a view of it;
- the forward (`_VF.lstm`, `_VF.gru`, `_VF.rnn_tanh`, `_VF.rnn_relu`) runs `aten::_cudnn_rnn` under
  autograd: output, hy, cy, a workspace freed inside the op and, in training, the reserve autograd
  keeps for the backward; a copy of the weights into a new flat buffer when they are not flat; the
  process's dropout state at the first training forward with dropout;
- the backward (`aten::_cudnn_rnn_backward`) makes dx, dhx, dcx, the weight gradients as views of
  one flat buffer (or separate tensors without bias, as PyTorch copies them out) and workspaces.

The sizes are kernels.json's `rnn` rules; the reserve, workspace and dropout state are estimates.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import lru_cache
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from memdiff.recording.emulate.gpus import kernels
from memdiff.recording.emulate.runtime import Emulator, _Expr, op_name

META = torch.device("meta")
_VF: Any = torch._C._VariableFunctions
MODES = {_VF.lstm: "LSTM", _VF.gru: "GRU", _VF.rnn_tanh: "RNN_TANH", _VF.rnn_relu: "RNN_RELU"}
FLATTEN = _VF._cudnn_rnn_flatten_weight
# What a GPU's stack names under the op for its own tensors (at::empty inside the kernel).
EMPTY = ("empty_memory_format",)
# The dropout state cuDNN keeps per device for the process, once made (see _dropout_state).
_STATES: "weakref.WeakKeyDictionary[Emulator, torch.Tensor]" = weakref.WeakKeyDictionary()


class _Rules:
    """kernels.json's `rnn` rules, compiled."""

    def __init__(self, table: Dict[str, Any]) -> None:
        self.gates = {mode: int(rule["gates"]) for mode, rule in table["modes"].items()}
        self.by_number = {int(rule["cudnn_mode"]): mode for mode, rule in table["modes"].items()}
        self.weights = _Expr(table["weights"])
        self.reserve = {mode: _Expr(text) for mode, text in table["reserve"].items()}
        self.workspace = {mode: _Expr(text) for mode, text in table["workspace"].items()}
        self.dropout_state = _Expr(table["dropout_state"])


@lru_cache(maxsize=None)
def rules() -> _Rules:
    """The compiled rules (read once)."""
    return _Rules(kernels()["rnn"])


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def weight_elements(mode: str, input_size: int, hidden: int, proj: int, layers: int, directions: int) -> int:
    """The flat weight buffer's elements (cudnnGetRNNWeightSpaceSize / element size)."""
    out = proj or hidden
    total = 0
    for layer in range(layers):
        x = input_size if layer == 0 else out * directions
        values = {"G": rules().gates[mode], "H": hidden, "P": out, "X": x, "Q": 1 if proj else 0}
        total += directions * rules().weights(values)
    return total


def _layout(weights: Sequence[torch.Tensor], stride0: int, mode: str, hidden: int, proj: int) -> List[int]:
    """Each weight's element offset in the flat buffer: per layer and direction its matrices, both
    bias vectors (space kept for them without bias: cuDNN's double-bias mode) and the projection."""
    gates = rules().gates[mode] * hidden
    offsets: List[int] = []
    at = 0
    for start in range(0, len(weights), stride0):
        group = weights[start:start + stride0]
        matrices, rest = list(group[:2]), list(group[2:])
        biases = [t for t in rest if t.dim() == 1]
        projection = [t for t in rest if t.dim() == 2]
        for t in matrices:
            offsets.append(at)
            at += t.numel()
        for t in biases:
            offsets.append(at)
            at += t.numel()
        at += (2 - len(biases)) * gates
        for t in projection:
            offsets.append(at)
            at += t.numel()
    return offsets


def _ordered(weights: Sequence[torch.Tensor], stride0: int) -> List[torch.Tensor]:
    """The weights in _layout's order (matrices, biases, projection within each group)."""
    out: List[torch.Tensor] = []
    for start in range(0, len(weights), stride0):
        group = weights[start:start + stride0]
        rest = list(group[2:])
        out += list(group[:2]) + [t for t in rest if t.dim() == 1] + [t for t in rest if t.dim() == 2]
    return out


def _views(buffer: torch.Tensor, weights: Sequence[torch.Tensor], stride0: int, mode: str, hidden: int,
           proj: int) -> List[torch.Tensor]:
    """Views of `buffer` shaped as `weights`, in `weights`' order."""
    ordered = _ordered(weights, stride0)
    offsets = _layout(weights, stride0, mode, hidden, proj)
    where = {id(t): offset for t, offset in zip(ordered, offsets)}
    return [buffer.narrow(0, where[id(t)], t.numel()).view(t.shape) for t in weights]


# -- above autograd: the calls torch.nn's RNN modules make ---------------------------------------


def handles(func: Any) -> bool:
    """Whether `func` is one this module runs as the GPU's cuDNN route."""
    return func is FLATTEN or func in MODES


def call(emulator: Emulator, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run `func` (see handles) as a GPU runs it: cuDNN's route for device tensors, else torch's own."""
    if func is FLATTEN:
        return flatten(func, *args, **kwargs)
    return forward(emulator, MODES[func], func, args, kwargs)


def flatten(func: Any, weight_arr: Sequence[torch.Tensor], weight_stride0: int, input_size: int, mode: int,
            hidden_size: int, proj_size: int, num_layers: int, batch_first: bool, bidirectional: bool) -> Any:
    """torch._cudnn_rnn_flatten_weight: one zeroed flat buffer, the weights copied in, each weight
    now a view of it (their own storages are freed once nothing else holds them)."""
    weights = list(weight_arr)
    if not weights or not _is_meta(weights[0]):
        return func(weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size, num_layers, batch_first,
                    bidirectional)
    name = rules().by_number[int(mode)]
    n = weight_elements(name, int(input_size), int(hidden_size), int(proj_size), int(num_layers),
                        2 if bidirectional else 1)
    buffer = torch.zeros(n, dtype=weights[0].dtype, device=META)
    for weight, view in zip(weights, _views(buffer, weights, int(weight_stride0), name, int(hidden_size),
                                            int(proj_size))):
        view.copy_(weight)
        weight.set_(view)
    return buffer


def _flat_buffer(params: Sequence[torch.Tensor], stride0: int, mode: str, input_size: int, hidden: int,
                 proj: int, layers: int, directions: int) -> Optional[torch.Tensor]:
    """The flat buffer the weights are views of, as try_get_weight_buf finds it; None when they are
    not laid out in one (the forward then copies them into a new one)."""
    n = weight_elements(mode, input_size, hidden, proj, layers, directions)
    first = params[0]
    storage = first.untyped_storage()
    if any(p.untyped_storage()._cdata != storage._cdata or p.dtype != first.dtype for p in params):
        return None
    if storage.nbytes() < n * first.element_size() or not params[-1].is_contiguous():
        return None
    offsets = _layout(params, stride0, mode, hidden, proj)
    if [p.storage_offset() for p in _ordered(params, stride0)] != offsets:
        return None
    return torch.empty(0, dtype=first.dtype, device=META).set_(storage, 0, (n,))


def _dropout_state(emulator: Emulator, dropout: float, train: bool) -> Optional[torch.Tensor]:
    """The dropout state cuDNN keeps for the process, made at the first training forward with
    dropout (after a one-element seed drawn on the device); None until then."""
    if train and dropout > 0 and emulator not in _STATES:
        context = emulator.context
        context.append("_cudnn_init_dropout_state")
        try:
            torch.empty((), dtype=torch.long, device=META)  # the seed, read back and dropped
            _STATES[emulator] = torch.empty(rules().dropout_state({}), dtype=torch.uint8, device=META)
        finally:
            context.pop()
    return _STATES.get(emulator)


def _acceptable(x: torch.Tensor) -> bool:
    """at::cudnn_is_acceptable for an emulated device tensor: cuDNN enabled and the tensor not empty."""
    return _is_meta(x) and bool(torch._C._get_cudnn_enabled()) and x.numel() > 0


def forward(emulator: Emulator, mode: str, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """_VF.lstm / gru / rnn_tanh / rnn_relu, padded or packed, through aten::_cudnn_rnn as on a GPU."""
    packed = isinstance(args[1], torch.Tensor) and (mode == "LSTM" or isinstance(args[2], torch.Tensor))
    if kwargs or len(args) != 9 or not _acceptable(args[0]):
        return func(*args, **kwargs)
    if packed:
        data, batch_sizes, hidden_in, params, has_biases, layers, dropout, train, bidirectional = args
        sizes = [int(b) for b in batch_sizes.tolist()]
        batch_first = False
    else:
        data, hidden_in, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
        sizes = []
    hx, cx = (hidden_in[0], hidden_in[1]) if mode == "LSTM" else (hidden_in, None)
    hidden, proj = int(hx.shape[2]), 0
    if cx is not None and cx.shape[2] != hx.shape[2]:  # an LSTM with projections
        hidden, proj = int(cx.shape[2]), int(hx.shape[2])
    params = list(params)
    stride0 = (4 if has_biases else 2) + (1 if proj else 0)
    directions = 2 if bidirectional else 1
    weight_buf = _flat_buffer(params, stride0, mode, int(data.shape[-1]), hidden, proj, int(layers), directions)
    state = _dropout_state(emulator, float(dropout), bool(train))
    if torch.is_autocast_enabled("cuda"):
        emulator.context.append("_cudnn_rnn")
        try:
            data, params, weight_buf, hx, cx = _autocast(data, params, weight_buf, hx, cx, stride0, mode, hidden, proj,
                                                         int(layers), directions)
        finally:
            emulator.context.pop()
    out = torch.ops.aten._cudnn_rnn.default(data, params, stride0, weight_buf, hx, cx, _cudnn_mode(mode), hidden,
                                            proj, int(layers), bool(batch_first), float(dropout), bool(train),
                                            bool(bidirectional), sizes, state)
    return (out[0], out[1], out[2]) if mode == "LSTM" else (out[0], out[1])


def _eligible(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.is_floating_point() and t.dtype != torch.float64


def _autocast(data: torch.Tensor, params: List[torch.Tensor], weight_buf: Optional[torch.Tensor],
              hx: torch.Tensor, cx: Optional[torch.Tensor], stride0: int, mode: str, hidden: int, proj: int,
              layers: int, directions: int) -> Tuple[Any, ...]:
    """CUDA autocast's wrapper of _cudnn_rnn (aten/src/ATen/cudnn/AutocastRNN.cpp): float16 whatever
    autocast's dtype, the weights copied into a new zeroed float16 flat buffer (copies autograd
    sees, so their backward casts each gradient back), input, hx and cx cast."""
    half = torch.float16
    source = weight_buf if weight_buf is not None else params[0]
    if _eligible(source) and source.dtype != half:
        n = weight_elements(mode, int(data.shape[-1]), hidden, proj, layers, directions)
        weight_buf = torch.zeros(n, dtype=half, device=META)
        storage = weight_buf.untyped_storage()
        ordered = _ordered(params, stride0)
        where = {id(t): offset for t, offset in zip(ordered, _layout(params, stride0, mode, hidden, proj))}
        copies = []
        for weight in params:
            # set_ as cuDNN's get_parameters does: sharing the buffer's storage, not an autograd view of it
            view = torch.empty(0, dtype=half, device=META).set_(storage, where[id(weight)], weight.shape)
            copies.append(view.copy_(weight))
        params = copies

    def cast(t: Optional[torch.Tensor]) -> Any:
        return t.to(half) if t is not None and _eligible(t) and t.dtype != half else t
    return cast(data), params, weight_buf, cast(hx), cast(cx)


# -- below autograd: the kernels, as the allocator sees them ---------------------------------------


class _Call:
    """An op's arguments by name, and the sizes cuDNN's kernels work on."""

    def __init__(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        names = [a.name for a in func._schema.arguments]
        self.arg: Dict[str, Any] = dict(zip(names, args))
        self.arg.update(kwargs)
        a = self.arg
        self.mode = rules().by_number[int(a["mode"])]
        self.input: torch.Tensor = a["input"]
        self.hidden, self.proj = int(a["hidden_size"]), int(a["proj_size"])
        self.out = self.proj or self.hidden
        self.layers = int(a["num_layers"])
        self.directions = 2 if a["bidirectional"] else 1
        self.batch_sizes = [int(b) for b in a["batch_sizes"]]
        self.packed = bool(self.batch_sizes)
        self.batch_first = bool(a["batch_first"]) and not self.packed
        if self.packed:
            self.batch, self.tokens = self.batch_sizes[0], int(self.input.shape[0])
            self.seq_shape: List[int] = [self.tokens]
        else:
            steps, batch = self.input.shape[:2]
            if self.batch_first:
                steps, batch = batch, steps
            self.batch, self.tokens = int(batch), int(steps) * int(batch)
            self.seq_shape = [int(steps), int(batch)]
        self.element = self.input.element_size()

    def values(self, train: bool) -> Dict[str, int]:
        """The names kernels.json's rnn sizes are written in."""
        dropout = 1 if train and float(self.arg["dropout"]) > 0 else 0
        return {"N": self.tokens, "H": self.hidden, "P": self.out, "I": int(self.input.shape[-1]), "L": self.layers,
                "D": self.directions, "R": dropout, "E": self.element}

    def seq_major(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the kernel reads it: sequence first."""
        return t.transpose(0, 1) if self.batch_first else t

    def workspace(self, train: bool) -> int:
        return int(rules().workspace[self.mode](self.values(train)))


class _Buffers:
    """The op's own device memory in the order the kernel makes it: outputs (kept while torch keeps
    them) and temporaries (freed when the kernel returns, last made first freed)."""

    def __init__(self, emulator: Emulator, name: str) -> None:
        self.emulator, self.name = emulator, name
        self.temporaries: List[Any] = []

    def output(self, shape: Sequence[int], dtype: torch.dtype, zeros: bool = False) -> torch.Tensor:
        t = torch.empty(list(shape), dtype=dtype, device=META)
        if t.untyped_storage().nbytes():
            self.emulator.track(t.untyped_storage(), self.name, ("zeros",) if zeros else EMPTY)
        return t

    def temporary(self, nbytes: int, inner: Sequence[str] = EMPTY) -> None:
        if nbytes > 0:
            index = self.emulator.placement.current()
            self.temporaries.append((self.emulator.allocate(nbytes, self.emulator.frames(self.name, inner), index),
                                     index))

    def copy(self, t: Optional[torch.Tensor]) -> None:
        """`.contiguous()` of `t`: a temporary copy where it is not contiguous."""
        if t is not None and not t.is_contiguous():
            self.temporary(t.numel() * t.element_size(), ("clone",))

    def release(self) -> None:
        """The kernel returns: its temporaries are freed, the last made first."""
        while self.temporaries:
            self.emulator.release(*self.temporaries.pop())


def cudnn_rnn(emulator: Emulator, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """aten::_cudnn_rnn: output, hy, cy, a workspace, the reserve (training) and, when the weights
    are not one flat buffer, a new one they are copied into (autograd keeps it for the backward)."""
    c = _Call(func, args, kwargs)
    a = c.arg
    hx, cx, train = a["hx"], a["cx"], bool(a["train"])
    buffers = _Buffers(emulator, op_name(func))
    buffers.copy(c.seq_major(c.input))
    output = buffers.output(c.seq_shape + [c.out * c.directions], c.input.dtype)
    hy = buffers.output([c.layers * c.directions, c.batch, c.out], hx.dtype)
    cy = buffers.output([c.layers * c.directions, c.batch, c.hidden] if cx is not None else [0], hx.dtype)
    weight_buf = a["weight_buf"]
    if weight_buf is None:
        n = weight_elements(c.mode, int(c.input.shape[-1]), c.hidden, c.proj, c.layers, c.directions)
        weight_buf = buffers.output([n], c.input.dtype)
    buffers.temporary(c.workspace(train))
    reserve_bytes = int(rules().reserve[c.mode](c.values(train))) if train else 0
    reserve = buffers.output([reserve_bytes], torch.uint8)
    buffers.release()
    if c.batch_first:
        output = output.transpose(0, 1)
    return output, hy, cy, reserve, weight_buf


def cudnn_rnn_backward(emulator: Emulator, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """aten::_cudnn_rnn_backward: zeros for the gradients autograd left undefined, then the data
    backward (dx, dhx, dcx, a workspace) and the weights' (one zeroed flat dw, a workspace, the
    gradients as views of dw, or copied out of it when the weights have no bias)."""
    c = _Call(func, args, kwargs)
    a = c.arg
    weights: List[torch.Tensor] = list(a["weight"])
    hx, cx, output = a["hx"], a["cx"], a["output"]
    grad_output, grad_hy, grad_cy = a["grad_output"], a["grad_hy"], a["grad_cy"]
    if grad_output is None and grad_hy is None and grad_cy is None:
        return None, None, None, [None] * len(weights)
    name = op_name(func)
    outer = _Buffers(emulator, name)  # the zeros standing in for undefined gradients, freed at the end
    if grad_output is None:
        outer.temporary(output.numel() * output.element_size(), ("zeros_like",))
        grad_output = torch.empty(output.shape, dtype=output.dtype, device=META)
    if grad_hy is None:
        outer.temporary(hx.numel() * hx.element_size(), ("zeros_like",))
    if cx is not None and grad_cy is None:
        outer.temporary(cx.numel() * cx.element_size(), ("zeros_like",))
    data = _Buffers(emulator, name)
    data.copy(c.seq_major(c.input))
    data.copy(c.seq_major(grad_output))
    for grad in (grad_hy, grad_cy):
        data.copy(grad)
    dx = data.output(c.seq_shape + [int(c.input.shape[-1])], c.input.dtype)
    dhx = data.output([c.layers * c.directions, c.batch, c.out], hx.dtype)
    dcx = data.output([c.layers * c.directions, c.batch, c.hidden], cx.dtype) if cx is not None else None
    data.temporary(c.workspace(True))
    data.release()
    grads: List[Any] = []
    if a["output_mask"][3]:
        grads = _weight_grads(emulator, name, c, weights, a["weight_buf"], int(a["weight_stride0"]))
    outer.release()
    if c.batch_first:
        dx = dx.transpose(0, 1)
    return dx, dhx, dcx, grads


def _weight_grads(emulator: Emulator, name: str, c: _Call, weights: List[torch.Tensor], weight_buf: torch.Tensor,
                  stride0: int) -> List[torch.Tensor]:
    """_cudnn_rnn_backward_weight: dw is a zeroed copy of the flat buffer; cuDNN's own layout holds
    every bias, so only weights with biases line up with it and get views of dw (dw then lives as
    long as any gradient does); without bias each gradient is its own tensor, copied out of dw."""
    buffers = _Buffers(emulator, name)
    buffers.copy(c.seq_major(c.input))
    views = stride0 == 4 + (1 if c.proj else 0)
    if views:
        dw = buffers.output([weight_buf.numel()], weight_buf.dtype, zeros=True)
    else:
        buffers.temporary(weight_buf.numel() * weight_buf.element_size(), ("zeros",))
    buffers.temporary(c.workspace(True))
    if views:
        buffers.release()
        return _views(dw, weights, stride0, c.mode, c.hidden, c.proj)
    grads = [buffers.output(w.shape, w.dtype) for w in weights]
    buffers.release()
    return grads


KERNELS: Dict[str, Callable[[Emulator, Any, Tuple[Any, ...], Dict[str, Any]], Any]] = {
    "_cudnn_rnn": cudnn_rnn, "_cudnn_rnn_backward": cudnn_rnn_backward}


def _is_acceptable(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """torch.backends.cudnn.is_acceptable answering for the emulated GPU as a GPU's cuDNN would:
    cuDNN is there (the CPU build has none) and takes half, float and double."""

    def is_acceptable(tensor: Any) -> bool:
        with torch._C.DisableTorchFunction():  # the device mode says an emulated tensor is not meta
            emulated = _is_meta(tensor)
        if not emulated:
            return original(tensor)
        return bool(torch._C._get_cudnn_enabled()) and tensor.dtype in (torch.half, torch.float, torch.double)
    return is_acceptable


def _cudnn_mode(mode: str) -> int:
    """torch.backends.cudnn.rnn.get_cudnn_mode: cuDNN's number for a mode (the CPU build has no
    cuDNN enum to read it from)."""
    for number, name in rules().by_number.items():
        if name == mode:
            return number
    raise ValueError(f"Unknown mode: {mode}")


@contextlib.contextmanager
def cudnn_answers() -> Iterator[None]:
    """What RNNBase asks before flattening its weights, answered as on a GPU for the block: whether
    cuDNN takes a device tensor, whether to flatten at all and cuDNN's number for the mode (the
    CPU build has no cuDNN to say yes or give the number)."""
    import torch.backends.cudnn as cudnn
    import torch.backends.cudnn.rnn as cudnn_rnn

    acceptable, use_flatten = cudnn.is_acceptable, torch._use_cudnn_rnn_flatten_weight
    get_mode = cudnn_rnn.get_cudnn_mode
    cudnn.is_acceptable = _is_acceptable(acceptable)
    cudnn_rnn.get_cudnn_mode = _cudnn_mode
    setattr(torch, "_use_cudnn_rnn_flatten_weight", lambda: True)  # noqa: B010 (mypy: torch is Any-typed)
    try:
        yield
    finally:
        cudnn.is_acceptable = acceptable
        cudnn_rnn.get_cudnn_mode = get_mode
        setattr(torch, "_use_cudnn_rnn_flatten_weight", use_flatten)  # noqa: B010
