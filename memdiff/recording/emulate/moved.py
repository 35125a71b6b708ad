"""A tensor moved between the host and the emulated GPU in place, the Python object kept.

On a GPU `param.data = param.to("cuda")` keeps the Parameter object (its identity, its attributes, the
optimizer and the modules that name it) and gives it the moved storage. Here the GPU's tensors are meta
tensors, which a host tensor cannot take as its `.data` ("incompatible tensor type"), so the tensor under
the object is exchanged for the moved one instead, where no other holder can see the exchange.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def kept(before: Any, now: Any) -> Any:
    """The Parameter `before` holding `now`'s tensor, where torch made `now` a new Parameter for it;
    `now` where the two cannot be swapped (another holder of its tensor, a weak reference to `now`)."""
    if now is before or not isinstance(before, torch.nn.Parameter) or type(now) is not type(before):
        return now
    if weakref.getweakrefs(before) and before._use_count() == 1 and now._use_count() == 1:
        # A weak reference to the Parameter (DeepSpeed keeps one to every weight, utils/debug.py)
        # goes on naming it, as on the GPU, whose `param.data = moved` keeps the object; swap_tensors
        # refuses any object so referenced, so the tensors under the two are swapped here, where no
        # other holder of either tensor (a use count of 1) can see the exchange. Its attributes stay.
        torch._C._swap_tensor_impl(before, now)
        _release(now)
        return before
    attributes = dict(before.__dict__)  # the set_data the GPU runs keeps them; a swap would not
    try:
        torch.utils.swap_tensors(before, now)
    except RuntimeError:
        return now
    before.__dict__.update(attributes)
    _release(now)
    return before


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


def set_data(variable: torch.Tensor, data: torch.Tensor) -> bool:
    """`variable.data = data` where one is on the host and the other on the emulated GPU (FSDP1 moves a
    module so, `param.data = param.to(device_id)`, and `param.grad.data` and each buffer): the tensor
    under `variable` becomes `data`'s storage with `variable`'s own class, `requires_grad`, attributes and
    gradient, as set_data keeps them. False where it cannot be exchanged (another holder of the tensor):
    the caller runs torch's own set_data, which refuses."""
    fresh = data.detach()
    if isinstance(variable, torch.nn.Parameter):
        fresh = type(variable)(fresh, requires_grad=variable.requires_grad)
    elif type(fresh) is not type(variable):
        return False
    else:
        fresh.requires_grad_(variable.requires_grad)
    grad = variable.grad if variable.is_leaf else None
    if kept(variable, fresh) is not variable:
        return False
    if grad is not None and grad.device.type == variable.device.type:  # one on the other device cannot follow
        variable.grad = grad
    return True
