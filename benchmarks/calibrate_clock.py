"""Calibrate the model's MXU FLOP/cycle per chip from libtpu's own static estimate (a model, not a measurement).

Compiles XLA's ``jnp.dot`` of two 4096x4096 bf16 matrices for each chip (compile-only), reads libtpu's
``estimated_cycles`` and prints FLOPs / cycle next to ``2 * 4 * mxu_column_size**2`` (the 4-MXU figure
``tpukernels.perf`` assumes). Run: ``.venv/bin/python benchmarks/calibrate_clock.py``.
"""

import jax
import jax.numpy as jnp

from tpukernels.perf import MXUS_PER_CORE, clock_hz
from tpukernels.chips import get_chip
from tpukernels.targets.compile_only import estimate_cycles_of

N = 4096


def main():
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    s = jax.ShapeDtypeStruct((N, N), jnp.bfloat16)
    print(f"{'chip':6} {'est. cycles':>12} {'FLOP/cycle':>11} {'4-MXU FLOP/cycle':>17} {'ratio':>6} {'clock GHz':>9}")
    for name in ("v5e", "v6e", "tpu7x"):
        cyc = estimate_cycles_of(fn, name, [s, s])
        fpc = 2 * N**3 / cyc
        model = 2 * MXUS_PER_CORE * get_chip(name).info.mxu_column_size ** 2
        print(f"{name:6} {cyc:12d} {fpc:11.0f} {model:17d} {fpc / model:6.3f} {clock_hz(name) / 1e9:9.2f}")


if __name__ == "__main__":
    main()
