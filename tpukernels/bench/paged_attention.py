"""Paged attention family: tpukernels' ragged paged attention vs tpu-inference's RPA v3 kernel (the one vLLM
TPU serves with) and JAX's public Pallas kernel ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``
(the one tpu-inference grew from).

Shapes: :data:`tpukernels.library.paged_attention.STANDARD_CASES`, Llama-3-8B-like (``Hq=32, Hkv=8,
D=128``, bf16 q and KV cache), page size 16 and 64:

* **decode**: 64 sequences x 2048 cached tokens, one query token each (``T = 64``);
* **mixed**: ``T = 1024`` query tokens over 64 sequences of 2048 cached tokens (prefill chunks + decode rows).

Roofline: decode is memory bound; the bytes are the KV pages the batch must read once
(``S * kv_len * 2 * Hkv * D * 2``) plus q and the output. FLOPs ``4 * T * kv_len * Hq * D`` (every query
row against its sequence's keys; an upper bound for the mixed case, where causal rows see fewer keys).

What the model sees. All three kernels are data dependent; libtpu's estimate is static:

* ours loops with static trip counts (``pl.when`` guards): the estimate is that of the static bound, every
  work item visiting every kv block of ``pages_per_seq``. For the decode batch that bound **is** the work
  (``kv_len = pages_per_seq * page_size`` and exactly one item per sequence). For the mixed batch it is an
  upper bound (items of a sequence spanning several query blocks each re-read its pages: ``79`` items for
  64 sequences at ``block_q = 64``).
* JAX's kernel and tpu-inference's RPA v3 iterate with data-dependent ``while`` loops (sequences, query
  and kv blocks). For such loops libtpu's static estimate assumes a trip count that does not depend on the
  data (found here: a DMA loop with a trip count read from SMEM costs the same for 2 and for 8
  iterations, about 40 iterations' worth), so their figures are not tied to the batch: compare with care.
  tpu-inference's call also always runs two kernels (its decode-only kernel, then its mixed kernel, each
  skipping the sequences ``distribution`` gives the other), and the static estimate charges both.

Where libtpu's profiler aborts on our full-size program (tpu7x: ``fifo_tracker.cc:436``), ours is estimated
at ``S = 8`` sequences (``T`` scaled alike, same pages per sequence, the full batch's config) and multiplied
by ``S / 8``. That is an upper bound on the full estimate: the per-program fixed cost is counted ``S / 8``
times. Checked on v6e, where both sizes estimate: every v6e row's config shows the ratio
(``S=8 x8 / full``, >= 1). On v5e libtpu aborts on every size down to one sequence
(``llo_execution_graph.cc:149``), so there is no estimate, and the figure given is the roofline (a floor).

tpu-inference (0.32.0, installed ``--no-deps``): ``tpu_inference.kernels.ragged_paged_attention.v3.kernel
.ragged_paged_attention`` with ``update_kv_cache=False`` (the same work as ours: no KV write; ours writes
the cache in a separate op) at its default block sizes (``get_default_block_sizes``: no tuned table is
consulted by v3; ``RPA_V3_*_BLOCK_SIZES`` unset), ``sm_scale=1/sqrt(D)``, its KV cache layout
``[P, page, Hkv, 2, D]`` (bf16 packing 2). Stubbed: its ``get_tpu_version()``, which reads
``jax.devices()[0].device_kind`` (a cpu here), answers the target chip's generation while tracing; and
``vmem_limit_bytes`` is ``min(3/4 of VMEM, VMEM - 24 MiB)`` (96 MiB on v5e / v6e, 40 MiB on tpu7x) instead
of its default (the whole VMEM), with which XLA's own ops beside the kernel (its q / KV packing, ~19 MiB of
VMEM here) do not fit and the compile fails (v6e: "Used 146.92M of 127.94M vmem"; tpu7x at 48 MiB: "Used
67.04M of 63.94M"; the v6e estimate at 64 MiB and 100 MiB is the same). Its mixed-batch program
(``T = 1024``) does not compile at these limits with libtpu 0.0.52 (v6e at 96 MiB: "Used 148.04M of
127.94M vmem", XLA's ops beside it take ~52 MiB there; tpu7x at 40 MiB: its default mixed blocks exceed the
scoped VMEM), so the mixed rows have no tpu-inference figure; a smaller limit on v6e (64 MiB) would likely
compile (not run: each such estimate takes ~15 minutes on this host).

JAX's kernel runs at ``num_kv_pages_per_block`` = our ``pages_per_block`` and ``num_queries_per_block=32``
(its tuned table has no entry for these shapes and its lookup needs a live TPU; 32 is its default),
``sm_scale=1/sqrt(D)``.
"""

