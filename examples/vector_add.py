"""Vector add: the smallest tpukernels kernel (1-D blocks, a tunable block size, tails).

    python examples/vector_add.py     # checks itself on cpu (both interpret modes), compiles for v5e/v6e/tpu7x
"""

import torch
from jax.experimental import pallas as pl

import tpukernels as tk


def add_body(x_ref, y_ref, o_ref):
    # A partial last block reads past the end (NaN in TPU interpret mode); its writes there are dropped,
    # so an elementwise kernel needs no mask.
    o_ref[...] = x_ref[...] + y_ref[...]


@tk.tpu_kernel(
    add_body,
    namespace="examples",
    # rank-1 blocks must be a multiple of 8*128 (or a power of two >= 128 * packing)
    tunables={"block": tk.Tunable([8192, 1024, 2048, 4096, 16384, 65536], default=8192, doc="elements per block")},
)
def vector_add(x: torch.Tensor, y: torch.Tensor, *, block: int) -> torch.Tensor:
    """``x + y`` for 1-D tensors. x, y: [N] (same dtype). Returns [N]."""
    if x.shape != y.shape or x.ndim != 1:
        raise tk.ArgumentError(f"vector_add: x {tuple(x.shape)} and y {tuple(y.shape)} must be equal 1-D shapes")
    if x.dtype != y.dtype:
        raise tk.DTypeError(f"vector_add: x is {x.dtype} but y is {y.dtype}")
    block = min(block, x.shape[0]) if x.shape[0] >= 1024 else x.shape[0]  # tiny inputs: one full block
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return tk.Launch(
        grid=(tk.cdiv(x.shape[0], block) if block else 0,),
        in_specs=[spec, spec],
        out_specs=spec,
        out_shape=tk.like(x),
        dimension_semantics=("parallel",),
    )


def main():
    from _check import check, exit_with

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(n, generator=g, dtype=dt), torch.randn(n, generator=g, dtype=dt))
             for n, dt in [(10_000, torch.float32), (8192, torch.bfloat16), (5, torch.float32), (0, torch.float32)]]
    atol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
    rtol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # one bf16 rounding of the sum: 2^-8 relative
    failures = check("vector_add", vector_add, lambda x, y: x + y, cases,
                     [(vector_add, ("1048576:f32", "1048576:f32"), {}), (vector_add, ("1000000:bf16", "1000000:bf16"), {})],
                     atol, rtol)
    exit_with(failures)


if __name__ == "__main__":
    main()
