"""Attention family: tpukernels' flash attention vs XLA and JAX's Pallas TPU attention kernels.

Shapes: :data:`tpukernels.library.attention.STANDARD_CASES`: ``B=1, Hq=32, Hkv=8, D=128``, causal
(top-left), bf16, ``S = 4096, 8192``; forward and backward.

* ``tpukernels``: ``fa_forward`` (forward); the backward a call runs on the chip (:func:`bwd_kernels`, the
  choice of ``backward_fused.backward_mode``): the fused ``fa_backward_fused`` where ``FUSED_BY_CHIP`` lists the
  chip and the kernel takes the call (its resident dQ fits: not tpu7x at S=8192, G=4), else ``fa_backward_dq`` +
  ``fa_backward_dkv``; plus the ``rowsum(dO * O)`` XLA op the wrapper runs; each at the config a call gets on
  the chip. (The fused kernel's float32 dQ is cast to bf16 by one more XLA op, not counted: 2 x 4 bytes x the
  query elements, ~1% of the backward's time at these shapes.)
* ``xla``: ``softmax(Q K^T * scale + causal mask) V`` in ``jax.numpy`` (query heads grouped for GQA),
  estimated as two programs (the masked softmax writing P in bf16, then ``P V``; the single program aborts
  libtpu's profiler; XLA materialises P in HBM at these lengths either way). libtpu 0.0.52's profiler also
  aborts on these programs at S >= 4096 (``llo_execution_graph.cc``); the figure is then a **floor**
  (:func:`xla_floor_us`): a lower bound on XLA's time, not an estimate.
* ``jax flash_attention``: ``jax.experimental.pallas.ops.tpu.flash_attention`` at blocks
  ``block_q=1024, block_k_major=1024, block_k=512`` (the best of a sweep on v5e/v6e,
  ``benchmarks/attention.py --sweep jax``; its default 128 blocks are 10-17x slower). It has no GQA: it
  gets K/V already repeated to 32 heads (the repeat, and its reduction in the backward, are not counted:
  in its favour; with the repeat inside the program libtpu's profiler aborts on its S=8192 backward).
* ``jax splash_attention``: ``jax.experimental.pallas.ops.tpu.splash_attention`` (GQA through its MQA
  kernel, vmapped over the 8 KV heads; fused backward), blocks ``block_q=block_kv=1024,
  block_kv_compute=512``, causal mask.

tokamax (0.0.12, the newest release that installs beside jax 0.10.2) is not a separate column: its TPU
attention wraps this same splash kernel (``tokamax/_src/ops/attention/pallas_mosaic_tpu.py``) and registers
only when the default JAX backend is a TPU.

Every implementation is estimated at 1/8 of the heads (Hq=4, Hkv=1, same group size) and scaled by 8:
the estimate is linear in the head count (``benchmarks/attention.py --check-scaling``). Backward figures of
JAX's kernels are ``estimate(vjp) - estimate(forward)``; the vjp's forward also saves its residuals
(``l``, ``m`` / logsumexp), which this charges to JAX's backward (against it, by little: 2 x Hq x S f32
values beside the S^2 work).

Credibility probe: each kernel is also estimated **without** the causal mask, where its work is known
exactly (``4 * Hq * S^2 * D`` FLOPs forward). libtpu 0.0.52 estimates splash attention below that
variant's MXU roofline (v6e, S=4096: the same cycles with and without the mask): its cost model misses
most of splash's work (likely because splash's grid steps are driven by scalar-prefetched mask tables),
so splash's figures are flagged as not credible and not used in comparisons.
"""

from __future__ import annotations

from .core import Case, Impl, ours_impl

FAMILY = "attention"
B, HQ, HKV, D = 1, 32, 8, 128
DIV = 8  # estimate at HQ/DIV, HKV/DIV heads; scale by DIV
SEQS = (4096, 8192)
JAX_BLOCKS = (1024, 1024, 512)  # block_q, block_k_major, block_k
SPLASH_BLOCKS = (1024, 1024, 512)  # block_q, block_kv, block_kv_compute

REASONS = {
    ("v5e", "bwd"): "libtpu 0.0.52's static profiler aborts (signal 6) on v5e's backward at these causal shapes: on "
    "the fused kernel v5e runs by default, as on the split dK/dV kernel before it, so there is no figure; both compile "
    "for v5e (tests/test_attention.py, tests/test_attention_fused_bwd.py compile-only tests)",
    ("tpu7x", "bwd"): "XLA's own figure is unavailable (libtpu's profiler aborts on it); the floor is the larger "
    "of XLA's MXU time for every score (no causal skipping) and its HBM time including one write and read of the "
    "S x S probabilities, a bound no real schedule reaches, so being 2.5% above it does not show XLA is faster",
}


