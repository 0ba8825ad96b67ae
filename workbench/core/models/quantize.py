"""Weight-only int8 quantization of a model's :class:`ParallelLinear` layers.

:func:`quantize` returns a new model whose matching projections are :class:`Int8Linear`: an int8
kernel ``q (in, out)`` and a float32 per-output-channel ``scale (out,)`` with
``scale = max|w| over the input dim / 127`` and ``q = clip(round(w / scale), -127, 127)``, so each
weight is reconstructed within ``scale / 2``. Kernels shrink about 4x (float32) or 2x (bfloat16).
Only ``ParallelLinear`` layers are quantized; embeddings, norms and 3-D MoE expert weights stay
as they are. A :class:`LoRALinear`'s base layer quantizes too (QLoRA: the adapters stay float).

``q`` and ``scale`` are :class:`QuantizedParam` (an ``nnx.Param`` subclass, so sharding and byte
counts see them). int8 cannot be differentiated: train a quantized model through a filter such
as ``nnx.DiffState(0, LoRAParam)`` or ``nnx.All(nnx.Param, nnx.Not(QuantizedParam))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.core.axes import EMPTY, DynamicShardingAxes
from workbench.core.linear import ParallelLinear, parallel_matmul
from workbench.core.models.lora import map_layers, placed_param

__all__ = ["Int8Linear", "QuantizedParam", "quantize", "quantize_int8"]

Array = jax.Array
QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable


class QuantizedParam(nnx.Param):
    """A quantized weight or its scale: a parameter that gradients should not touch."""


def quantize_int8(w_DF: Array) -> tuple[Array, Array]:
    """``(q_DF int8, scale_F float32)``, symmetric per output channel (column); ``q * scale ~ w``.

    Leading axes (a stacked ``(L, D, F)`` kernel) are batch axes: each layer its own scales ``(L, F)``.
    An all-zero column gets scale 0 and q 0, so it reconstructs exactly.
    """
    w = jnp.asarray(w_DF, jnp.float32)
    scale_F = jnp.max(jnp.abs(w), axis=-2) / QMAX
    safe_F = jnp.where(scale_F > 0, scale_F, 1.0)
    q_DF = jnp.clip(jnp.round(w / safe_F[..., None, :]), -QMAX, QMAX).astype(jnp.int8)
    return q_DF, scale_F


def _output_axes(axes, ndim: int) -> DynamicShardingAxes:
    """The scale's axes: the kernel's leading (layer) axes and its output axis."""
    if axes is None:
        return DynamicShardingAxes((EMPTY,) * (ndim - 1), "__train__")
    entries, mode = axes if not hasattr(axes, "axes") else (axes.axes, axes.mode)
    return DynamicShardingAxes((*entries[:-2], entries[-1]), mode)


class Int8Linear(nnx.Module):
    """A :class:`ParallelLinear` with an int8 kernel: ``(x @ q) * scale + bias`` in the layer's dtype.

    The scale is applied to the output rather than the kernel: it is the same number (one scale per
    output column), costs ``tokens * out`` multiplies instead of ``in * out``, and never builds a
    float copy of the kernel; int8 values are exact in any float dtype. (In float16 the unscaled
    ``x @ q`` can overflow; use bfloat16 or float32.) With a ``parallel_config`` the matmul runs
    through :func:`parallel_matmul` like the base layer's.
    """

    def __init__(self, base: ParallelLinear, *, bits: int = 8):
        if bits != 8:
            raise ValueError(f"only bits=8 is supported; got bits={bits!r}")
        kernel = base.kernel
        axes = getattr(kernel, "semantic_axes", None)
        config = base.parallel_config
        q_DF, scale_F = quantize_int8(kernel[...])
        self.kernel = placed_param(QuantizedParam, q_DF, axes, config)
        self.scale = placed_param(QuantizedParam, scale_F, _output_axes(axes, q_DF.ndim), config)
        self.bias = base.bias if base.bias is not None else nnx.data(None)
        self.in_features, self.out_features, self.use_bias = base.in_features, base.out_features, base.use_bias
        self.dtype, self.param_dtype, self.precision = base.dtype, base.param_dtype, base.precision
        self.direction, self.parallel_config, self.bits = base.direction, config, bits

    def dequantized_kernel(self) -> Array:
        """``q * scale`` in float32, shape ``([L,] in, out)``."""
        return self.kernel[...].astype(jnp.float32) * self.scale[...][..., None, :]

    def __call__(self, x: Array) -> Array:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input shape {x.shape}: the last dimension must be in_features={self.in_features}")
        dtype = self.dtype or jnp.result_type(x, self.param_dtype)
        x, q_DF = x.astype(dtype), self.kernel[...].astype(dtype)
        config = self.parallel_config
        if config is None:
            y = jnp.matmul(x, q_DF, precision=self.precision)
        else:
            pa, mesh = config.partition_axis, config.mesh
            spec = pa.resolve(self.kernel.semantic_axes, shape=q_DF.shape, mesh=mesh)
            y = parallel_matmul(x, q_DF, None, config=config, direction=self.direction, param_specs=(spec, None),
                                precision=self.precision)
        y = y * self.scale[...].astype(dtype)
        return y if self.bias is None else y + self.bias[...].astype(dtype)


def quantize(model: nnx.Module, *, pattern: str = ".*", bits: int = 8) -> nnx.Module:
    """A new model with each ``ParallelLinear`` whose path matches ``pattern`` (``re.search`` on
    paths like ``layers/mlp/up_proj``, which covers every stacked layer) replaced by an :class:`Int8Linear`;
    ``model`` is untouched."""
    if bits != 8:
        raise ValueError(f"quantize supports bits=8 only (int8 per-channel); got bits={bits!r}")
    return map_layers(model, pattern, ParallelLinear, lambda _, layer: Int8Linear(layer, bits=bits),
                      what="quantize")
