"""Measure each chip's default scoped VMEM limit with the real compiler (compile-only, needs libtpu).

Binary-searches the largest double-buffered copy kernel (f32 blocks of R x 1024, in + out, 2 buffers each:
16 KiB x R) that Mosaic compiles without ``vmem_limit_bytes``. Printed figures feed
``tpukernels.chips`` (libtpu 0.0.52: v4 16, v5e 16, v5p 16, v6e 32, tpu7x 32 MiB).

Run: ``.venv/bin/python benchmarks/probe_scoped_vmem.py``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from tpukernels.chips import CHIPS  # noqa: E402
from tpukernels.targets.compile_only import tpu_device  # noqa: E402


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def compiles(chip: str, rows: int) -> bool:
    dev = tpu_device(chip)
    x = jax.ShapeDtypeStruct((rows * 4, 1024), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(dev))
    spec = pl.BlockSpec((rows, 1024), lambda i: (i, 0))
    fn = pl.pallas_call(_copy, grid=(4,), in_specs=[spec], out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
    try:
        with jax.default_device(dev):
            jax.jit(fn).lower(x).compile()
        return True
    except Exception:  # the compiler's VMEM OOM is the answer we are looking for
        return False


def main():
    for name in CHIPS:
        lo, hi = 8, 8192
        while hi - lo > 8:
            mid = (lo + hi) // 2 // 8 * 8
            lo, hi = (mid, hi) if compiles(name, mid) else (lo, mid)
        print(f"{name:6} largest copy block {lo:5d} x 1024 f32 -> {lo * 1024 * 4 * 4 / 2**20:.1f} MiB of blocks compile")


if __name__ == "__main__":
    main()
