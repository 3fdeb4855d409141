"""Matmul family: tpukernels' matmul vs XLA's dot and JAX's Pallas TPU matmul, bf16 in, bf16 out.

Shapes: :data:`tpukernels.library.matmul_ops.STANDARD_CASES` (1024^3, 4096^3, 8192^3 and the MLP
up-projection ``x[8192, 4096] @ W[14336, 4096].T``).

* ``tpukernels``: ``matmul_nn`` / ``matmul_nt`` at the config a call gets on the chip (tuning DB, else
  heuristic);
* ``xla``: ``jnp.dot(a, b, preferred_element_type=f32).astype(bf16)`` (``a @ w.T`` for the Linear shape);
* ``jax matmul``: ``jax.experimental.pallas.ops.tpu.matmul.matmul`` at the JAX Pallas TPU matmul guide's
  best published v5e blocks, ``block_shape=(512, 1024), block_k=1024``
  (https://docs.jax.dev/en/latest/pallas/tpu/matmul.html; ``benchmarks/data/jax_pallas_tpu_matmul_v5e.json``).
  It has no transposed operand, so for the Linear shape it gets ``W.T`` already materialised (the transpose
  is not counted: in its favour).

Bytes: ``(M*K + K*N + M*N) * 2`` (each operand once); FLOPs ``2*M*N*K``.
"""

from __future__ import annotations

from .core import Case, Impl, ours_impl, xla_impl

FAMILY = "matmul"
LIBRARY = ("matmul_ops",)  # the library modules its figures depend on (bench.core.source_digest)
JAX_BLOCKS = (512, 1024, 1024)  # bm, bk, bn

#: why tpukernels is slower where it is (analysis behind each entry: the matmul module docstring)
REASONS = {
    ("v6e", "4096x4096x4096"): "the first block load and last write-back of each core's pass are not overlapped; "
    "with 4096^3 on v6e that exposed time is ~2% of the run (at 8192^3 it amortizes and ours is faster)",
}


def _dims(kernel_name: str, a: str, b: str):
    m, k = (int(d) for d in a.split(":")[0].split("x")[1:])
    n = int(b.split(":")[0].split("x")[1 if kernel_name.endswith("nt") else 2])
    return m, k, n


def cases(chips) -> list[Case]:
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import matmul as jmm

    import sys

    import tpukernels.library  # noqa: F401  (the package attribute `matmul` is the function)

    mm = sys.modules["tpukernels.library.matmul_ops"]

    bf16, f32 = jnp.bfloat16, jnp.float32
    out = []
    for kernel, (a, b), kwargs in mm.STANDARD_CASES:
        layout = "nt" if kernel.qualname.endswith("nt") else "nn"
        M, K, N = _dims(kernel.qualname, a, b)
        sa = jax.ShapeDtypeStruct((M, K), bf16)
        if layout == "nt":
            sw = jax.ShapeDtypeStruct((N, K), bf16)
            xla_fn = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=f32).astype(bf16))
            op, shape = "linear x @ W.T", f"{M}x{K} @ ({N}x{K}).T"
        else:
            sw = jax.ShapeDtypeStruct((K, N), bf16)
            xla_fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=f32).astype(bf16))
            op, shape = "matmul", f"{M}x{K}x{N}"
        bm, bk, bn = (min(b_, d) for b_, d in zip(JAX_BLOCKS, (M, K, N)))
        jax_fn = jax.jit(lambda x, y, bm=bm, bk=bk, bn=bn: jmm.matmul(x, y, block_shape=(bm, bn), block_k=bk))
        skn = jax.ShapeDtypeStruct((K, N), bf16)
        for chip in chips:
            out.append(Case(
                FAMILY, op, shape, chip, hbm_bytes=(M * K + K * N + M * N) * 2, flops=2 * M * N * K,
                impls=[
                    ours_impl([(kernel, (a, b), kwargs)]),
                    xla_impl(xla_fn, [sa, sw]),
                    Impl("jax matmul", "public",
                         lambda est, chip, f=jax_fn, s=(sa, skn): (est.cycles(f, list(s), chip), None),
                         config=f"bm={bm},bk={bk},bn={bn}" + (" (W.T materialised)" if layout == "nt" else "")),
                ]))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get((row["chip"], row["shape"]))
