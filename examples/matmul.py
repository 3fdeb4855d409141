"""Tiled matmul with an f32 VMEM accumulator: the canonical 3-D grid (i, j, k) Pallas TPU kernel.

K is the reduction ("arbitrary") axis: the accumulator is zeroed at k == 0 and written out at the last
k. A K that is not a multiple of bk leaves a partial last K-block whose padding is garbage (NaN in TPU
interpret mode) in *both* operands, so both are masked with ``jnp.where`` before the dot.

    python examples/matmul.py
"""

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tpukernels as tk


def matmul_body(a_ref, b_ref, o_ref, acc_ref, *, K: int, bk: int):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    a, b = a_ref[...], b_ref[...]
    if K % bk:  # static: only kernels with a K tail pay for the mask
        a = tk.mask_tail(a, axis=1, start=k * bk, size=K)
        b = tk.mask_tail(b, axis=0, start=k * bk, size=K)
    acc_ref[...] += jnp.dot(a, b, preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _fit(block: int, dim: int, align: int) -> int:
    """The block, or the whole dim when it is smaller (a full dim always satisfies the (8,128) rule)."""
    return dim if dim <= block else block - block % align


@tk.tpu_kernel(
    matmul_body,
    namespace="examples",
    tunables={
        "bm": tk.Tunable([512, 128, 256, 1024], default=512),
        "bk": tk.Tunable([512, 128, 256, 1024], default=512),
        "bn": tk.Tunable([512, 128, 256, 1024], default=512),
    },
    shapes={"a": "M K", "b": "K N"},  # checked before the launch function: a K mismatch is an ArgumentError
)
def matmul(a: torch.Tensor, b: torch.Tensor, *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """``a @ b`` with f32 accumulation. a: [M, K], b: [K, N], same dtype. Returns [M, N] in a's dtype."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise tk.ArgumentError(f"matmul: a {tuple(a.shape)} and b {tuple(b.shape)} must be [M, K] and [K, N]")
    (M, K), N = a.shape, b.shape[1]
    bm, bk, bn = _fit(bm, M, 16), _fit(bk, max(K, 1), 128), _fit(bn, N, 128)  # K = 0: empty grid, zeros
    return tk.Launch(
        grid=(tk.cdiv(M, bm), tk.cdiv(N, bn), tk.cdiv(K, bk)),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)), pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        out_shape=tk.like(a, shape=(M, N)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        body_kwargs={"K": K, "bk": bk},
    )


def main():
    from _check import check, exit_with

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(m, k, generator=g, dtype=dt), torch.randn(k, n, generator=g, dtype=dt))
             for m, k, n, dt in [(256, 640, 384, torch.float32), (129, 1000, 257, torch.float32),
                                 (64, 700, 128, torch.bfloat16), (8, 0, 128, torch.float32)]]
    # f32: accumulation-order differences only; bf16: f32 accumulation, then one rounding to bf16
    atol = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
    rtol = {torch.float32: 1e-4, torch.bfloat16: 4e-3}  # bf16: half an ulp = 2^-9 relative
    failures = check("matmul", lambda a, b: matmul(a, b, config={"bk": 256}) if a.shape[1] == 700 else matmul(a, b),
                     lambda a, b: a @ b, cases,
                     [(matmul, ("1024x1024:bf16", "1024x1024:bf16"), {}), (matmul, ("1000x999:f32", "999x1001:f32"), {})],
                     atol, rtol)
    exit_with(failures)


if __name__ == "__main__":
    main()
