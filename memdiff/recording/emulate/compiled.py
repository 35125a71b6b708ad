"""torch.compile under emulation: Inductor's own memory plan, not the eager model's.

A GPU run of a compiled model allocates what Inductor's generated wrapper code allocates: one
buffer per kernel output that survives fusion, reused and freed where Inductor's memory planning
says (`buf3 = buf0; del buf0  # reuse`), the activations AOTAutograd's partitioner
(min-cut rematerialisation) saves between the forward and the backward, and the outputs of the ops
Inductor leaves to ATen (matrix products into its buffers, attention). The emulator gets that plan
from Inductor itself and runs it:

- Dynamo traces the script's model on the emulator's meta tensors, and AOTAutograd partitions the
  joint graph there (torch's own passes, decompositions and partitioner), with the emulator's modes
  off: Dynamo does not trace under a dispatch mode;
- each partitioned graph (forward, backward) is moved to the `cuda` device on fake tensors and
  lowered by Inductor for CUDA: its scheduler fuses and plans the buffers, and writes the wrapper
  code with its Triton kernels, which this machine has no compiler for;
- the wrapper's `call` then runs with the emulator's modes on: its `empty_strided_cuda` buffers are
  allocations of the emulated GPU, its `del` lines free them, the ATen ops it calls allocate as
  they do eagerly (with their kernels' buffers), and the Triton kernels are launches that write
  nothing (no values are computed anywhere in emulation).

What it cannot take (another backend, CUDA graphs' `reduce-overhead`, a compile that fails on fake
CUDA tensors) runs eagerly, noted: `compile` says which route ran.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import re
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _pop_mode, _push_mode
from torch.utils._pytree import tree_leaves

from memdiff.recording.emulate import autotune, flex, swap
from memdiff.recording.emulate.devices import names_cuda
from memdiff.recording.emulate.runtime import Emulator
from memdiff.recording.emulate.values import forget_written

INDUCTOR_NOTE = ("torch.compile ran Inductor's memory plan: Dynamo and AOTAutograd traced on the emulated GPU, "
                 "Inductor fused and planned its buffers for CUDA, and its wrapper code ran with its Triton kernels "
                 "as launches that write nothing")
EAGER_NOTE = ("torch.compile runs eagerly ({why}): Inductor's fused kernels and buffers are not emulated, so "
              "activations read as the uncompiled model's")
# Modes of torch.compile the emulator lowers with Inductor; the others capture CUDA graphs.
PLANNED_MODES = (None, "default", "max-autotune-no-cudagraphs")


@contextlib.contextmanager
def _modes_off() -> Iterator[Tuple[List[Any], List[Any]]]:
    """Every torch function and dispatch mode popped (Dynamo skips a frame run under a dispatch
    mode), given back in their order at the end; yields them for `_modes_on`."""
    functions: List[Any] = []
    dispatches: List[Any] = []
    while torch._C._len_torch_function_stack():
        functions.append(torch._C._pop_torch_function_stack())
    while torch._C._len_torch_dispatch_stack():
        dispatches.append(_pop_mode())
    try:
        yield functions, dispatches
    finally:
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)
        for mode in reversed(dispatches):
            _push_mode(mode)


@contextlib.contextmanager
def _modes_on(saved: Tuple[List[Any], List[Any]]) -> Iterator[None]:
    """The modes `_modes_off` popped, pushed again for the block."""
    functions, dispatches = saved
    for mode in reversed(functions):
        torch._C._push_on_torch_function_stack(mode)
    for mode in reversed(dispatches):
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in dispatches:
            _pop_mode()
        for _ in functions:
            torch._C._pop_torch_function_stack()


@contextlib.contextmanager
def _meta_tensors_as_constants() -> Iterator[None]:
    """Fake tensor modes taking real meta tensors as inputs: the model's own `torch.tensor([],
    device=x.device)` is a real (meta) tensor here, as the emulator runs on the meta device, where on
    a GPU it would be a fake tensor of the trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    init = FakeTensorMode.__init__

    def made(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "allow_non_fake_inputs": True})
    with swap.replaced([(FakeTensorMode, "__init__", made)]):
        yield


@contextlib.contextmanager
def _cuda_factories_as_meta(planner: "Planner") -> Iterator[None]:
    """While Dynamo and AOTAutograd trace (not while Inductor lowers for `cuda:0`), a tensor the traced
    code makes on the GPU by name (`torch.arange(n, device="cuda")`, a mask built inside a compiled
    `create_block_mask`) is a fake tensor on the meta device, as the script's own tensors are there: on
    `cuda` it met them as another device ("Tensor device mismatch"). The graph keeps the op's `cuda`,
    which Inductor lowers as the GPU's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatch = FakeTensorMode.__torch_dispatch__

    def dispatched(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not planner.lowering and names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("meta")}
        return dispatch(self, func, types, args, kwargs)
    with swap.replaced([(FakeTensorMode, "__torch_dispatch__", dispatched)]):
        yield


@contextlib.contextmanager
def _flex_on_meta_as_on_cuda() -> Iterator[None]:
    """flex_attention traced by Dynamo on the emulator's meta tensors passes its device check as on
    the GPU: it refused the meta device ("FlexAttention is only supported on CUDA, CPU, HPU, or MPS
    devices"), which stopped a compiled model whose attention is FlexAttention (torchtitan's blocks)."""
    try:
        flex_module = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:  # a torch without FlexAttention
        yield
        return
    check = getattr(flex_module, "_validate_device", None)
    if check is None:
        yield
        return

    def validated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if not query.is_meta:
            check(query, key, value)
    with swap.replaced([(flex_module, "_validate_device", validated)]):
        yield


def _seeded_on_cuda(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.rand/randn/randint as Inductor's random ops' shape functions call them on fake `cuda`
    tensors: a tensor of the shape (a CPU build has no CUDA generator to draw from, and what a compiled
    graph's kernels write has no values in emulation)."""
    @functools.wraps(factory)
    def drawn(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is None or torch.device(device).type != "cuda":
            return factory(*args, **kwargs)
        size = kwargs.get("size", args[-1] if args else ())
        dtype = kwargs.get("dtype") or (torch.int64 if factory.__name__ == "randint" else torch.float32)
        return torch.empty(size, dtype=dtype, device=device)
    return drawn


def _on_the_host(lazy_init: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's joint-graph pattern tables built on the host, whatever device the caller names:
    they are made by running ops on that device, which is the meta device here. The caller passes its
    device positionally, which `functools.partial(lazy_init, cpu)` added to the host's: torch
    versions whose `init_once_fakemode` forwards its arguments as given refused the two ("lazy_init()
    takes from 0 to 1 positional arguments but 2 were given") and every compile fell back to eager."""
    def built(*args: Any, **kwargs: Any) -> Any:
        return lazy_init(torch.device("cpu"))
    return built


def _meta_as_cuda(check: Callable[..., bool]) -> Callable[..., bool]:
    """Inductor's check whether it can read a tensor, a meta tensor taken as the GPU's."""
    def supported(t: torch.Tensor, node: Any = None) -> bool:
        if t.is_meta and not t.is_complex() and not t.is_sparse:
            return False
        return check(t, node)
    return supported


def _scatter_checked_on_meta(scatter: Callable[..., Any]) -> Callable[..., Any]:
    """The reinplace pass's fake run of a view scatter (a slice's gradient, as a rotary embedding's
    `rotate_half` makes in the backward) copies into a view of the input, which takes its device's
    guard: a CPU build has none for `cuda`. On the emulated GPU's tensors the copy is checked on
    the meta device, where it checks the same shapes, and the input, all the pass reads of the
    result, is given back."""
    def checked(inp: torch.Tensor, src: torch.Tensor, view_ops: Any) -> torch.Tensor:
        if inp.device.type != "cuda":
            return scatter(inp, src, view_ops)
        scatter(inp.to("meta"), src.to("meta"), view_ops)
        return inp
    return checked


@contextlib.contextmanager
def _composites_as_on_the_gpu() -> Iterator[None]:
    """Ops made of others (CompositeImplicitAutograd: `nll_loss`) run as their parts while Dynamo and
    AOTAutograd trace, as on a GPU. torch registers their Python decompositions as meta kernels too,
    which the Python dispatcher (on while tracing) runs whole on the meta device, where autograd has
    no formula for them: the loss they make came back without its gradient."""
    from torch._decomp import global_decomposition_table

    meta = torch._C.DispatchKey.Meta
    taken: List[Tuple[Any, Any]] = []
    for table in ("meta", "post_autograd", "pre_autograd"):
        for op in global_decomposition_table[table]:
            if isinstance(op, torch._ops.OpOverload) and meta in op.py_kernels and \
                    torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
                taken.append((op, op.py_kernels.pop(meta)))
                op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in taken:
            op.py_kernels[meta] = kernel
            op._dispatch_cache.clear()


class _Kernel:
    """A Triton kernel of the wrapper code: launched, it writes nothing (emulation computes no values),
    so what it writes has no value known any more; its first launch allocates what Inductor's
    autotuning of it does (autotune.py)."""

    def __init__(self, first: Optional[Callable[[Sequence[Any]], None]] = None,
                 written: Tuple[int, ...] = ()) -> None:
        self._first = first
        self._written = written

    def run(self, *args: Any, **kwargs: Any) -> None:
        """A launch: nothing to write, but the autotuning's buffers the first time."""
        first, self._first = self._first, None
        if first is not None:
            first(args)
        if self._written:
            forget_written([args[i] for i in self._written if i < len(args)])

    def __getattr__(self, name: str) -> Any:
        # grid helpers and autotuning attributes the wrapper may read
        return _Kernel()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """A call of a kernel's helper: nothing to do."""


def _written(source: str) -> Tuple[int, ...]:
    """The positions of the arguments a generated Triton kernel writes: Inductor names its
    parameters `in_ptr*` (read), `out_ptr*` and `in_out_ptr*` (written)."""
    found = re.search(r"^def \w+\(([^)]*)\)", source, re.MULTILINE)
    if found is None:
        return ()
    names = [p.split(":")[0].strip() for p in found.group(1).split(",")]
    return tuple(i for i, name in enumerate(names) if name.startswith(("out_ptr", "in_out_ptr")))



def _triton_stand_in() -> Dict[str, types.ModuleType]:
    """The `triton` modules the wrapper code imports at its top (its kernels are never built here)."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    setattr(triton, "language", language)  # noqa: B010
    return {"triton": triton, "triton.language": language}


class Planner:
    """Runs a script's torch.compile as Inductor plans it on the emulated GPU (module docstring)."""

    def __init__(self, emulator: Emulator, original: Callable[..., Any]) -> None:
        self.emulator = emulator
        self.original = original
        self.saved: Optional[Tuple[List[Any], List[Any]]] = None  # the modes popped while Dynamo runs
        self.padding = autotune.PadBench(emulator)
        self.traced = False  # Dynamo traced a graph during the call now running
        self.lowering = False  # Inductor lowers a partitioned graph for `cuda:0` (on fake GPU tensors)

    # -- torch.compile -----------------------------------------------------------------------------

    def compile(self, model: Any = None, **kwargs: Any) -> Any:
        """torch.compile(model, ...) on the emulated GPU; used as a decorator when `model` is None."""
        if model is None:
            return lambda m: self.compile(m, **kwargs)
        why = self._refusal(kwargs)
        if why:
            self.emulator.note(EAGER_NOTE.format(why=why))
            # Inductor compiles it on the GPU (another backend does not: torch's own eager
            # flex_attention compiles with backend="eager")
            if kwargs.get("backend", "inductor") != "inductor" or not callable(model):
                return model
            if isinstance(model, torch.nn.Module):
                # its calls, hooks included, as `Module.compile` routes them: FlexAttention inside
                # it was taken for an eager call (the dense scores) while a compiled function's was not
                model._compiled_call_impl = _fused_as_compiled(model._call_impl)
                return model
            return functools.wraps(model)(_fused_as_compiled(model))
        owner = getattr(model, "__self__", None)
        if isinstance(owner, torch.nn.Module) and getattr(model, "__func__", None) is torch.nn.Module._call_impl:
            # `Module.compile`: its forward is planned, its hooks run as they are called. On the GPU
            # Dynamo runs the hooks it may not trace (FSDP2's all-gathers and reshards, disabled for
            # it) eagerly too; here they ran inside the compiled call with the emulator's modes off,
            # and FSDP2's `empty(device="cuda")` reached the CPU build's CUDA backend.
            owner.forward = self.compile(owner.forward, **kwargs)
            return model
        options = {k: v for k, v in kwargs.items() if k in ("fullgraph", "disable")}
        compiled = self.original(model, backend=self._backend, dynamic=False, **options)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # Dynamo runs DDP's own forward eagerly (torch.nn.parallel is in its skip list: the
            # inputs' move to the GPU, the buffers' broadcast, the reducer's preparation) and compiles
            # the wrapped module's forward, which DDPOptimizer splits at the buckets. Here DDP's
            # forward ran inside the compiled call with the emulator's modes off, and its first
            # `.to(device)` or broadcast reached the CPU build's CUDA; now it runs on the emulated GPU
            # and only the wrapped forward is compiled, in the same OptimizedModule the script holds.
            model.module.forward = self.compile(model.module.forward, **kwargs)
            compiled.forward = model.__call__
            return compiled
        if isinstance(model, torch.nn.Module):
            compiled.forward = self._outside_modes(compiled.forward)
            return compiled
        return functools.wraps(model)(self._outside_modes(compiled))

    @staticmethod
    def _refusal(kwargs: Dict[str, Any]) -> str:
        backend = kwargs.get("backend", "inductor")
        if backend != "inductor":
            return f"backend {backend!r} is not Inductor"
        if kwargs.get("mode") not in PLANNED_MODES:
            return f"mode {kwargs.get('mode')!r} captures CUDA graphs, which are not emulated"
        if kwargs.get("options"):
            return "Inductor options are not emulated"
        if kwargs.get("dynamic"):
            return "dynamic shapes are not emulated"
        return ""

    def _outside_modes(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def outside(*args: Any, **kwargs: Any) -> Any:
            if self.saved is not None:  # a compiled call inside a compiled call: already outside
                return call(*args, **kwargs)
            with _modes_off() as saved, _meta_tensors_as_constants(), self._attention_as_on_the_gpu(), \
                    _composites_as_on_the_gpu(), _cuda_factories_as_meta(self), _flex_on_meta_as_on_cuda():
                self.saved = saved
                self.emulator.modes_off = True
                try:
                    return call(*args, **kwargs)
                finally:
                    self.saved = None
                    self.emulator.modes_off = False
                    if self.traced:
                        # Dynamo's tracing state (its variable trackers) holds the traced call's
                        # real outputs (a model's logits, its KV cache) in reference cycles until
                        # Python's collector runs; the real gpt2-compile window starts with only
                        # the weights and workspaces live, so they are collected here, once per compile.
                        self.traced = False
                        gc.collect()
        return outside

    @contextlib.contextmanager
    def _attention_as_on_the_gpu(self) -> Iterator[None]:
        """F.scaled_dot_product_attention traced as the kernel the emulated GPU picks (the device
        mode's choice): on the meta device, with the modes off, it would decompose to the math
        attention, whose score matrices a GPU's compiled model never allocates."""
        import torch.nn.functional as F

        original = F.scaled_dot_product_attention
        device_mode = self.emulator.device_mode

        def attention(*args: Any, **kwargs: Any) -> Any:
            return device_mode.attention(original, args, kwargs)
        # one node of Dynamo's graph, which AOTAutograd traces through: the device mode's Python is
        # not Dynamo's to trace (it would break the graph at every attention)
        setattr(F, "scaled_dot_product_attention", torch._dynamo.allow_in_graph(attention))  # noqa: B010
        try:
            yield
        finally:
            setattr(F, "scaled_dot_product_attention", original)  # noqa: B010

    # -- Dynamo's backend --------------------------------------------------------------------------

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        """Inductor's compile_fx (AOTAutograd's partitioner included) with each partitioned graph
        lowered for CUDA."""
        import torch._functorch.config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        self.traced = True
        kept = copy.deepcopy(gm)  # compile_fx changes the graph it is given: this one runs eagerly if need be
        _autocast_as_on_the_gpu(gm)
        try:
            # the backward graph lowered now, not at the first backward: a failure is caught here
            with self._inductor_on_this_machine(), functorch_config.patch(force_non_lazy_backward_lowering=True), \
                    _aot_marks_undone_on_failure():
                compiled = compile_fx(gm, example_inputs, inner_compile=self._inner)
        except Exception as exc:  # Inductor's own failure on this machine: the graph runs eagerly, noted
            said = str(exc).strip().splitlines()
            self.emulator.note(EAGER_NOTE.format(why=f"Inductor could not plan it here: "
                                                     f"{said[0][:200] if said else type(exc).__name__}"))
            return self._eager(kept)
        return self._checked(kept, compiled)

    def _checked(self, gm: torch.fx.GraphModule, compiled: Any) -> Callable[..., Any]:
        """The compiled graph, run eagerly from the first call whose outputs lost the gradient Dynamo's
        trace gave them (AOTAutograd marks some outputs of graphs traced on the meta device as not
        differentiable: a loss after a graph break, as Hugging Face's models compute it), which would
        end the script's backward."""
        output = next(n for n in gm.graph.nodes if n.op == "output")
        values = [getattr(n, "meta", {}).get("example_value") for n in tree_leaves(output.args[0])]
        wanted = [isinstance(v, torch.Tensor) and v.requires_grad for v in values]
        eager = self._eager(gm)
        lost = [False]

        def run(*args: Any) -> Any:
            if lost[0]:
                return eager(*args)
            out = compiled(*args)
            got = tree_leaves(out)
            if torch.is_grad_enabled() and len(got) == len(wanted) and any(
                    w and isinstance(o, torch.Tensor) and not o.requires_grad for w, o in zip(wanted, got)):
                lost[0] = True
                self.emulator.note(EAGER_NOTE.format(why="a graph whose output lost its gradient under "
                                                         "AOTAutograd on the meta device"))
                del out, got
                return eager(*args)
            return out
        return run

    def _eager(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        """Dynamo's graph run as its ops, with the emulator's modes on; its FlexAttention as the
        fused kernels Inductor makes of it on the GPU."""
        @_fused_as_compiled
        def eager(*args: Any) -> Any:
            if self.saved is None:
                return gm(*args)
            self.emulator.modes_off = False
            try:
                with _modes_on(self.saved):
                    return gm(*args)
            finally:
                self.emulator.modes_off = True
        return eager

    def _inner(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        """One partitioned graph (AOTAutograd's forward or backward, on meta tensors) lowered by
        Inductor for CUDA; its wrapper's `call` runs on the emulated GPU."""
        from torch._inductor.compile_fx import compile_fx_inner

        # AOTAutograd compiles the backward graph at the first backward, with the modes on
        with contextlib.ExitStack() as stack:
            if self.saved is None:
                stack.enter_context(_modes_off())
                stack.enter_context(self._flag_modes_off())
            lowering, self.lowering = self.lowering, True
            try:
                inputs = _on_cuda(gm, example_inputs)
                kwargs["cudagraphs"] = None
                with self._inductor_on_this_machine(), self._wrapper_loads():
                    out = compile_fx_inner(gm, inputs, **kwargs)
            finally:
                self.lowering = lowering
        self.emulator.note(INDUCTOR_NOTE)
        # an OutputCode whose `current_callable` is the wrapper's `call`; a graph with nothing to
        # lower comes back as a plain function
        boxed = hasattr(out, "current_callable")
        call = out.current_callable if boxed else out
        planner = self

        def run(args: List[Any]) -> Any:
            guard, set_device = torch.cuda._DeviceGuard, torch.cuda.set_device
            torch.cuda._DeviceGuard = _DeviceGuard
            # The wrapper's `torch.cuda.set_device(0)` names the GPU Inductor planned on (cuda:0, as
            # every graph is lowered here); on a GPU it names the graph's own: rank 1's buffers and
            # its current GPU stayed on cuda:0 after a compiled call.
            placement = planner.emulator.placement
            gpu = next((placement.tensor_index(a) for a in args if isinstance(a, torch.Tensor) and a.is_meta),
                       placement.current())
            torch.cuda.set_device = lambda device: placement.set_current(gpu)
            try:
                if planner.saved is None:  # the backward, run by autograd's engine with the modes on
                    return call(args)
                planner.emulator.modes_off = False
                try:
                    with _modes_on(planner.saved):
                        return call(args)
                finally:
                    planner.emulator.modes_off = True
            finally:
                torch.cuda._DeviceGuard, torch.cuda.set_device = guard, set_device
        if not boxed:
            run._boxed_call = True  # type: ignore[attr-defined]
            return run
        out.current_callable = run
        return out

    @contextlib.contextmanager
    def _flag_modes_off(self) -> Iterator[None]:
        self.emulator.modes_off = True
        try:
            yield
        finally:
            self.emulator.modes_off = False

    @contextlib.contextmanager
    def _inductor_on_this_machine(self) -> Iterator[None]:
        """Inductor's CUDA lowering on a machine with no Triton: its checks answered as on the GPU,
        its pattern tables traced on the host (they are made by running ops on the input's device),
        no caches or compile workers (the stand-in kernels must not outlive the run)."""
        import torch._inductor.config as config
        import torch._inductor.fx_passes.joint_graph as joint_graph
        import torch._inductor.lowering as lowering
        import torch._inductor.scheduler as scheduler
        import torch.utils._triton as triton_utils
        from torch._dynamo import device_interface

        gpu = self.emulator.gpu
        cuda = device_interface.CudaInterface
        patches: List[Tuple[Any, str, Any]] = [
            (scheduler, "has_triton", lambda: True),
            (triton_utils, "has_triton", lambda: True),
            (triton_utils, "triton_hash_with_backend", lambda: "emulated"),
            (joint_graph, "lazy_init", _on_the_host(joint_graph.lazy_init)),
            # the pattern passes on the joint graph (random ops made Inductor's, fused patterns)
            # skip nodes on the meta device, where the emulator traced them
            (lowering, "unsupported_input_tensor", _meta_as_cuda(lowering.unsupported_input_tensor)),
            (cuda, "get_device_properties", staticmethod(lambda device=None: torch.cuda.get_device_properties())),
            (cuda, "get_compute_capability", staticmethod(lambda device=None: gpu.major * 10 + gpu.minor)),
            (cuda, "is_available", staticmethod(lambda: True)),
            (cuda, "current_device", staticmethod(lambda: 0)),
            (cuda, "device_count", staticmethod(lambda: 1)),
        ]
        # shape padding's benchmark of misaligned products, with real tensors on the GPU (autotune.py)
        import torch._inductor.fx_passes.pad_mm as pad_mm
        patches.append((pad_mm, "_should_pad", self.padding.should_pad))
        patches.append((pad_mm, "check_device", lambda a, b: a.is_meta and b.is_meta))  # as the GPU's
        import torch._inductor.fx_passes.reinplace as reinplace
        checked = _scatter_checked_on_meta(reinplace._inplace_generalized_scatter)
        patches.append((reinplace, "_inplace_generalized_scatter", checked))
        # ...and the pass's table of in-place forms names the same function, which the scatters'
        # decomposition then finds: it looked for the stand-in, found the reinplaced nodes under the
        # original and left them, and the regenerated graph failed ("SyntaxError: invalid syntax")
        # wherever a view scatter was made in place (a QR's backward, `diagonal` of its gradient)
        table = dict(reinplace.inplaceable_ops)
        scatter = reinplace._generalized_scatter
        table[scatter] = dataclasses.replace(table[scatter], inplace_op=checked)
        patches.append((reinplace, "inplaceable_ops", table))
        # indexing a tensor in Python takes its device's guard, which a CPU build has none of for `cuda`
        lookup = torch.ops.prims.inductor_lookup_seed.default
        patches.append((lookup, "prim_meta_impl",
                        lambda seeds, index: torch.empty([], dtype=seeds.dtype, device=seeds.device)))
        patches.append((torch.Tensor, "__invert__", lambda self: torch.bitwise_not(self)))  # its binding too
        for name in ("rand", "randn", "randint"):
            patches.append((torch, name, _seeded_on_cuda(getattr(torch, name))))
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "") or ""
            if name.startswith("torch._inductor") and callable(getattr(module, "has_triton", None)):
                patches.append((module, "has_triton", lambda: True))
        settings = {"fx_graph_cache": False, "fx_graph_remote_cache": False, "compile_threads": 1,
                    "autotune_local_cache": False, "autotune_remote_cache": False,
                    "triton.cudagraphs": False, "joint_graph_constant_folding": False}
        with swap.replaced(patches), config.patch(settings):
            yield

    def _kernel(self, source: str) -> _Kernel:
        """A Triton kernel of the wrapper, its first launch autotuned as on the GPU (autotune.py)."""
        tuning = autotune.plan(source)
        written = _written(source)
        if tuning is None or tuning.configs <= 1:
            return _Kernel(written=written)
        return _Kernel(lambda args: autotune.benchmark(self.emulator, tuning, args), written)

    @contextlib.contextmanager
    def _wrapper_loads(self) -> Iterator[None]:
        """The wrapper module's top level runs here: its `import triton`, stream and kernel builds
        answered by stand-ins, its `empty_strided_cuda` an allocation of the emulated GPU."""
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import PyCodeCache

        planner = self

        load = PyCodeCache.__dict__["load_by_key_path"]

        def loading(*args: Any, **kwargs: Any) -> Any:
            # only while the module loads: Inductor's codegen asks whether `triton` is installed
            stand_ins = _triton_stand_in()
            missing = [name for name in stand_ins if name not in sys.modules]
            sys.modules.update({name: stand_ins[name] for name in missing})
            try:
                return load.__func__(PyCodeCache, *args, **kwargs)
            finally:
                for name in missing:
                    sys.modules.pop(name, None)
        setattr(PyCodeCache, "load_by_key_path", classmethod(lambda cls, *a, **k: loading(*a, **k)))  # noqa: B010
        guards = torch._C._dynamo.guards
        empty = guards._empty_strided_cuda
        triton = AsyncCompile.triton
        setattr(AsyncCompile, "triton", lambda self, name, source, device_str="cuda": planner._kernel(source))  # noqa: B010
        guards._empty_strided_cuda = _empty_strided_cuda
        # The wrapper binds `get_raw_stream` as it loads: a CPU build has no such function, and a CUDA
        # build's asks the driver for the current stream, which stopped every compiled run on the
        # default wheel ("CUDA driver version is insufficient"); on both builds it is the stand-in.
        try:
            with swap.replaced([(torch._C, "_cuda_getCurrentRawStream", lambda device=0: 0)]):
                yield
        finally:
            guards._empty_strided_cuda = empty
            setattr(AsyncCompile, "triton", triton)  # noqa: B010
            setattr(PyCodeCache, "load_by_key_path", load)  # noqa: B010


@contextlib.contextmanager
def _aot_marks_undone_on_failure() -> Iterator[None]:
    """A compile that fails leaves no mark of AOTAutograd: its count of compiled graphs and the forward
    metadata it put on Dynamo's tracing context are set back. Dynamo's DDPOptimizer (a DDP model's
    graph split at its gradient buckets, each bucket's part compiled alone) reads the count to tell
    whether a part went through AOTAutograd, and if it did, takes that part's metadata and calls it on
    fake tensors for the next part's inputs; a part that fell back to eager after AOTAutograd began
    was taken for AOTAutograd's ("AssertionError: fw_metadata must not be None, While executing
    %submod_0 ... compiled_submod_0") and the rank died. With the marks undone it is run as DDPOptimizer
    runs a part another backend compiled: uncompiled, on its fake tensors."""
    from torch._dynamo.utils import counters
    from torch._guards import TracingContext

    count = counters["aot_autograd"]["total"]
    context = TracingContext.try_get()
    metadata = context.fw_metadata if context is not None else None
    try:
        yield
    except Exception:
        counters["aot_autograd"]["total"] = count
        if context is not None:
            context.fw_metadata = metadata
        raise


def _autocast_as_on_the_gpu(gm: torch.fx.GraphModule) -> None:
    """Each call of Dynamo's graph that CUDA's autocast casts for (autocast.json's lists: `linear`
    to bfloat16, `layer_norm` to float32, ...) made through the emulator's autocast while AOTAutograd
    traces it. On a GPU the casts come from the dispatcher's AutocastCUDA key as the graph is traced;
    meta tensors have none, so nanoGPT's model compiled under `torch.autocast("cuda", bfloat16)`
    ran its products and kept its activations in float32 (2.37 GiB where the eager model's peak was
    1.64 GiB). Attention casts its own inputs (the device mode's choice of kernel)."""
    from memdiff.recording.emulate.autocast import FP32, LOWER, PROMOTE, Autocast
    from memdiff.recording.emulate.modes import aten_name

    if Autocast.dtype() is None:  # Dynamo guards on autocast's state: this graph runs without it
        return
    listed = LOWER | FP32 | PROMOTE
    casts = Autocast()  # this graph's own cache of casted weights: its casts are nodes of its trace
    for node in gm.graph.nodes:
        if node.op != "call_function" or not callable(node.target):
            continue
        name = aten_name(node.target)
        if name in listed and name != "scaled_dot_product_attention":
            node.target = _cast_for(node.target, name, casts)
    gm.recompile()


def _cast_for(target: Callable[..., Any], name: str, casts: Any) -> Callable[..., Any]:
    """`target` called with its arguments as CUDA's autocast gives them, when autocast is on."""
    @functools.wraps(target)
    def call(*args: Any, **kwargs: Any) -> Any:
        cast = casts.cast(name, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        return target(*args, **kwargs)
    return call


class _DeviceGuard:
    """torch.cuda._DeviceGuard(index) of the wrapper code: every kernel runs on the emulated GPU."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> None:
        """Nothing to switch."""

    def __exit__(self, *exc: Any) -> None:
        """Nothing to switch back."""


def _empty_strided_cuda(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Inductor's buffer: an allocation of the emulated GPU (the emulator's modes are on while the
    wrapper runs)."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def _fused_as_compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """A compiled function run eagerly, in which FlexAttention runs as Inductor's fused kernels, as
    the GPU runs it compiled (flex.py), not as the dense scores an eager call holds."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with flex.fused():
            return function(*args, **kwargs)
    return run


def _on_cuda(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> List[Any]:
    """The graph and its inputs moved from the meta device (where the emulator traced them) to
    `cuda:0`, on fake tensors: Inductor plans for the device its inputs are on. Each node's value is
    remade on `cuda:0` with its shape, strides and dtype, not recomputed (the seeds of Inductor's
    random ops would be made for real)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    cuda = torch.device("cuda", 0)
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def moved(value: Any) -> Any:
        # a GPU the traced code named (`device="cuda:1"` on rank 1) is the one Inductor plans for too
        if isinstance(value, torch.device) and value.type in ("meta", "cuda"):
            return cuda
        if isinstance(value, (list, tuple)):
            return type(value)(moved(v) for v in value)
        return value

    def remade(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            with mode:
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=cuda)
        return value

    for node in gm.graph.nodes:
        node.args = moved(node.args)
        node.kwargs = {k: moved(v) for k, v in node.kwargs.items()}
        if "val" in node.meta:
            node.meta["val"] = tree_map(remade, node.meta["val"])
    gm.recompile()
    return [remade(x) for x in example_inputs]
