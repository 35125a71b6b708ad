"""DeepSpeed's host optimizers under the emulator: DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion.

With `"offload_optimizer": {"device": "cpu"}` ZeRO steps its fp32 master partition on the host with
DeepSpeedCPUAdam (DeepSpeedCPUAdagrad and DeepSpeedCPULion for `"Adagrad"` and `"Lion"`), whose op
builders (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder) build a C++ extension with the host's
compiler each run unless it was built at install: minutes on a small machine. Under the emulator
their `load()` gives the stand-ins below instead (deepspeed_ops.py), so nothing is built and no C++
compiler is needed. Their tensors are real host tensors with real values, so each stand-in computes
the kernel's update with torch's ops, in place, as DeepSpeed 0.19.8's C++ does (csrc/adam/
cpu_adam_impl.cpp, csrc/adagrad/cpu_adagrad.cpp, csrc/lion/cpu_lion_impl.cpp and their headers, read):

- the math in fp32 whatever the tensors' dtypes, the parameters and states rounded back to theirs;
  the (parameter, state) dtypes the kernels are built for: (fp16 or bf16, fp32 or the same), (fp32,
  fp32), any other refused with the kernel's error; the gradient read as it is (DeepSpeed passes it
  in the parameter's dtype);
- each tensor made contiguous first, as the kernel does: a non-contiguous one is updated in a copy;
- the hyperparameters of each call (the learning rate, betas, eps, weight decay), the optimizer's
  id naming what `create_*` kept: for Adam only whether it is AdamW (decoupled weight decay) or
  Adam (L2 added to the gradient); the bias corrections from the step number given.

Adagrad's vectorised kernel leaves the gradient as it is (its scalar remainder loop writes the
update term there): the stand-in leaves it. ZenFlow's overlapped optimizer process (the cpu_adam
extension's `zenflow_adam_*` functions) is refused in one line.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from memdiff.recording.emulate.legacy import NAMES

# Elements a slice: the update works through each tensor slice by slice, as the kernel works tile by
# tile, so its fp32 temporaries stay a few slices' size however large the partition (16 MiB each).
SLICE = 1 << 22
FP32 = torch.float32
# The (parameter, state) dtypes each kernel's invokers are built for (InvokerInitializer).
BUILT_FOR = frozenset({(torch.float16, FP32), (torch.float16, torch.float16), (torch.bfloat16, FP32),
                       (torch.bfloat16, torch.bfloat16), (FP32, FP32)})


def dtype_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype in errors: 'BFloat16', 'Long'."""
    return NAMES[dtype].removesuffix("Tensor") if dtype in NAMES else str(dtype)


def _check_built_for(kind: str, params: torch.Tensor, state: torch.Tensor) -> None:
    if (params.dtype, state.dtype) not in BUILT_FOR:
        raise RuntimeError(f"{kind} optimizer with param type {dtype_name(params.dtype)} and state type "
                           f"{dtype_name(state.dtype)} is not supported on current hardware")


def _slices(*tensors: torch.Tensor) -> Iterator[Tuple[torch.Tensor, ...]]:
    """The same slice of each (contiguous, equally long) tensor, flat, slice by slice."""
    flat = [t.view(-1) for t in tensors]
    for start in range(0, flat[0].numel(), SLICE):
        yield tuple(f[start:start + SLICE] for f in flat)


def _in_fp32(update: Callable[..., None], *tensors: torch.Tensor) -> None:
    """Run `update` on fp32 copies of the tensors that are not fp32 (the tensors themselves
    otherwise) and round the results back, as the kernel loads each element to a float and stores it."""
    work = [t if t.dtype == FP32 else t.float() for t in tensors]
    update(*work)
    for tensor, done in zip(tensors, work):
        if done is not tensor:
            tensor.copy_(done)


