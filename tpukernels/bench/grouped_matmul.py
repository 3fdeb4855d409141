"""Grouped matmul family: tpukernels' grouped_matmul vs XLA's ``jax.lax.ragged_dot`` and JAX's megablox
``gmm``, bf16 in, bf16 out, at Mixtral-8x7B expert shapes.

Shapes: :data:`tpukernels.library.grouped_matmul.STANDARD_CASES`: 8192 tokens, top-2 = 16384 rows over 8
experts, hidden 4096, ffn 14336: the gate/up projection ``x[16384, 4096] @ W1[g].T`` (``W1 [8, 14336, 4096]``,
``transpose_rhs=True``, HF's layout), the down projection ``h[16384, 14336] @ W2[g].T`` (``[8, 4096, 14336]``)
and ``x @ W[g]`` with ``W [8, 4096, 14336]`` (``transpose_rhs=False``, megablox's layout); the weight
gradient (tgmm) of the first, ``d_W[g] = x[rows of g]^T @ dO[rows of g]``.

* ``tpukernels``: ``grouped_matmul_fwd`` / ``grouped_matmul_tgmm`` at the config a call gets on the chip
  (shipped tuning DB, else heuristic), including the on-device tile-metadata computation;
* ``xla ragged_dot``: ``jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=f32).astype(bf16)``
  (``rhs`` pre-transposed for the ``W.T`` cases: the transpose is not counted, in its favour); for the
  weight gradient ``jax.lax.ragged_dot_general`` with the ragged contracting dimension (what
  ``jax.grad(ragged_dot)`` emits);
* ``jax megablox gmm`` / ``tgmm``: ``jax.experimental.pallas.ops.tpu.megablox`` at tiling
  ``(512, 1024, 1024)`` (tgmm ``(512, 512, 1024)``), the blocks our heuristic uses, clamped to the shape;
  ``transpose_rhs=True`` where we use it (megablox supports it natively).

Group sizes do not enter the model: every program is estimated statically from its grid, which for
ours is the static bound ``ceil(M / bm) + G - 1`` work items, for megablox a grid whose length is
traced from the group sizes (libtpu's estimator then sees the program, not the data). Bytes
``(M*K + G*K*N + M*N) * 2`` (each operand once, the minimum); FLOPs ``2*M*K*N`` (every row once).
"""

from __future__ import annotations

import importlib

from .core import Case, Impl, ours_impl, xla_impl

FAMILY = "grouped_matmul"
JAX_TILING = (512, 1024, 1024)  # tm, tk, tn
JAX_TILING_TGMM = (512, 512, 1024)

REASONS: dict = {}


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(":")[0].split("x"))


def cases(chips) -> list[Case]:
    import jax
    import jax.numpy as jnp

    import tpukernels.library  # noqa: F401

    gm = importlib.import_module("tpukernels.library.grouped_matmul")
    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    out = []
    for kernel, args, kwargs in gm.STANDARD_CASES:
        G = _shape(args[0])[0]
        if kernel is gm.grouped_matmul_tgmm:
            (M, K), (_, N) = _shape(args[2]), _shape(args[3])
            sx, sy = jax.ShapeDtypeStruct((M, K), bf16), jax.ShapeDtypeStruct((M, N), bf16)
            sg = jax.ShapeDtypeStruct((G,), i32)
            dims = jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
                rhs_group_dimensions=[])
            xla_fn = jax.jit(lambda x, y, gs: jax.lax.ragged_dot_general(
                x, y, gs, dims, preferred_element_type=f32).astype(bf16))
            tm, tk, tn = (min(b, d) for b, d in zip(JAX_TILING_TGMM, (M, K, N)))
            jax_fn = jax.jit(lambda x, y, gs, t=(tm, tk, tn): mb.tgmm(
                x.T, y, gs, preferred_element_type=bf16, tiling=t))
            op, shape = "tgmm (d_W)", f"{M}x{K}^T @ {M}x{N}, G={G}"
            impls = [ours_impl([(kernel, args, kwargs)]), xla_impl(xla_fn, [sx, sy, sg], name="xla ragged_dot"),
                     Impl("jax megablox tgmm", "public",
                          lambda est, chip, f=jax_fn, s=(sx, sy, sg): (est.cycles(f, list(s), chip), None),
                          config=f"tiling={tm},{tk},{tn}")]
            hbm = (M * K + M * N + G * K * N) * 2
        else:
            tr = bool(kwargs.get("transpose_rhs"))
            M, K = _shape(args[2])
            _, d1, d2 = _shape(args[3])
            N = d1 if tr else d2
            sx, sg = jax.ShapeDtypeStruct((M, K), bf16), jax.ShapeDtypeStruct((G,), i32)
            sw = jax.ShapeDtypeStruct((G, d1, d2), bf16)
            skn = jax.ShapeDtypeStruct((G, K, N), bf16)
            xla_fn = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=f32).astype(bf16))
            tm, tk, tn = (min(b, d) for b, d in zip(JAX_TILING, (M, K, N)))
            jax_fn = jax.jit(lambda x, w, gs, t=(tm, tk, tn), tr=tr: mb.gmm(
                x, w, gs, preferred_element_type=bf16, tiling=t, transpose_rhs=tr))
            op = "gmm x @ W[g].T" if tr else "gmm x @ W[g]"
            shape = f"{M}x{K} @ ({G}x{N}x{K}).T" if tr else f"{M}x{K} @ {G}x{K}x{N}"
            impls = [ours_impl([(kernel, args, kwargs)]),
                     xla_impl(xla_fn, [sx, skn, sg], name="xla ragged_dot"),
                     Impl("jax megablox gmm", "public",
                          lambda est, chip, f=jax_fn, s=(sx, sw, sg): (est.cycles(f, list(s), chip), None),
                          config=f"tiling={tm},{tk},{tn}" + (",transpose_rhs" if tr else ""))]
            hbm = (M * K + G * K * N + M * N) * 2
        for chip in chips:
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=2 * M * K * N, impls=impls))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get((row["chip"], row["op"]))