def attention_io_bytes(S: int, hq: int, hkv: int, backward: bool) -> int:
    it = 2
    fwd = (2 * hq * S * D + 2 * hkv * S * D) * it + hq * S * 4  # q, o, k, v, lse
    if not backward:
        return B * fwd
    return B * ((3 * hq * S * D + 4 * hkv * S * D) * it + 2 * hq * S * 4 + 2 * hq * S * D * it)  # + dq, dk, dv, di


def attention_flops(S: int, hq: int, backward: bool, causal: bool = True) -> int:
    mm = 4 * B * hq * S * S * D // (2 if causal else 1)
    return int(mm * (2.5 if backward else 1))


def xla_floor_us(chip: str, S: int, backward: bool) -> float:
    """A lower bound on XLA's attention time (model, µs): XLA materialises the probabilities, so it moves
    at least one bf16 write + read of the S x S scores per head (4 bytes per score; the backward at least
    twice that) on top of Q, K, V, O, and it computes every score (no causal skipping)."""
    from ..perf import model_time

    scores = B * HQ * S * S
    byts = attention_io_bytes(S, HQ, HKV, backward) + scores * 4 * (2 if backward else 1)
    return model_time(chip, None, int(byts), int(4 * B * HQ * S * S * D * (2.5 if backward else 1))).time_us


