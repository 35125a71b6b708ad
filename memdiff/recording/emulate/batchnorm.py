"""Batch norm on the emulated GPU takes cuDNN's route where a GPU does.

`torch.batch_norm` is made of other ops: `_batch_norm_impl_index` (aten/src/ATen/native/
Normalization.cpp) runs `aten::cudnn_batch_norm` for a CUDA tensor that cuDNN takes, and only the
meta device's own route (`native_batch_norm`) otherwise. Both allocate the same bytes in training
(the output, the saved mean and inverse deviation; cuDNN's reserve space is empty there), but a real
snapshot names the cuDNN op and its backward, so sites would not match the GPU's; in evaluation
cuDNN saves nothing where the meta route makes two vectors. This runs the cuDNN op on the meta
tensors, under the conditions `_batch_norm_impl_index` checks.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

from memdiff.recording.emulate.runtime import Emulator

# F.batch_norm's and torch.batch_norm's arguments, in order, with F's defaults.
_F_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_TORCH_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
               "cudnn_enabled")
_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
# The batch sizes cuDNN's spatial batch norm takes (Normalization.cpp), in training and in evaluation.
_MAX_BATCH = {True: 880801, False: 65535}


def handles(func: Any) -> bool:
    """Whether `func` is a batch norm this module runs."""
    return func is F.batch_norm or func is torch.batch_norm


def _arguments(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    names = _F_ARGS if func is F.batch_norm else _TORCH_ARGS
    return {**_DEFAULTS, "cudnn_enabled": torch.backends.cudnn.enabled, **dict(zip(names, args)), **kwargs}


def takes(a: Dict[str, Any]) -> bool:
    """Whether a GPU runs this batch norm on cuDNN: a float input (half with float weights) of three
    or more dimensions on the device, weight and bias, running statistics (or none while training),
    a batch cuDNN takes, cuDNN enabled."""
    x, w, b = a["input"], a["weight"], a["bias"]
    if not (isinstance(x, torch.Tensor) and x.is_meta and isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if torch.bfloat16 in (x.dtype, w.dtype) or (x.dtype == torch.float16 and w.dtype != torch.float32):
        return False
    stats = a["running_mean"] is not None and a["running_var"] is not None
    none = a["running_mean"] is None and a["running_var"] is None
    training = bool(a["training"])
    return bool(a["cudnn_enabled"]) and (stats or (none and training)) and x.dim() >= 3 and a["momentum"] is not None \
        and 0 < int(x.shape[0]) <= _MAX_BATCH[training]


def call(emulator: Emulator, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The batch norm's output, made by `aten::cudnn_batch_norm` where a GPU's cuDNN runs it (its
    backward is then cuDNN's too), else by torch's own route."""
    a = _arguments(func, args, kwargs)
    if not takes(a):
        return func(*args, **kwargs)
    x, training = a["input"], bool(a["training"])
    if func is F.batch_norm and training and x.numel() == int(x.shape[1]):
        # F.batch_norm's own check, before any op: one value per channel has no variance
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.size()}")
    layout = torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else torch.contiguous_format
    emulator.context.append("_batch_norm_impl_index")
    try:
        return torch.ops.aten.cudnn_batch_norm(
            x.contiguous(memory_format=layout), a["weight"].contiguous(), a["bias"].contiguous(),
            a["running_mean"], a["running_var"], training, float(a["momentum"]), float(a["eps"]))[0]
    finally:
        emulator.context.pop()
