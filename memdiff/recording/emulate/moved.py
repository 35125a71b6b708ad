"""A tensor moved between the host and the emulated GPU in place, the Python object kept.

On a GPU `param.data = param.to("cuda")` keeps the Parameter object (its identity, its attributes, the
optimizer and the modules that name it) and gives it the moved storage. Here the GPU's tensors are meta
tensors, which a host tensor cannot take as its `.data` ("incompatible tensor type"), so the tensor under
the object is exchanged for the moved one instead, where no other holder can see the exchange.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


def kept(before: Any, now: Any) -> Any:
    """The Parameter `before` holding `now`'s tensor, where torch made `now` a new Parameter for it;
    `now` where the two cannot be swapped (another holder of its tensor, a weak reference to `now`)."""
    if now is before or not isinstance(before, torch.nn.Parameter) or type(now) is not type(before):
        return now
    return before if _exchanged(before, now) else now


def _exchanged(before: Any, now: Any, weak_now: bool = False) -> bool:
    """Swap the tensors under `before` and `now` (of one class), `before` keeping its attributes, and let
    go of what `now` is left with; False where they cannot be swapped. `weak_now`: a weak reference to
    `now` does not stop it (set_data's, where the emulator's own tables hold it)."""
    weak = weakref.getweakrefs(before) or (weak_now and weakref.getweakrefs(now))
    if weak and before._use_count() == 1 and now._use_count() == 1:
        # A weak reference to the Parameter (DeepSpeed keeps one to every weight, utils/debug.py), or to
        # the tensor moved in (the emulator keeps a small tensor's values under one: BERT's position ids
        # buffer), goes on naming what it named; swap_tensors refuses any object so referenced, so the
        # tensors under the two are swapped here, where no other holder of either tensor (a use count of
        # 1) can see the exchange. Its attributes stay.
        torch._C._swap_tensor_impl(before, now)
    else:
        attributes = dict(before.__dict__)  # the set_data the GPU runs keeps them; a swap would not
        try:
            torch.utils.swap_tensors(before, now)
        except RuntimeError:
            return False
        before.__dict__.update(attributes)
    _release(now)
    return True


def _release(orphan: Any) -> None:
    """Let go of the moved-away tensor a swap left in `orphan`, and of its gradient.

    The GPU's `param.data = moved` replaces the storage inside the one tensor every holder shares, so
    the old storage is freed at once, and so is the old gradient (`grad.data = moved`). The swap
    leaves the old tensor here, where a live graph still holds it (its AccumulateGrad node: a
    checkpoint's `model.cpu()` while the step's loss is still named), with the weights and their
    gradients on the emulated GPU until that graph goes.
    """
    with torch.no_grad():
        orphan.grad = None
        orphan.data = orphan.new_empty((0,))


def set_data(variable: torch.Tensor, data: torch.Tensor, handed: Callable[[Any, Any], None]) -> bool:
    """`variable.data = data` where one is on the host and the other on the emulated GPU (FSDP1 moves a
    module so, `param.data = param.to(device_id)`, and `param.grad.data` and each buffer): the tensor
    under `variable` becomes `data`'s storage with `variable`'s own class, `requires_grad`, attributes and
    gradient, as set_data keeps them. False where it cannot be exchanged (another holder of the tensor):
    the caller runs torch's own set_data, which refuses. `handed(old, new)`: what the emulator keeps of
    tensor `old` (its values, values.py) is `new`'s now."""
    fresh = data.detach()
    if isinstance(variable, torch.nn.Parameter):
        fresh = type(variable)(fresh, requires_grad=variable.requires_grad)
    elif type(fresh) is not type(variable):
        return False
    else:
        fresh.requires_grad_(variable.requires_grad)
    grad = variable.grad if variable.is_leaf else None
    if not _exchanged(variable, fresh, weak_now=True):  # a buffer too, which kept() leaves alone
        return False
    handed(fresh, variable)  # the values the emulator kept of what moved in are the variable's now
    if grad is not None and grad.device.type == variable.device.type:  # one on the other device cannot follow
        variable.grad = grad
    return True
