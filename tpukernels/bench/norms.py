"""Normalization family: tpukernels' RMSNorm / fused add+RMSNorm / LayerNorm (forward and backward) vs
the same math written in ``jax.numpy`` and fused by XLA.

Shapes: ``[8192, 4096]`` (:data:`tpukernels.library.norms.STANDARD_CASES`) and ``[8192, 8192]``, bf16
activations and weights, f32 statistics (``rstd``, ``mean``), Llama casting.

There is no public Pallas TPU normalization kernel to compare with: ``jax.experimental.pallas.ops.tpu``
has none, and tokamax's ``layer_norm`` runs its XLA implementation on TPU (its Pallas normalization is
Triton, for GPUs). XLA fuses each of these ops into one or two loops, which makes it the baseline.

Bytes: every input read once and every output written once (the HBM roofline); FLOPs are not counted
(these ops are memory-bound).
"""

from __future__ import annotations

from .core import Case, ours_impl, xla_impl

FAMILY = "norms"
SHAPES = ((8192, 4096), (8192, 8192))

#: why tpukernels is slower where it is, from the figures and the experiment named in each text
_VPU = ("libtpu estimates this kernel VPU-bound (its cycles exceed the HBM time) and XLA's fusion of the same "
        "math at fewer cycles. Block size is not the cause: with a 28 MiB block budget instead of 12 MiB, "
        "the larger blocks gain at most 3% (block_rows=128 where 64 is shipped) or overflow the scoped VMEM "
        "(256; estimated with "
        "tpukernels.bench.core.Estimator, 2026-11-30), so the extra cycles are in the body's per-element work "
        "(f32 upcasts of whole rows, separate passes for the row statistics); not isolated further")
REASONS = {
    **{("tpu7x", "8192x8192", op): _VPU for op in ("rms_norm fwd", "rms_norm bwd", "layer_norm fwd", "layer_norm bwd")},
    ("v6e", "8192x8192", "layer_norm bwd"): _VPU,
    ("tpu7x", "8192x4096", "rms_norm fwd"): "tpukernels' libtpu cycles sit 0.8% above the HBM time (36.6 vs "
    "36.3 µs) while XLA's are below it: 0.8% slower in the model, at the edge of its resolution",
}


def xla_fns(eps_rms: float, eps_ln: float) -> dict:
    """``{op: fn}``: each library norm written in ``jax.numpy`` (XLA fuses it), same outputs and casting."""
    import jax
    import jax.numpy as jnp

    F32 = jnp.float32

    def rms_fwd(x, w):
        xf = x.astype(F32)
        rstd = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps_rms)
        return ((xf * rstd).astype(x.dtype).astype(F32) * w.astype(F32)).astype(x.dtype), rstd

    def fused_fwd(x, r, w):
        h = (x.astype(F32) + r.astype(F32)).astype(x.dtype)
        y, rstd = rms_fwd(h, w)
        return y, h, rstd

    def rms_bwd(dy, x, rstd, w):
        dyf = dy.astype(F32)
        n = x.astype(F32) * rstd
        g = dyf * w.astype(F32)
        dx = rstd * (g - n * jnp.mean(g * n, -1, keepdims=True))
        return dx.astype(x.dtype), jnp.sum(dyf * n, 0, keepdims=True)

    def ln_fwd(x, w, b):
        xf = x.astype(F32)
        mean = jnp.mean(xf, -1, keepdims=True)
        d = xf - mean
        rstd = jax.lax.rsqrt(jnp.mean(d * d, -1, keepdims=True) + eps_ln)
        return (d * rstd * w.astype(F32) + b.astype(F32)).astype(x.dtype), mean, rstd

    def ln_bwd(dy, x, mean, rstd, w):
        dyf = dy.astype(F32)
        xhat = (x.astype(F32) - mean) * rstd
        g = dyf * w.astype(F32)
        dx = rstd * (g - jnp.mean(g, -1, keepdims=True) - xhat * jnp.mean(g * xhat, -1, keepdims=True))
        return dx.astype(x.dtype), jnp.sum(dyf * xhat, 0, keepdims=True), jnp.sum(dyf, 0, keepdims=True)

    return {"rms_norm fwd": rms_fwd, "rms_norm bwd": rms_bwd, "fused_add_rms_norm fwd": fused_fwd,
            "layer_norm fwd": ln_fwd, "layer_norm bwd": ln_bwd}


def norm_cases(n: int, h: int, dt: str = "bf16"):
    """``[(op, kernel, tensor args, statics, outputs)]`` at ``[n, h]``; args/outputs as shape strings."""
    from ..library import norms as N

    X, V, S, dW = f"{n}x{h}:{dt}", f"1x{h}:{dt}", f"{n}x1:f32", f"1x{h}:f32"
    rms = {"eps": N.DEFAULT_RMS_EPS, "offset": 0.0, "casting": "llama", "round_f16": False}
    return [
        ("rms_norm fwd", N.rms_norm_fwd, (X, V), rms, (X, S)),
        ("rms_norm bwd", N.rms_norm_bwd, (X, X, S, V, None), {"offset": 0.0}, (X, dW)),
        ("fused_add_rms_norm fwd", N.fused_add_rms_norm_fwd, (X, X, V), rms, (X, X, S)),
        ("layer_norm fwd", N.layer_norm_fwd, (X, V, V), {"eps": N.DEFAULT_LAYER_NORM_EPS}, (X, S, S)),
        ("layer_norm bwd", N.layer_norm_bwd, (X, X, S, S, V), {}, (X, dW, dW)),
    ]


def _struct(text: str):
    import jax

    from ..targets.compile_only import parse_shape

    s = parse_shape(text)
    return jax.ShapeDtypeStruct(tuple(s.shape), s.dtype)


def _nbytes(s) -> int:
    import numpy as np

    return int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize


def cases(chips) -> list[Case]:
    import jax

    from ..library import norms as N

    xla = xla_fns(N.DEFAULT_RMS_EPS, N.DEFAULT_LAYER_NORM_EPS)
    out = []
    for n, h in SHAPES:
        for op, kernel, args, statics, outs in norm_cases(n, h):
            ins = [_struct(a) for a in args if a is not None]
            hbm = sum(_nbytes(s) for s in ins) + sum(_nbytes(_struct(o)) for o in outs)
            fn = jax.jit(xla[op])
            for chip in chips:
                out.append(Case(FAMILY, op, f"{n}x{h}", chip, hbm_bytes=hbm, flops=0,
                                impls=[ours_impl([(kernel, args, statics)]), xla_impl(fn, ins)]))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get((row["chip"], row["shape"], row["op"]))
