"""Grouped matmul family: tpukernels' grouped_matmul vs XLA's ``jax.lax.ragged_dot`` and JAX's megablox
``gmm``, bf16 in, bf16 out, at Mixtral-8x7B expert shapes.

Shapes: :data:`tpukernels.library.grouped_matmul.STANDARD_CASES`: 8192 tokens, top-2 = 16384 rows over 8
experts, hidden 4096, ffn 14336: the gate/up projection ``x[16384, 4096] @ W1[g].T`` (``W1 [8, 14336, 4096]``,
``transpose_rhs=True``, HF's layout), the down projection ``h[16384, 14336] @ W2[g].T`` (``[8, 4096, 14336]``)
and ``x @ W[g]`` with ``W [8, 4096, 14336]`` (``transpose_rhs=False``, megablox's layout); the weight
gradient (tgmm) of the first, ``d_W[g] = x[rows of g]^T @ dO[rows of g]``.

* ``tpukernels``: ``grouped_matmul_fwd`` / ``grouped_matmul_tgmm`` at the config a call gets on the chip
  (shipped tuning DB, else heuristic), including the on-device tile-metadata computation, estimated on one
  output-column block and scaled by the number of blocks (``_one_block_args``; megablox the same way);
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

from .core import Case, Impl, kernel_program, xla_impl

FAMILY = "grouped_matmul"
JAX_TILING = (512, 1024, 1024)  # tm, tk, tn
JAX_TILING_TGMM = (512, 512, 1024)

REASONS: dict = {}
#: realistic skewed Mixtral routing for the data-dependent analysis (8192 tokens, top-2, 8 experts)
SKEW = 1.2


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(":")[0].split("x"))


def _one_block_args(kernel, args, kwargs, cfg):
    """``(args, n_blocks)``: the same call with N cut to one output-column block of ``cfg`` (tgmm: one
    (K, N) block), and how many such blocks the full call has. The N (and tgmm K) axes are outer parallel
    grid axes whose passes repeat the same schedule, so the full estimate is ``n_blocks`` times this one's
    (it counts each pass's pipeline warm-up once per pass: slightly pessimistic). libtpu's estimator needs
    ~20 GB and >10 min for the full 16384 x 14336 grids; one block takes a fraction of that."""
    import tpukernels.library  # noqa: F401

    gm = importlib.import_module("tpukernels.library.grouped_matmul")
    a = list(args)
    if kernel is gm.grouped_matmul_tgmm:
        (M, K), (_, N) = _shape(a[2]), _shape(a[3])
        bk, bn = min(cfg["bk"], K), min(cfg["bn"], N)
        a[2], a[3] = f"{M}x{bk}:bf16", f"{M}x{bn}:bf16"
        return tuple(a), -(-K // bk) * -(-N // bn)
    G, d1, d2 = _shape(a[3])
    tr = bool(kwargs.get("transpose_rhs"))
    N = d1 if tr else d2
    bn = min(cfg["bn"], N)
    a[3] = f"{G}x{bn}x{d2}:bf16" if tr else f"{G}x{d1}x{bn}:bf16"
    return tuple(a), -(-N // bn)


def _ours(kernel, args, kwargs) -> Impl:
    def cycles(est, chip):
        _, _, cfg, source = kernel_program(kernel, chip, args, kwargs)  # the config a full call gets
        small, n = _one_block_args(kernel, args, kwargs, cfg)
        fn, structs, _, _ = kernel_program(kernel, chip, small, kwargs, cfg)
        return est.cycles(fn, structs, chip) * n, dict(cfg, source=source, scaled=f"{n} blocks")

    return Impl("tpukernels", "ours", cycles)


def _megablox(fn_of_n, structs_of_n, n_blocks: int, config: str, name: str) -> Impl:
    """megablox at one output-column block (grid axis 0), scaled by the number of blocks (as ours)."""
    return Impl(name, "public", lambda est, chip: (est.cycles(fn_of_n, structs_of_n, chip) * n_blocks, None),
                config=config + f" ({n_blocks} blocks)")


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
            one = [jax.ShapeDtypeStruct((M, tk), bf16), jax.ShapeDtypeStruct((M, tn), bf16), sg]
            impls = [_ours(kernel, args, kwargs), xla_impl(xla_fn, [sx, sy, sg], name="xla ragged_dot"),
                     _megablox(jax_fn, one, -(-K // tk) * -(-N // tn), f"tiling={tm},{tk},{tn}", "jax megablox tgmm")]
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
            one = [sx, jax.ShapeDtypeStruct((G, tn, K) if tr else (G, K, tn), bf16), sg]
            impls = [_ours(kernel, args, kwargs),
                     xla_impl(xla_fn, [sx, skn, sg], name="xla ragged_dot"),
                     _megablox(jax_fn, one, -(-N // tn), f"tiling={tm},{tk},{tn}" + (",transpose_rhs" if tr else ""),
                               "jax megablox gmm")]
            hbm = (M * K + G * K * N + M * N) * 2
        for chip in chips:
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=2 * M * K * N, impls=impls))
    return out


def data_cost(kernel_name: str, M: int, K: int, N: int, sizes, config: dict, transpose_rhs: bool = False) -> dict:
    """What the static model cannot see, computed exactly for one set of group sizes (analytic, not a
    measurement): the Pallas pipeline's HBM bytes (a block is copied whenever its index differs from the
    previous grid step's, walked over the real schedule) and the MXU FLOPs of the work items that compute.

    Returns ``{"hbm_bytes", "mxu_flops", "items", "computing_items"}``.
    """
    import jax.numpy as jnp
    import numpy as np

    gm = importlib.import_module("tpukernels.library.grouped_matmul")
    G = len(sizes)
    bm, bk, bn = (gm._clamp(d, config[b]) for d, b in ((M, "bm"), (K, "bk"), (N, "bn")))
    T = gm.num_items(M, G, bm)
    sched = gm._fwd_schedule if kernel_name.endswith("fwd") else gm._tgmm_schedule
    (tab,) = sched(jnp.asarray(sizes, jnp.int32), jnp.zeros(1, jnp.int32), M=M, G=G, bm=bm, T=T)
    tab = np.asarray(tab).reshape(gm.N_FIELDS, T)
    flags = tab[gm.F_FLAGS] ^ gm.ALL
    compute = (flags & gm.COMPUTE) != 0
    gk, gn = -(-K // bk), -(-N // bn)
    prev, nbytes = {}, 0

    def visit(name, idx, blk_bytes):
        nonlocal nbytes
        if prev.get(name) != idx:
            nbytes += blk_bytes
            prev[name] = idx

    if kernel_name.endswith("fwd"):
        for n in range(gn):
            for i in range(T):
                for k in range(gk):
                    ke = k if compute[i] else gk - 1
                    visit("lhs", (tab[gm.F_SRC_TILE, i], ke), bm * bk * 2)
                    visit("rhs", (tab[gm.F_GROUP, i], ke, n), bk * bn * 2)
                    visit("out", (tab[gm.F_TILE, i], n), bm * bn * 2)
        flops = int(compute.sum()) * gn * gk * 2 * bm * bk * bn
    else:  # tgmm: grid (K/bk, N/bn, T); x [M, K], y [M, N], out [G, K, N]
        for kk in range(gk):
            for n in range(gn):
                for i in range(T):
                    visit("x", (tab[gm.F_SRC_TILE, i], kk), bm * bk * 2)
                    visit("y", (tab[gm.F_SRC_TILE, i], n), bm * bn * 2)
                    visit("out", (tab[gm.F_GROUP, i], kk, n), bk * bn * 2)
        flops = int(compute.sum()) * gn * gk * 2 * bm * bk * bn
    return {"hbm_bytes": int(nbytes), "mxu_flops": flops, "items": T, "computing_items": int(compute.sum())}


def _parse_config(text: str) -> dict:
    out = {}
    for kv in (text or "").split(","):
        k, _, v = kv.partition("=")
        if k in ("bm", "bk", "bn"):
            out[k] = int(v)
    return out


def reason(row: dict) -> str | None:
    """For tpukernels rows: the data-dependent cost at skewed Mixtral group sizes (analytic, exact schedule)."""
    if row.get("kind") != "ours" or row.get("model_us") is None:
        return REASONS.get((row["chip"], row["op"]))
    from ..perf import hbm_bandwidth, peak_flops

    gm = importlib.import_module("tpukernels.library.grouped_matmul")
    cfg = _parse_config(row.get("config", ""))
    if set(cfg) != {"bm", "bk", "bn"}:
        return None
    mx = gm.MIXTRAL
    sizes = gm.skewed_group_sizes(mx["tokens"], mx["top_k"], mx["experts"], SKEW)
    M, K, N = _dims(row)
    name = "tgmm" if row["op"].startswith("tgmm") else "fwd"
    c = data_cost(name, M, K, N, sizes, cfg, transpose_rhs="T" in row["op"])
    mem_us = c["hbm_bytes"] / hbm_bandwidth(row["chip"]) * 1e6
    mxu_us = c["mxu_flops"] / peak_flops(row["chip"]) * 1e6
    return (f"analytic at skewed group sizes {sizes}: {c['computing_items']}/{c['items']} work items compute, "
            f"MXU work {c['mxu_flops'] / row['flops']:.2f}x the ideal ({mxu_us:,.0f} µs at peak), pipeline copies "
            f"{c['hbm_bytes'] / 1e9:.2f} GB ({mem_us:,.0f} µs at HBM bandwidth): the static model sees neither")


def _dims(row: dict) -> tuple[int, int, int]:
    """(M, K, N) of a row from its shape text."""
    import re

    nums = [int(x) for x in re.findall(r"\d+", row["shape"])]
    if row["op"].startswith("tgmm"):  # "MxK^T @ MxN, G=g"
        return nums[0], nums[1], nums[3]
    if "W[g].T" in row["op"]:  # "MxK @ (GxNxK).T"
        return nums[0], nums[1], nums[3]
    return nums[0], nums[1], nums[4]  # "MxK @ GxKxN"