class _Created:
    """The optimizers `create_*` made, by id, and what each kept."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.kept: Dict[int, Any] = {}

    def create(self, optimizer_id: int, kept: Any) -> int:
        self.kept[optimizer_id] = kept
        return 0

    def get(self, optimizer_id: int) -> Any:
        if optimizer_id not in self.kept:
            # the kernel would read a null optimizer here (a crash): say so instead
            raise RuntimeError(f"DeepSpeed CPU {self.kind} optimizer #{optimizer_id} was not created")
        return self.kept[optimizer_id]

    def destroy(self, optimizer_id: int) -> int:
        """`destroy_*`: forgets optimizer `optimizer_id`. The module's function itself (a bound method):
        DeepSpeed calls it from `__del__`, at the interpreter's exit too, when this module's globals
        may already be gone."""
        self.kept.pop(optimizer_id, None)
        return 0


def _said(should_log: bool, kind: str, optimizer_id: int, config: str) -> None:
    # the kernel's two lines, naming what runs the arithmetic here
    if should_log:
        print(f"{kind} Optimizer #{optimizer_id} is created with torch (memdiff's stand-in) arithmetic capability.")
        print(f"Config: {config}")


ADAM = _Created("Adam")


def create_adam(optimizer_id: int, alpha: float = 1e-3, betta1: float = 0.9, betta2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0, adamw_mode: bool = True, should_log: bool = False) -> int:
    """DeepSpeedCPUAdam's `create_adam`: keeps whether optimizer `optimizer_id` is AdamW."""
    _said(should_log, "Adam", optimizer_id, f"alpha={alpha:f}, betas=({betta1:f}, {betta2:f}), "
                                            f"weight_decay={weight_decay:f}, adam_w={int(adamw_mode)}")
    return ADAM.create(optimizer_id, bool(adamw_mode))


