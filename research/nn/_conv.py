"""1-D convolution as patch extraction + one matmul: the same function as `eqx.nn.Conv1d`.

XLA's CPU convolution is slow for the small 1-D convolutions of MNIST-1D-sized models, and much
slower still inside a compiled loop (`lax.scan`/`fori_loop` of train steps). Written as strided
slices (one per kernel tap) and an einsum, the convolution and its gradients become plain matmuls
and slices, which XLA's CPU backend fuses and runs fast in a loop too. The layer keeps
`eqx.nn.Conv1d`'s parameters (weight `[out, in, kernel]`, bias `[out, 1]`) and is checked against it.
"""

import equinox as eqx
import jax.numpy as jnp

from ..typing import Array, Float, typecheck
from ._taps import observed_linear_map


@typecheck
def conv1d_as_matmul(
    conv: eqx.nn.Conv1d, x: Float[Array, "channels length"]
) -> Float[Array, "out_channels out_length"]:
    """`conv(x)` for a 1-D `eqx.nn.Conv1d` with zero padding, no dilation and one group, computed
    as `einsum(weight, patches)`."""
    if conv.groups != 1 or conv.dilation != (1,) or conv.padding_mode != "ZEROS" or isinstance(conv.padding, str):
        raise ValueError(
            "conv1d_as_matmul supports groups=1, dilation=1 and zero padding given as numbers; "
            f"got groups={conv.groups}, dilation={conv.dilation}, padding={conv.padding!r}, "
            f"padding_mode={conv.padding_mode}"
        )
    (kernel,), (stride,), ((left, right),) = conv.kernel_size, conv.stride, conv.padding
    x = jnp.pad(x, ((0, 0), (left, right)))
    out_length = (x.shape[1] - kernel) // stride + 1
    span = stride * (out_length - 1) + 1
    taps = jnp.stack([x[:, k : k + span : stride] for k in range(kernel)], axis=-1)  # [in, out_length, kernel]
    # Patches as rows [out_length, in * kernel] against the weight as [out, in * kernel]: one plain
    # matmul (batched over examples under vmap), the layout XLA's CPU backend runs fastest in a loop.
    # The rows go through `observed_linear_map` (the identity unless ghost clipping is tracing them).
    patches = jnp.transpose(taps, (1, 0, 2)).reshape(out_length, -1)
    y = observed_linear_map(conv, patches, patches @ conv.weight.reshape(conv.weight.shape[0], -1).T).T
    return y if conv.bias is None else y + conv.bias


@typecheck
def conv2d_as_matmul(
    conv: eqx.nn.Conv2d, x: Float[Array, "channels height width"]
) -> Float[Array, "out_channels out_height out_width"]:
    """`conv(x)` for a 2-D `eqx.nn.Conv2d` with zero padding, no dilation and one group, computed as
    patches @ weight: one strided slice per kernel tap, then a matmul (XLA's CPU convolution of small
    images inside a compiled loop of train steps is 3-5x slower; measured in the issue-26 session)."""
    if conv.groups != 1 or conv.dilation != (1, 1) or conv.padding_mode != "ZEROS" or isinstance(conv.padding, str):
        raise ValueError(
            "conv2d_as_matmul supports groups=1, dilation=1 and zero padding given as numbers; "
            f"got groups={conv.groups}, dilation={conv.dilation}, padding={conv.padding!r}, "
            f"padding_mode={conv.padding_mode}"
        )
    (kh, kw), (sh, sw), ((top, bottom), (left, right)) = conv.kernel_size, conv.stride, conv.padding
    x = jnp.pad(x, ((0, 0), (top, bottom), (left, right)))
    out_h, out_w = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    taps = [
        x[:, i : i + sh * (out_h - 1) + 1 : sh, j : j + sw * (out_w - 1) + 1 : sw] for i in range(kh) for j in range(kw)
    ]
    # [in, out_h, out_w, taps] -> rows [out_h * out_w, in * taps], the weight's [out, in, kh, kw] order.
    patches = jnp.transpose(jnp.stack(taps, axis=-1), (1, 2, 0, 3)).reshape(out_h * out_w, -1)
    y = observed_linear_map(conv, patches, patches @ conv.weight.reshape(conv.weight.shape[0], -1).T)
    y = y.T.reshape(-1, out_h, out_w)
    return y if conv.bias is None else y + conv.bias