from __future__ import annotations

import contextlib

from .core import Case, EstimateError, Impl, _fmt_config, ours_impl

FAMILY = "paged_attention"
HQ, HKV, D = 32, 8, 128
#: sequences of the reduced batch estimated where the full one aborts libtpu's profiler (module docstring)
SMALL_S = 8
REASONS: dict = {
    ("v5e", "decode"): "libtpu 0.0.52's static profiler aborts (llo_execution_graph.cc:149) on this kernel for v5e "
    "at every size down to one sequence: the figure is the roofline (a floor); the kernel compiles for v5e "
    "(tests/test_paged_attention.py compile-only tests)",
}
REASONS[("v5e", "mixed")] = REASONS[("v5e", "decode")]


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(":")[0].split("x"))


def _ours(kernel, args, kwargs, T: int, S: int, pps: int, ps: int, floor_us) -> Impl:
    """Ours at the full batch; where libtpu aborts on it, at ``SMALL_S`` sequences x ``S / SMALL_S`` (an upper
    bound). Where the full batch estimates, the small one is estimated too and the ratio shown (the check)."""
    from ..library import paged_attention as pa

    k, small, kw = pa._case(T * SMALL_S // S, SMALL_S, pps, ps, SMALL_S * pps)
    scaled = ours_impl([(k, small, kw, args)], scale=S // SMALL_S)

    def cycles(est, chip):
        try:
            full, cfg = ours_impl([(kernel, args, kwargs)]).cycles(est, chip)
        except EstimateError:
            c, cfg = scaled.cycles(est, chip)
            return c, f"{_fmt_config(cfg)} (estimated at S={SMALL_S}, T={T * SMALL_S // S}, x{S // SMALL_S}: " \
                      "an upper bound; the full batch aborts libtpu's profiler)"
        try:
            check = f"{scaled.cycles(est, chip)[0] / full:.2f}"
        except EstimateError:
            check = "n/a"
        return full, f"{_fmt_config(cfg)} (scaling check: S={SMALL_S} x{S // SMALL_S} / full = {check})"

    return Impl("tpukernels", "ours", cycles, floor_us=floor_us)


@contextlib.contextmanager
def tpu_inference_generation(module, chip: str):
    """tpu-inference's ``get_tpu_version()`` reads ``jax.devices()[0].device_kind`` (a cpu here): answer the
    target chip's generation while tracing for it (``module``: the tpu-inference module whose ``get_tpu_version``
    its kernel calls; also used by the quantized_matmul family)."""
    from ..chips import get_chip

    old = module.get_tpu_version
    module.get_tpu_version = lambda: get_chip(chip).generation
    try:
        yield
    finally:
        module.get_tpu_version = old


def tpu_inference_program(chip: str, T: int, S: int, pps: int, ps: int, P: int):
    """``(fn, structs, config)``: tpu-inference 0.32.0's RPA v3 (``update_kv_cache=False``, default block sizes,
    ``vmem_limit_bytes`` below VMEM; module docstring) for ``chip``.

    Raises:
        BackendUnavailableError: tpu-inference is not installed (``pip install --no-deps tpu-inference==0.32.0``).
    """
    import jax
    import jax.numpy as jnp

    from .._imports import import_tpu_inference
    from ..chips import get_chip

    K = import_tpu_inference("kernels.ragged_paged_attention.v3.kernel", "RPA v3 kernel")
    cap = get_chip(chip).vmem_capacity_bytes
    vmem = min(cap * 3 // 4, cap - (24 << 20))  # XLA's ops beside the kernel take ~19 MiB here (docstring)
    with tpu_inference_generation(K, chip):
        d = K.get_default_block_sizes(jnp.bfloat16, jnp.bfloat16, HQ, HKV, D, ps, T, S, pps, case=K.RpaCase.DECODE)
        m = K.get_default_block_sizes(jnp.bfloat16, jnp.bfloat16, HQ, HKV, D, ps, T, S, pps, case=K.RpaCase.MIXED)

    def tpu_inference_rpa_v3(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution):
        with tpu_inference_generation(K, chip):
            return K.ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                            sm_scale=D ** -0.5, update_kv_cache=False, vmem_limit_bytes=vmem)[0]

    i32, bf = jnp.int32, jnp.bfloat16
    structs = [jax.ShapeDtypeStruct((T, HQ, D), bf), jax.ShapeDtypeStruct((T, HKV, D), bf),
               jax.ShapeDtypeStruct((T, HKV, D), bf), jax.ShapeDtypeStruct((P, ps, HKV, 2, D), bf),
               jax.ShapeDtypeStruct((S,), i32), jax.ShapeDtypeStruct((S * pps,), i32),
               jax.ShapeDtypeStruct((S + 1,), i32), jax.ShapeDtypeStruct((3,), i32)]
    blocks = lambda b: "({bq_sz},{bkv_sz},{bq_csz},{bkv_csz})".format(**b)  # noqa: E731
    return jax.jit(tpu_inference_rpa_v3), structs, (f"d_block_sizes={blocks(d)},m_block_sizes={blocks(m)},"
                                                    f"vmem_limit_bytes={vmem >> 20}MiB,update_kv_cache=False")


def cases(chips) -> list[Case]:
    import jax
    import jax.numpy as jnp

    from ..library import paged_attention as pa
    from ..perf import model_time

    out = []
    for kernel, args, kwargs in pa.STANDARD_CASES:
        (S,), (_, pps), (T, _, _), (P, ps, _, _) = _shape(args[0]), _shape(args[1]), _shape(args[4]), _shape(args[5])
        kv_len = pps * ps
        op = "decode" if T <= S else "mixed"
        shape = f"T={T} S={S} kv={kv_len} page={ps}"
        hbm = S * kv_len * 2 * HKV * D * 2 + 2 * T * HQ * D * 2
        flops = 4 * T * kv_len * HQ * D
        for chip in chips:
            from .core import kernel_program

            def public(est, chip, T=T, S=S, pps=pps, P=P, ps=ps):
                from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as jrpa

                _, _, cfg, _ = kernel_program(kernel, chip, args, kwargs)
                ppb = min(int(cfg["pages_per_block"]), pps)
                fn = jax.jit(lambda q, kv, kl, pi, cu, ns: jrpa(
                    q, kv, kl, pi, cu, ns, sm_scale=D ** -0.5, num_kv_pages_per_block=ppb,
                    num_queries_per_block=min(32, T)))
                i32 = jnp.int32
                structs = [jax.ShapeDtypeStruct((T, HQ, D), jnp.bfloat16),
                           jax.ShapeDtypeStruct((P, ps, 2 * HKV, D), jnp.bfloat16),
                           jax.ShapeDtypeStruct((S,), i32), jax.ShapeDtypeStruct((S, pps), i32),
                           jax.ShapeDtypeStruct((S + 1,), i32), jax.ShapeDtypeStruct((1,), i32)]
                return est.cycles(fn, structs, chip), f"num_kv_pages_per_block={ppb},num_queries_per_block={min(32, T)}"

            def tpu_inference(est, chip, T=T, S=S, pps=pps, P=P, ps=ps):
                fn, structs, cfg = tpu_inference_program(chip, T, S, pps, ps, P)
                return est.cycles(fn, structs, chip), cfg

            def floor(chip, hbm=hbm, flops=flops):
                return model_time(chip, None, hbm, flops).roofline_us

            impls = [_ours(kernel, args, kwargs, T, S, pps, ps, floor),
                     Impl("tpu-inference RPA v3", "public", tpu_inference),
                     Impl("jax ragged_paged_attention", "public", public)]
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=flops, impls=impls))
    return out


def reason(row: dict) -> str | None:
    parts = [REASONS.get((row["chip"], row["op"]))]
    if row.get("kind") == "ours" and row["op"] == "mixed":
        parts.append("static bound: every work item reads all pages of its sequence (the model cannot see which kv "
                     "blocks a causal row skips); items > sequences when a prefill chunk spans several query blocks")
    return "; ".join(p for p in parts if p) or None