def _programs(S: int, hq: int, hkv: int):
    """jitted programs (xla fwd parts, xla fwd+bwd, jax flash fwd/fwd+bwd, splash fwd/fwd+bwd) at ``hq`` heads."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as jfa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    dt, g = jnp.bfloat16, hq // hkv
    q = jax.ShapeDtypeStruct((B, hq, S, D), dt)
    kv = jax.ShapeDtypeStruct((B, hkv, S, D), dt)
    p_ = jax.ShapeDtypeStruct((B, hkv, g, S, S), dt)

    def probs(q, k):
        qg = q.reshape(B, hkv, g, S, D)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
        s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(S)[:, None], s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1).astype(dt)

    def pv(p, v):
        return jnp.einsum("bhgqk,bhkd->bhgqd", p, v, preferred_element_type=jnp.float32).astype(dt).reshape(B, hq, S, D)

    def xla_fwd_bwd(q, k, v, do):
        return jax.vjp(lambda q, k, v: pv(probs(q, k), v), q, k, v)[1](do)

    bq, bkm, bk = (min(b, S) for b in JAX_BLOCKS)
    bs = jfa.BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1, block_q_major_dkv=bq,
                        block_k_major_dkv=bkm, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bkm,
                        block_k_dq=bk, block_q_dq=bq)

    def flash(causal):
        def fwd(q, k, v):  # k, v: [B, Hq, S, D] (no GQA: K/V come already repeated to the query heads)
            return jfa.flash_attention(q, k, v, causal=causal, sm_scale=D ** -0.5, block_sizes=bs)
        return fwd

    sq, skv, skc = (min(b, S) for b in SPLASH_BLOCKS)

    def splash(causal):
        mask = sm.MultiHeadMask([(sm.CausalMask((S, S)) if causal else sm.FullMask((S, S))) for _ in range(g)])
        kern = sk.make_splash_mqa_single_device(mask, block_sizes=sk.BlockSizes(
            block_q=sq, block_kv=skv, block_kv_compute=skc, block_q_dkv=sq, block_kv_dkv=skv,
            block_kv_dkv_compute=skc, use_fused_bwd_kernel=True))

        def fwd(q, k, v):
            o = jax.vmap(kern)((q * D ** -0.5).reshape(B * hkv, g, S, D), k.reshape(B * hkv, S, D),
                               v.reshape(B * hkv, S, D))
            return o.reshape(B, hq, S, D)
        return fwd

    def vjp_of(f):
        return lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)

    def di(do, o):
        return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)

    J = jax.jit
    return {
        "xla_fwd": [(J(probs), [q, kv]), (J(pv), [p_, kv])],
        "xla_fwd_bwd": [(J(xla_fwd_bwd), [q, kv, kv, q])],
        "flash": {c: ((J(flash(c)), [q, q, q]), (J(vjp_of(flash(c))), [q, q, q, q])) for c in (True, False)},
        "splash": {c: ((J(splash(c)), [q, kv, kv]), (J(vjp_of(splash(c))), [q, kv, kv, q])) for c in (True, False)},
        "di": (J(di), [q, q]),
    }


def bwd_kernels(chip: str, full_args, kwargs: dict | None = None) -> tuple:
    """The backward kernels a call at ``full_args`` (q, k, v, dO, lse, di shape strings) and ``kwargs`` (the
    statics; default causal top-left) runs on ``chip``:
    ``(fa_backward_fused,)`` where :data:`~tpukernels.library.attention.backward_fused.FUSED_BY_CHIP` lists the
    chip and the fused kernel lowers for the call there (it raises ``ArgumentError`` when it refuses the call,
    e.g. a resident dQ over a quarter of tpu7x's VMEM cap), else ``(fa_backward_dq, fa_backward_dkv)``."""
    from ..errors import ArgumentError
    from ..library.attention import CAUSAL, fa_backward_dkv, fa_backward_dq
    from ..library.attention.backward_fused import FUSED_BY_CHIP, fa_backward_fused
    from .core import kernel_program

    if FUSED_BY_CHIP.get(chip, False):
        try:
            kernel_program(fa_backward_fused, chip, full_args, dict(CAUSAL) if kwargs is None else kwargs)
            return (fa_backward_fused,)
        except ArgumentError:
            pass
    return fa_backward_dq, fa_backward_dkv


def cases(chips) -> list[Case]:
    return [c for S in SEQS for c in _cases_at(S, chips)]


def _cases_at(S: int, chips) -> list[Case]:
    import functools

    from ..library.attention import CAUSAL, fa_forward

    hq, hkv = HQ // DIV, HKV // DIV
    out = []
    progs = functools.lru_cache(None)(lambda: _programs(S, hq, hkv))

    def specs(h, kvh, backward):
        q, kv = f"{B}x{h}x{S}x{D}:bf16", f"{B}x{kvh}x{S}x{D}:bf16"
        rows = f"{B}x{h}x1x{S}:f32"
        return (q, kv, kv, q, rows, rows) if backward else (q, kv, kv)

    for backward in (False, True):
        pas = "bwd" if backward else "fwd"
        small, full = specs(hq, hkv, backward), specs(HQ, HKV, backward)
        nc = dict(CAUSAL, causal=False)

        def probe_ours(est, chip, small=small, full=full, nc=nc, backward=backward):
            kernels = bwd_kernels(chip, full) if backward else (fa_forward,)
            impl = ours_impl([(k, small, nc, full) for k in kernels],
                             extra=(lambda e, c: e.cycles(*progs()["di"], c)) if backward else None)
            return impl.cycles(est, chip)[0], attention_flops(S, hq, backward, causal=False)

        def jax_cycles(kind, causal, backward=backward):
            def f(est, chip):
                fwd, fb = progs()[kind][causal]
                c = est.cycles(*fwd, chip)
                return (est.cycles(*fb, chip) - c if backward else c) * DIV, None
            return f

        def xla_cycles(est, chip, backward=backward):
            fwd = sum(est.cycles(fn, st, chip) for fn, st in progs()["xla_fwd"])
            if not backward:
                return fwd * DIV, None
            return (est.cycles(*progs()["xla_fwd_bwd"][0], chip) - fwd) * DIV, None

        def jax_probe(kind, backward=backward):
            def f(est, chip):
                return jax_cycles(kind, False, backward)(est, chip)[0] // DIV, attention_flops(S, hq, backward, causal=False)
            return f

        for chip in chips:
            kernels = bwd_kernels(chip, full) if backward else (fa_forward,)
            impls = [
                ours_impl([(k, small, dict(CAUSAL), full) for k in kernels], scale=DIV,
                          extra=(lambda e, c: e.cycles(*progs()["di"], c)) if backward else None,
                          probe=probe_ours),
                Impl("xla", "xla", xla_cycles, config="XLA fusion",
                     floor_us=lambda chip, S=S, backward=backward: xla_floor_us(chip, S, backward)),
                Impl("jax flash_attention", "public", jax_cycles("flash", True), probe=jax_probe("flash"),
                     config="block_q={},block_k_major={},block_k={} (K/V given repeated to {} heads)".format(
                         *(min(b, S) for b in JAX_BLOCKS), HQ)),
                Impl("jax splash_attention", "public", jax_cycles("splash", True), probe=jax_probe("splash"),
                     config="block_q={},block_kv={},block_kv_compute={} (MQA kernel per KV head{})".format(
                         *(min(b, S) for b in SPLASH_BLOCKS), ", fused bwd" if backward else "")),
            ]
            out.append(Case(FAMILY, f"flash_attention {pas}", f"S={S} Hq={HQ} Hkv={HKV} D={D} causal", chip,
                            hbm_bytes=attention_io_bytes(S, HQ, HKV, backward), flops=attention_flops(S, HQ, backward),
                            impls=impls))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get((row["chip"], row["op"].split()[-1]))
