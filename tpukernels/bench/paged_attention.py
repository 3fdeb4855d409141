"""Paged attention family: tpukernels' ragged paged attention vs JAX's public Pallas kernel
``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (the one vLLM TPU / tpu-inference grew from).

Shapes: :data:`tpukernels.library.paged_attention.STANDARD_CASES`, Llama-3-8B-like (``Hq=32, Hkv=8,
D=128``, bf16 q and KV cache), page size 16 and 64:

* **decode**: 64 sequences x 2048 cached tokens, one query token each (``T = 64``);
* **mixed**: ``T = 1024`` query tokens over 64 sequences of 2048 cached tokens (prefill chunks + decode rows).

Roofline: decode is memory bound; the bytes are the KV pages the batch must read once
(``S * kv_len * 2 * Hkv * D * 2``) plus q and the output. FLOPs ``4 * T * kv_len * Hq * D`` (every query
row against its sequence's keys; an upper bound for the mixed case, where causal rows see fewer keys).

What the model sees. Both kernels are data dependent; libtpu's estimate is static:

* ours loops with static trip counts (``pl.when`` guards): the estimate is that of the static bound, every
  work item visiting every kv block of ``pages_per_seq``. For the decode batch that bound **is** the work
  (``kv_len = pages_per_seq * page_size`` and exactly one item per sequence). For the mixed batch it is an
  upper bound (items of a sequence spanning several query blocks each re-read its pages: ``79`` items for
  64 sequences at ``block_q = 64``).
* JAX's kernel iterates with data-dependent ``while`` loops (sequences per query block, kv blocks per
  sequence). For such loops libtpu's static estimate assumes a trip count that does not depend on the
  data (found here: a DMA loop with a trip count read from SMEM costs the same for 2 and for 8
  iterations, about 40 iterations' worth), so its figure is not tied to the batch: compare it with care.

JAX's kernel runs at ``num_kv_pages_per_block`` = our ``pages_per_block`` and ``num_queries_per_block=32``
(its tuned table has no entry for these shapes and its lookup needs a live TPU; 32 is its default),
``sm_scale=1/sqrt(D)``.
"""

from __future__ import annotations

from .core import Case, Impl, ours_impl

FAMILY = "paged_attention"
HQ, HKV, D = 32, 8, 128
REASONS: dict = {}


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(":")[0].split("x"))


def cases(chips) -> list[Case]:
    import jax
    import jax.numpy as jnp

    from ..library import paged_attention as pa

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

            impls = [ours_impl([(kernel, args, kwargs)]),
                     Impl("jax ragged_paged_attention", "public", public)]
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=flops, impls=impls))
    return out


def reason(row: dict) -> str | None:
    if row.get("kind") == "ours" and row["op"] == "mixed":
        return ("static bound: every work item reads all pages of its sequence (the model cannot see which kv "
                "blocks a causal row skips); items > sequences when a prefill chunk spans several query blocks")
    return REASONS.get((row["chip"], row["op"]))
