"""Lets torchvision's CUDA-linked PyPI wheel import beside torch's CPU build, for the sweep only.

That wheel's `_C.so` links `libc10_cuda.so`, which the CPU build has not, so it does not load, and
torchvision 0.28's `_meta_registrations` then fails on `register_fake("torchvision::nms")` (the op
does not exist). Declaring the ops' schemas (as `torchvision/csrc/ops/*.cpp` declares them) and
answering the library load lets torchvision's own meta and autograd registrations run; the ops have
no CPU or CUDA kernel, which the emulator never calls for values it does not have. On a machine where
torchvision imports (its CPU wheel, or a GPU), nothing here runs.
"""

from __future__ import annotations

from typing import Any, List

# torchvision's operator schemas, one per op its Python code or its registrations name.
SCHEMAS = [
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "_cuda_version() -> int",
]

_kept: List[Any] = []  # the Library must outlive the import, or its definitions go away


def import_torchvision() -> Any:
    """torchvision, imported as is where it can be, else over the declared schemas (module docstring)."""
    import torch

    try:
        import torchvision
        return torchvision
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    import sys
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        library.define(schema)
    # torchvision asks its build's CUDA version when the load succeeds: -1 is "a CPU build".
    library.impl("_cuda_version", lambda: -1, "CompositeExplicitAutograd")
    _kept.append(library)
    load = torch.ops.load_library
    torch.ops.load_library = lambda path: None if "torchvision" in str(path) else load(path)
    try:
        import torchvision
    finally:
        torch.ops.load_library = load
    return torchvision
