"""Fused row softmax: one pass over each row block in VMEM (max, exp, sum, divide), f32 inside.

    python examples/softmax.py
"""

import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import tpukernels as tk


def softmax_body(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)  # the whole row is in the block: no column tail to mask
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def _block_rows_fit(x, block_rows):
    # in + out blocks, double-buffered, plus f32 temporaries: keep under ~12 MiB (v5e's scoped limit is 16)
    per_row = x.shape[-1] * (4 * x.itemsize + 3 * 4)
    return max(8, min(block_rows, (12 << 20) // max(per_row, 1) // 8 * 8))


@tk.tpu_kernel(
    softmax_body,
    namespace="examples",
    tunables={"block_rows": tk.Tunable([64, 8, 16, 32, 128, 256, 512], default=64)},
    rows=("x",),  # rows are independent: row counts are bucketed, so new batch sizes rarely recompile
)
def softmax(x: torch.Tensor, *, block_rows: int) -> torch.Tensor:
    """Softmax over the last dim. x: [R, C] float32/bfloat16/float16. Returns [R, C], same dtype."""
    if x.ndim != 2:
        raise tk.ArgumentError(f"softmax: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    br = _block_rows_fit(x, block_rows)
    spec = pl.BlockSpec((br, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], br),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x),
                     dimension_semantics=("parallel",))


def main():
    from _check import check, exit_with

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(r, c, generator=g, dtype=dt) * 4,) for r, c, dt in
             [(100, 128, torch.float32), (37, 1000, torch.float32), (256, 512, torch.bfloat16), (1, 7, torch.float32)]]
    atol = {torch.float32: 1e-6, torch.bfloat16: 4e-3}
    rtol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}  # f32 math, one bf16 rounding of the output
    failures = check("softmax", softmax, lambda x: torch.softmax(x, dim=-1), cases,
                     [(softmax, ("8192x4096:bf16",), {}), (softmax, ("4096x1000:f32",), {})], atol, rtol)
    exit_with(failures)


if __name__ == "__main__":
    main()