def adam_update(optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, epsilon: float,
                weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
    """DeepSpeedCPUAdam's step of one parameter: `params`, `exp_avg` and `exp_avg_sq` updated in place."""
    adamw = ADAM.get(optimizer_id)
    params, grads, exp_avg, exp_avg_sq = (t.contiguous() for t in (params, grads, exp_avg, exp_avg_sq))
    _check_built_for("Adam", params, exp_avg)
    corrected1, corrected2 = (1 - beta1 ** step, 1 / math.sqrt(1 - beta2 ** step)) if bias_correction else (1.0, 1.0)
    decays = weight_decay > 0

    def update(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor) -> None:
        if decays and not adamw:
            grad = grad.add(param, alpha=weight_decay)
        momentum.mul_(beta1).add_(grad, alpha=1 - beta1)
        variance.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = variance.sqrt().mul_(corrected2).add_(epsilon)
        if decays and adamw:
            param.mul_(1 - lr * weight_decay)
        param.addcdiv_(momentum, denominator, value=-lr / corrected1)

    with torch.no_grad():
        for sliced in _slices(params, grads, exp_avg, exp_avg_sq):
            _in_fp32(update, *sliced)
    return 0


def adam_rollback(optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, epsilon: float,
                  weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                  exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
    """DeepSpeedCPUAdam's undoing of step `step` (AdamW's, bias-corrected, whatever the flags), fp32
    tensors only: -1 and a printed error otherwise, as the kernel answers."""
    if any(t.dtype != FP32 for t in (params, grads, exp_avg, exp_avg_sq)):
        print("Error: Adam rollback currently only supports float32 tensors")
        return -1
    corrected1, corrected2 = 1 - beta1 ** step, 1 - beta2 ** step
    with torch.no_grad():
        for param, grad, momentum, variance in _slices(params, grads, exp_avg, exp_avg_sq):
            denominator = variance.div(corrected2).sqrt_().add_(epsilon)
            param.addcdiv_(momentum.div(corrected1), denominator, value=lr).div_(1 - lr * weight_decay)
            param.masked_fill_(~param.isfinite(), 0.0)
            momentum.sub_(grad, alpha=1 - beta1).div_(beta1)
            variance.addcmul_(grad, grad, value=-(1 - beta2)).div_(beta2)
    return 0



ADAGRAD = _Created("Adagrad")


def create_adagrad(optimizer_id: int, alpha: float = 1e-2, eps: float = 1e-8, weight_decay: float = 0,
                   should_log: bool = False) -> int:
    """DeepSpeedCPUAdagrad's `create_adagrad`."""
    _said(should_log, "Adagrad", optimizer_id, f"alpha={alpha:f}, weight_decay={weight_decay:f}")
    return ADAGRAD.create(optimizer_id, None)


def adagrad_update(optimizer_id: int, step: int, lr: float, epsilon: float, weight_decay: float,
                   params: torch.Tensor, grads: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
    """DeepSpeedCPUAdagrad's step of one parameter: `params` and `exp_avg_sq` updated in place."""
    ADAGRAD.get(optimizer_id)
    params, grads, exp_avg_sq = (t.contiguous() for t in (params, grads, exp_avg_sq))
    _check_built_for("Adagrad", params, exp_avg_sq)

    def update(param: torch.Tensor, grad: torch.Tensor, variance: torch.Tensor) -> None:
        if weight_decay > 0:
            grad = grad.add(param, alpha=weight_decay)
        variance.addcmul_(grad, grad)
        param.addcdiv_(grad, variance.sqrt().add_(epsilon), value=-lr)

    with torch.no_grad():
        for sliced in _slices(params, grads, exp_avg_sq):
            _in_fp32(update, *sliced)
    return 0



LION = _Created("Lion")


def create_lion(optimizer_id: int, alpha: float, betta1: float, betta2: float, weight_decay: float,
                should_log: bool) -> int:
    """DeepSpeedCPULion's `create_lion`."""
    _said(should_log, "Lion", optimizer_id,
          f"alpha={alpha:f}, betas=({betta1:f}, {betta2:f}), weight_decay={weight_decay:f}")
    return LION.create(optimizer_id, None)


def lion_update(optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, weight_decay: float,
                params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor) -> int:
    """DeepSpeedCPULion's step of one parameter: `params` and `exp_avg` updated in place."""
    LION.get(optimizer_id)
    params, grads, exp_avg = (t.contiguous() for t in (params, grads, exp_avg))
    _check_built_for("Lion", params, exp_avg)

    def update(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor) -> None:
        # the step is lr against the sign of the interpolation; the kernel's copysign gives a zero
        # the sign bit it has, so +0.0 steps down as a positive value does
        blend = momentum.mul(beta1).add_(grad, alpha=1 - beta1)
        if weight_decay > 0:
            param.mul_(1 - lr * weight_decay)
        param.sub_(torch.full_like(blend, lr).copysign_(blend))
        momentum.mul_(beta2).add_(grad, alpha=1 - beta2)

    with torch.no_grad():
        for sliced in _slices(params, grads, exp_avg):
            _in_fp32(update, *sliced)
    return 0



def _refusing(name: str) -> Callable[[str], Any]:
    """A module's `__getattr__` that refuses the extension's other functions (ZenFlow's) in one line."""
    def missing(attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        from memdiff.recording.emulate.runtime import EmulationError

        raise EmulationError(f"DeepSpeed's {name} op: {attribute}",
                             "not emulated (ZenFlow's overlapped optimizer process); "
                             "leave zenflow out of the config to record this run")
    return missing


def _module(name: str, functions: Dict[str, Callable[..., Any]]) -> types.ModuleType:
    module = types.ModuleType(f"memdiff.emulated.{name}",
                              f"memdiff's stand-in for DeepSpeed's {name} C++ extension, in torch's ops")
    for attribute, function in functions.items():
        setattr(module, attribute, function)
    module.__getattr__ = _refusing(name)  # type: ignore[method-assign]
    return module


# By builder name (OpBuilder.name): the stand-in of the host extension it builds.
STANDINS = {
    "cpu_adam": _module("cpu_adam", {"create_adam": create_adam, "adam_update": adam_update,
                                     "adam_rollback": adam_rollback, "destroy_adam": ADAM.destroy}),
    "cpu_adagrad": _module("cpu_adagrad", {"create_adagrad": create_adagrad, "adagrad_update": adagrad_update,
                                           "destroy_adagrad": ADAGRAD.destroy}),
    "cpu_lion": _module("cpu_lion", {"create_lion": create_lion, "lion_update": lion_update,
                                     "destroy_lion": LION.destroy}),
}


def standin(name: Optional[str]) -> Optional[types.ModuleType]:
    """The stand-in for the host extension op builder `name` builds, if there is one."""
    return STANDINS.get(name or "")
