"""Typed Python entry points of the hetlb tensor kernels (``torch.ops.hetlb``).

The kernels live in ``hetlb._C`` (CPU: csrc/ops/cpu/kernels.cpp, CUDA: csrc/ops/cuda/kernels.cu); importing
this module loads the extension, which registers them. Fake (meta) implementations are registered
here so that the ops trace under ``torch.compile`` / ``torch.export`` without running.

All tensors of one call must share one dtype among float32, float64, float16 and bfloat16, and one
device; half and bfloat16 are computed in float32, float64 in float64. Violations raise
``RuntimeError`` naming the offending argument.

In eager mode ``scale_`` and ``delay_compensate_`` hand their lists to ``hetlb._C`` directly, which
calls the same op through the dispatcher (torch.ops' argument parsing costs more host time than a
GPU takes to run them on a model's gradients); under ``torch.compile``, for lists with anything but
plain tensors and ``Parameter``s (a tensor subclass, a wrong type) and under a torch function mode
they call ``torch.ops.hetlb``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from hetlb import _C  # (registers torch.ops.hetlb.*; scale_call and delay_compensate_call)


__all__ = ["scale_", "flatten_scaled", "unflatten_", "delay_compensate_"]


def scale_(tensors: Sequence[Tensor], weight: float) -> None:
    """Multiply every tensor of ``tensors`` by ``weight`` in place, in one fused pass.

    Args:
        tensors: tensors of any shapes (possibly non-contiguous), one dtype and device.
            An empty list is a no-op.
        weight: host scalar, e.g. ``local_batch / global_batch``.
    """
    tensors = list(tensors)
    if not tensors:
        # The dispatcher cannot route a call without tensor arguments; nothing to do anyway.
        return
    if torch.compiler.is_compiling() or not _C.scale_call(tensors, float(weight)):
        torch.ops.hetlb.scale_.default(tensors, float(weight))


def flatten_scaled(tensors: Sequence[Tensor], weight: float,
                   extra: Optional[Tensor] = None) -> Tensor:
    """Pack ``tensors`` into one new 1-D buffer, scaled by ``weight``, with ``extra`` at the tail.

    ``out[off_i : off_i + numel_i] = tensors[i].flatten() * weight`` where ``off_i`` is the sum of
    the preceding numels; then ``extra`` (1-D, any dtype, same device, copied unscaled and cast to
    the output dtype) fills the last ``extra.numel()`` elements.

    Returns:
        Tensor of shape ``(sum(t.numel() for t in tensors) + extra.numel(),)`` with the dtype and
        device of ``tensors[0]``. For an empty list it is a copy of ``extra`` (its dtype and device),
        or an empty float32 CPU tensor when ``extra`` is None.
    """
    tensors = list(tensors)
    if not tensors and extra is None:
        # No tensor argument at all: the dispatcher has no device to pick a kernel from.
        return torch.empty(0, dtype=torch.float32)
    return torch.ops.hetlb.flatten_scaled.default(tensors, float(weight), extra)


def unflatten_(flat: Tensor, tensors: Sequence[Tensor], scale: float) -> None:
    """Inverse of :func:`flatten_scaled`: ``tensors[i].copy_(flat[off_i:off_i+numel_i].view_as(
    tensors[i]) * scale)`` in place.

    Args:
        flat: 1-D tensor with at least ``sum(t.numel())`` elements (a longer tail is ignored),
            same dtype and device as ``tensors``.
        tensors: destination tensors (possibly non-contiguous), overwritten.
        scale: host scalar, e.g. ``1 / world_size`` after an all-reduce of sums.
    """
    torch.ops.hetlb.unflatten_.default(flat, list(tensors), float(scale))


def delay_compensate_(grad: Union[Tensor, Sequence[Tensor]], param: Union[Tensor, Sequence[Tensor]],
                      prev_param: Union[Tensor, Sequence[Tensor]], lam: float) -> None:
    """ABS-SGD delay compensation (Eq. 6), in place and in one pass:
    ``grad += lam * grad * grad * (param - prev_param)``.

    Takes one tensor each or equally long lists (a model's gradients in one call: on CUDA one
    launch per 512 tensors instead of one per tensor; per 36 with a CUDA older than 12.1).

    Args:
        grad: gradient, or a list of them, overwritten.
        param: current parameters, the same shape, dtype and device as ``grad`` (position by
            position for lists).
        prev_param: parameters the (stale) gradient was computed at, likewise.
        lam: compensation strength (lambda).
    """
    single = [isinstance(t, Tensor) for t in (grad, param, prev_param)]
    if any(single) and not all(single):
        raise TypeError("hetlb.ops.delay_compensate_: pass grad, param and prev_param all as tensors "
                        f"or all as lists, got {', '.join(type(t).__name__ for t in (grad, param, prev_param))}")
    grads, params, prevs = ([t] if s else list(t) for t, s in zip((grad, param, prev_param), single))
    if not grads and not params and not prevs:
        return  # the dispatcher cannot route a call without tensor arguments; nothing to do anyway
    if torch.compiler.is_compiling() or not _C.delay_compensate_call(grads, params, prevs, float(lam)):
        torch.ops.hetlb.delay_compensate_.default(grads, params, prevs, float(lam))


# Fake implementations: shapes and dtypes only, mirroring the argument checks that decide them.

@torch.library.register_fake("hetlb::scale_")
def _scale_fake(tensors, weight):
    return None


@torch.library.register_fake("hetlb::flatten_scaled")
def _flatten_scaled_fake(tensors, weight, extra=None):
    if extra is not None:
        torch._check(extra.dim() == 1, lambda: f"hetlb::flatten_scaled: extra must be 1-D, got {extra.dim()}-D")
    if not tensors:
        if extra is not None:
            return torch.empty_like(extra, memory_format=torch.contiguous_format)
        return torch.empty(0, dtype=torch.float32)
    total = sum(t.numel() for t in tensors) + (extra.numel() if extra is not None else 0)
    return tensors[0].new_empty(total)


@torch.library.register_fake("hetlb::unflatten_")
def _unflatten_fake(flat, tensors, scale):
    return None


@torch.library.register_fake("hetlb::delay_compensate_")
def _delay_compensate_fake(grads, params, prev_params, lam):
    return None
