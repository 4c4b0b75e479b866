"""(I + a)^-1 for a batch of strictly lower-triangular matrices a [..., c, c]: the gated delta rule's per-chunk
inverse (`models.gated_delta`). LAPACK's triangular inverse on the CPU; elsewhere (Metal, CUDA) a log-depth
recursion over diagonal blocks made of batched matmuls, which runs on any device."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

# None: by device (LAPACK on the CPU, the block recursion elsewhere); "lapack" or "blocks" forces one (tests)
INVERSE: str | None = None


def _inverse_blocks(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., c, c], by doubling the size of the inverted diagonal
    blocks: [[A11, 0], [A21, A22]]^-1 = [[X11, 0], [-X22 A21 X11, X22]]. Stable (it only multiplies blocks
    of the inverse itself, unlike the Neumann series' powers of a, whose entries grow combinatorially with
    correlated keys) and made of batched matmuls, so it runs on any device."""
    c = a.shape[-1]
    n = 1
    while n < c:
        n *= 2
    lead = a.shape[:-2]
    if n != c:  # the identity extends it: blockdiag(M, I)^-1 = blockdiag(M^-1, I)
        a = mx.pad(a, [(0, 0)] * len(lead) + [(0, n - c), (0, n - c)])
    inv = mx.ones(lead + (n, 1, 1), a.dtype)  # inverses of the diagonal blocks of size s: [..., n/s, s, s]
    s = 1
    while s < n:
        m = n // (2 * s)
        pairs = a.reshape(lead + (m, 2, s, m, 2, s))[..., :, 1, :, :, 0, :]  # [..., m, s, m, s]
        a21 = mx.moveaxis(mx.diagonal(pairs, axis1=-4, axis2=-2), -1, -3)  # each pair's lower-left block
        x = inv.reshape(lead + (m, 2, s, s))
        x11, x22 = x[..., 0, :, :], x[..., 1, :, :]
        x21 = -(x22 @ (a21 @ x11))
        inv = mx.concatenate([mx.concatenate([x11, mx.zeros_like(x11)], -1), mx.concatenate([x21, x22], -1)], -2)
        s *= 2
    return inv.reshape(lead + (n, n))[..., :c, :c]


def _inverse_method() -> str:
    if INVERSE is not None:
        return INVERSE
    return "lapack" if mx.default_device() == mx.cpu else "blocks"


@functools.cache
def _eye(c: int) -> mx.array:
    """The identity [c, c], a constant (no primitives in the graph)."""
    return mx.array(np.eye(c, dtype=np.float32))


@functools.cache
def _make_inverse(method: str):
    @mx.custom_function
    def inverse(a):
        if method == "lapack":
            return mx.linalg.tri_inv(_eye(a.shape[-1]).astype(a.dtype) + a, upper=False, stream=mx.cpu)
        return _inverse_blocks(a)

    # MLX has no VJP for its inverse: d(I + a)^-1 = -T^T dT T^T (only a's strict lower triangle exists).
    # Only MLX's autograd of the forward (custom_vjp=False, the comparison) uses it.
    @inverse.vjp
    def inverse_vjp(primals, cotangent, output):
        t = output
        tt = mx.swapaxes(t, -1, -2)
        c = t.shape[-1]
        i = mx.arange(c)
        return (-(tt @ cotangent @ tt)) * (i[:, None] > i[None, :])

    return inverse


def unit_lower_inverse(a: mx.array, method: str | None = None) -> mx.array:
    """(I + a)^-1 for a batch of strictly lower-triangular float32 matrices a [..., c, c]."""
    return _make_inverse(method or _inverse_method())(a)
