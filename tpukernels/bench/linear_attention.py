"""Linear attention family: tpukernels' gated DeltaNet (GDN) kernels vs tpu-inference's GDN kernels and XLA.

Shapes: one GDN layer of Qwen3-Next-80B-A3B (transformers' ``Qwen3NextConfig`` defaults: 16 query/key heads,
32 value heads, head dims ``K = V = 128``, conv kernel 4), bf16 activations, float32 state and gates:

* **prefill** of one sequence of ``T = 4096, 16384, 32768`` tokens (forward, zero initial state, final state
  out): ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``, its default chunk (128);
* **decode** of ``B = 64, 256`` sequences, one token each, states read from a pool and the new states written:
  ``fused_recurrent_gated_delta_rule(..., ssm_state_indices=...)``.

Bytes: q, k, v, g, beta read once, o written once, and the state: for decode the ``B`` states read and written
(``2 x B x 32 x 128 x 128 x 4`` bytes, 99.4% of the bytes: a decode row's ``% roofline`` **is** its % of the HBM
roofline), for prefill the final state. FLOPs: the chunked form's MXU work at fla's chunk 64 (per token and value
head ``4 C K + 2 C V + 6 K V``); decode ``6 K V``. Ours and XLA's chunked form run at our default chunk,
``CHUNK`` (128).

What the model can see. libtpu 0.0.52's static profiler aborts on XLA's data-movement ops around a kernel
("Unsupported DMA direction for latency modeling: dma-general": layout-changing copies such as the token-major
to head-major transposes, a copy of a non-donated argument a kernel updates in place, operands XLA prefetches
into VMEM). So:

* ``tpukernels``: a program taking the kernel's operands in the layouts the public op hands it (q / k / v
  head-major, g / beta ``[HV * T, 1]`` reshaped to the kernel's ``[HV, T, 1]``; decode rows ``[B, 1, heads,
  d]`` reshaped to ``[B, heads, 1, d]``), its estimate scaled from a smaller grid (libtpu's estimate of these
  kernels takes minutes per thousand grid steps on this host, and both grids are uniform: every step the same
  work): prefill at 1/8 of the heads (``H = 2, HV = 4``) and ``T <= 2048`` tokens (x 8 x T / 2048; the fixed
  per-call cost is scaled too: an upper bound), decode at 16 rows (x B / 16; at 64 rows libtpu's profiler aborts
  on the program: a copy XLA adds around the kernel). The XLA ops the public wrapper
  runs around the kernel (q / k l2norm, the gates ``g = -exp(A_log) softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)`` from the layer's bf16 projections, and for prefill the transposes of q, k, v, o) are
  charged at the HBM roofline (their bytes / HBM bandwidth, as cycles). The config column says so.
* ``xla``: the chunked algorithm in ``jax.numpy`` on the same operands (:func:`xla_prefill`: per chunk the
  WY / UT transform with ``solve_triangular``, all chunks at once, then a ``lax.scan`` over chunks carrying
  the state, f32 HIGHEST-precision matmuls as ours) and for decode the one-token recurrence
  (:func:`xla_decode`: gather the states, update, return them), plus the same wrapper bytes. Its prefill is
  estimated on the same reduced problem as ours and scaled the same way (:func:`xla_prefill_impl`).
* ``tpu-inference v3``: tpu-inference 0.32.0's ``kernels.gdn.v3.wrapper.fused_conv1d_gdn``, the kernel its
  ``GDNLinearAttentionBackend`` serves Qwen3-Next with (chunked scan over tiles of ``mixed_tile_size=64``
  tokens for prefill, the token recurrence over tiles of ``decode_tile_size=4`` sequences for decode; its
  defaults), its state caches donated (updated in place, as it serves). It does **more** than ours: the
  causal conv1d with its conv state, silu, l2norm and the gates are fused in. Both its kernels (batched decode
  mode, then per-sequence mode) run in every call and iterate with ``emit_pipeline`` over a tile count read
  from SMEM, so a static estimate is not tied to T or B in any case.
* ``tpu-inference v2``: for decode its decode-only kernel ``kernels.gdn.v2.gdn_decode_kernel
  .ragged_gated_delta_rule_decode_only`` (pure GDN after the conv: l2norm and gates in the kernel), for prefill
  its chunked ``kernels.gdn.v2.recurrent_scan_v2.recurrent_scan`` (chunk 128, "for TPU v7").
  Where libtpu cannot compile or estimate a tpu-inference program, its row gets the roofline as a **floor**
  and the error (Flags and errors below): v3 with bf16 activations does not compile for v6e with libtpu
  0.0.52 (an LLO type check, "Expected vector-int16, got vector-bf16packed" in a ``vunpack``); with f32
  activations it compiles but the profiler aborts inside its kernel (``bundle_analysis.cc:197``), as on v2's
  decode kernel ("No DMA issue node found for sync flag": DMAs started in one loop iteration and awaited in
  another).

tokamax: its newest wheel (0.0.12) has no GDN or other linear-attention op (its ops: attention, flex
attention, gated linear unit, linear softmax cross-entropy, normalization, ragged dot, triangle
multiplication); the torch_tpu GDN / KDA ops in its repository are not released, so there is no column.

Targets (benchmark, not test; issue 37): ahead of tpu-inference's kernel on every chip; decode >= 80% of the
HBM roofline.
"""

from __future__ import annotations

from .core import Case, Impl

FAMILY = "linear_attention"
LIBRARY = ("linear_attention",)  # the library modules its figures depend on (bench.core.source_digest)
#: Qwen3-Next-80B-A3B's GDN layer (transformers' Qwen3NextConfig: linear_num_key_heads, linear_num_value_heads,
#: linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim)
H, HV, K, V, CONV = 16, 32, 128, 128, 4
CHUNK = 128  # gdn_ops.DEFAULT_CHUNK (a test checks they agree)
#: the case's FLOPs (the roofline every row shares) are the chunked form's work at fla's chunk 64, the smallest
#: chunk of the kernels compared (ours runs at CHUNK: more MXU work, fewer sequential steps)
FLOPS_CHUNK = 64
PREFILL = (4096, 16384, 32768)
DECODE = (64, 256)
SCALE = K ** -0.5

#: why tpukernels is where it is (per op), from the figures and the experiments named in each text
REASONS: dict = {
    "decode": "v5e / v6e: at the HBM roofline (libtpu's cycles below the HBM time). tpu7x: cycle-bound, 95.4 µs of "
    "cycles against 73.0 µs of HBM time at B=64 (76.5% of the roofline: below the 80% target). Tunable tried "
    "(block_h, value heads per grid step; tpu7x, B=64, estimated at 16 rows x4): 32 (the heuristic's, = HV) "
    "95.4 µs, 16: 100.9, 8: 125.7, 4: 179.6, so 32 is the best reachable by config. Lever tried: one pass over the "
    "state per token (S^T k and S^T q from the old state in one read, o = scale (e^g S^T q + (q . k) u), S' = e^g S "
    "+ k u^T written once): 97.7 µs, no gain: Mosaic already fuses the four passes of the token loop, and the VPU "
    "work per state vreg is the same (4 multiplies, 1 add, 2 sublane reductions). Parts (tpu7x, B=64, the token "
    "step replaced): state in/out with one add 54.7 µs, one product + reduction +12.8, the rank-1 update +15.4: "
    "additive, i.e. VPU-bound, not DMA-bound. Left: bf16 products of the state with f32 accumulation on chips "
    "with a bf16 VPU (v6e / tpu7x), at a precision cost not yet measured",
    "prefill fwd": "v5e: libtpu 0.0.52's static profiler aborts on the kernel (llo_execution_graph.cc), so there is "
    "no figure; the kernel compiles for v5e (tests/test_gated_delta_rule.py compile-only). v6e / tpu7x: libtpu "
    "estimates gdn_chunk_fwd compute-bound (v6e, T=4096: 4,048 µs at the default chunk 128, ~60x the roofline, "
    "3.3x faster than XLA's chunked form). Where it goes (v6e, T=4096, the chunk step replaced by parts): "
    "the fixed per-step work "
    "(sequence loop, masks, state carry) 687 µs; the chunk step without the triangular inverse +803; the inverse "
    "(12 dependent 128 x 128 f32 matmuls at HIGHEST) +2,558, 63% of the total. libtpu charges small matmuls "
    "by count, not size: 12 dependent 64^3 products cost 3,962 µs, 12 of 256^3 9,655, and 4 independent inverses "
    "in one step cost 4x one, so batching heads or chunks into one step does not help in this model; all-bf16 "
    "single-pass matmuls would save ~20%. Shipped levers: the inverse's first doubling level needs no matmul "
    "(6,288 -> 5,668 µs at chunk 64), and chunk_size 128 by default (the tunable: 4,048 µs; 1.55x the "
    "chunk-64 kernel before). "
    "Levers left (gdn owner): fewer matmul launches in the inverse (e.g. 16 x 16 diagonal blocks on the VPU, "
    "then two doubling levels); the chunk-local work (A, its inverse, W = T beta exp(G) K, U' = T beta V) in a "
    "parallel pass before the sequential state pass, as fla's chunk kernels do (fewer steps on the sequential "
    "axis on real chips, where independent matmuls may overlap, which this model does not show); lane-dense "
    "gates ([HV, T] blocks)",
}


def _s(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def prefill_bytes(T: int) -> int:
    act = T * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4)  # q, k, v, o (bf16); g, beta (f32)
    return act + HV * K * V * 4  # the final state


def decode_bytes(B: int) -> int:
    return B * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4) + 2 * B * HV * K * V * 4


def prefill_flops(T: int) -> int:
    return HV * T * (4 * FLOPS_CHUNK * K + 2 * FLOPS_CHUNK * V + 6 * K * V)


def decode_flops(B: int) -> int:
    return HV * B * 6 * K * V


# ----------------------------------------------------------------------------------------------- shared
def gates(a, b, a_log, dt_bias):
    """Qwen3-Next's gates from the layer's projections (``Qwen3NextGatedDeltaNet.forward``, computed before the
    GDN call): ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, float32."""
    import jax
    import jax.numpy as jnp

    g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def l2norm(x, axis=-1):
    """``use_qk_l2norm_in_kernel``'s normalization (eps 1e-6, back to x's dtype), as the public ops run it."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis, keepdims=True) + 1e-6)).astype(x.dtype)


def _gate_structs(n: int):
    import jax.numpy as jnp

    return [_s((n, HV), jnp.bfloat16), _s((n, HV), jnp.bfloat16), _s((HV,), jnp.float32), _s((HV,), jnp.float32)]


# ----------------------------------------------------------------------------------------------- ours
#: ours is estimated on a smaller grid and scaled (module docstring): prefill at HV / PREFILL_HEAD_DIV value heads
#: and at most PREFILL_EST_T tokens, decode at DECODE_EST_B rows
PREFILL_HEAD_DIV, PREFILL_EST_T, DECODE_EST_B = 8, 2048, 16


def wrapper_bytes(n: int, layout: bool) -> int:
    """HBM bytes of the XLA ops the public op runs around its kernel for ``n`` tokens, charged at the HBM
    roofline (module docstring): the q / k l2norm (read and write q, k), the gates (read a, b bf16, write g,
    beta f32) and, with ``layout``, the transposes of q, k, v, o between token-major and head-major."""
    qk = 2 * n * H * K * 2
    return 2 * qk + n * HV * (2 * 2 + 2 * 4) + (2 * (qk + 2 * n * HV * V * 2) if layout else 0)


def _ours(kernel, args, kwargs, wrap, structs, note: str, scale: int, extra_bytes: int) -> Impl:
    """Ours: one program taking the kernel's operands in the layouts the public op hands it (``structs``,
    ``wrap(kernel_fn, *inputs)`` reshapes them), the kernel lowered for the chip, its estimate times ``scale``
    (``args`` are a reduced problem), plus ``extra_bytes`` of the wrapper's XLA ops at the HBM roofline."""
    import jax

    from ..perf import clock_hz, hbm_bandwidth
    from .core import kernel_program

    def cycles(est, chip):
        fn, _, cfg, source = kernel_program(kernel, chip, args, kwargs)
        prog = jax.jit(lambda *xs: wrap(fn, *xs))
        extra = int(extra_bytes / hbm_bandwidth(chip) * clock_hz(chip))
        return est.cycles(prog, structs, chip) * scale + extra, dict(cfg, source=source, estimated=note)

    return Impl("tpukernels", "ours", cycles)


def ours_prefill(T: int, chunk: int = CHUNK) -> Impl:
    """``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, output_final_state=True)`` at ``T`` tokens (one
    sequence, zero initial state): the ``gdn_chunk_fwd`` kernel (estimated at ``HV / PREFILL_HEAD_DIV`` heads and
    ``min(T, PREFILL_EST_T)`` tokens, scaled), plus :func:`wrapper_bytes` at the HBM roofline."""
    import jax.numpy as jnp

    from ..library.linear_attention.gdn_ops import gdn_chunk_fwd

    h, hv, t = H // PREFILL_HEAD_DIV, HV // PREFILL_HEAD_DIV, min(T, PREFILL_EST_T)
    args = ("2:i32", f"{h}x{t}x{K}:bf16", f"{h}x{t}x{K}:bf16", f"{hv}x{t}x{V}:bf16", f"{hv}x{t}x1:f32",
            f"{hv}x{t}x1:f32", None)

    def wrap(fn, q, k, v, g, beta):  # g, beta [hv * t, 1]: the kernel's [hv, t, 1] by a bitcast
        o, ht, _ = fn(jnp.array([0, t], jnp.int32), q, k, v, g.reshape(hv, t, 1), beta.reshape(hv, t, 1))
        return o, ht

    bf, f32 = jnp.bfloat16, jnp.float32
    structs = [_s((h, t, K), bf), _s((h, t, K), bf), _s((hv, t, V), bf), _s((hv * t, 1), f32), _s((hv * t, 1), f32)]
    scale = PREFILL_HEAD_DIV * (T // t)
    return _ours(gdn_chunk_fwd, args, {"scale": SCALE, "save_states": False, "chunk": chunk}, wrap, structs,
                 f"H={h} HV={hv} T={t} x{scale}; + l2norm, gates, transposes at the HBM roofline", scale,
                 wrapper_bytes(T, True))


def ours_decode(B: int) -> Impl:
    """``fused_recurrent_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, ssm_state_indices=...)``: the
    ``gdn_recurrent_fwd`` kernel over rows of one token, states gathered from a pool, new states out ``[B, HV, K,
    V]`` (estimated at ``DECODE_EST_B`` rows, scaled), plus :func:`wrapper_bytes` (no transposes at T = 1)."""
    import jax.numpy as jnp

    from ..library.linear_attention.gdn_ops import gdn_recurrent_fwd

    b = min(B, DECODE_EST_B)
    args = (f"{b}:i32", f"{b}x{H}x{K}x1:bf16", f"{b}x{H}x{K}x1:bf16", f"{b}x{HV}x1x{V}:bf16", f"{b}x{HV}x1x1:f32",
            f"{b}x{HV}x1x1:f32", f"{b + 1}x{HV}x{K}x{V}:f32")

    def wrap(fn, idx, q, k, v, g, beta, pool):  # T = 1: [b, 1, heads, d] -> [b, heads, 1, d] (q, k: [b, H, K, 1])
        r = lambda x: x.reshape(b, x.shape[2], 1, x.shape[3])  # noqa: E731
        c = lambda x: x.reshape(b, x.shape[2], x.shape[3], 1)  # noqa: E731
        o, ht = fn(idx, c(q), c(k), r(v), g.reshape(b, HV, 1, 1), beta.reshape(b, HV, 1, 1), pool)
        return o.reshape(b, 1, HV, V), ht

    bf, f32 = jnp.bfloat16, jnp.float32
    structs = [_s((b,), jnp.int32), _s((b, 1, H, K), bf), _s((b, 1, H, K), bf), _s((b, 1, HV, V), bf),
               _s((b, 1, HV), f32), _s((b, 1, HV), f32), _s((b + 1, HV, K, V), f32)]
    return _ours(gdn_recurrent_fwd, args, {"scale": SCALE}, wrap, structs,
                 f"B={b} x{B // b}; + l2norm, gates at the HBM roofline", B // b, wrapper_bytes(B, False))


# ----------------------------------------------------------------------------------------------- xla
def xla_prefill(q, k, v, g, beta, chunk: int = CHUNK):
    """The chunked GDN forward in ``jax.numpy`` on our kernel's operands (zero initial state):
    ``(o [HV, T, V], final state [HV, K, V])``.

    q, k ``[H, T, K]`` bf16 (l2-normalized); v ``[HV, T, V]`` bf16; g, beta ``[HV * T, 1]`` f32 (gates); T a
    multiple of ``chunk``. Per chunk the WY / UT transform (``solve_triangular``), all chunks at once, then a
    ``lax.scan`` over the chunks carrying the state."""
    import jax
    import jax.numpy as jnp

    h, T, kd = q.shape
    hv, vd = v.shape[0], v.shape[2]
    n = T // chunk
    f = lambda x, d: x.astype(jnp.float32).reshape(-1, n, chunk, d)  # noqa: E731
    qc = jnp.repeat(f(q, kd), hv // h, axis=0)  # [HV, n, C, K]
    kc = jnp.repeat(f(k, kd), hv // h, axis=0)
    vc = f(v, vd)
    gc, bc = f(g, 1), f(beta, 1)  # [HV, n, C, 1]
    G = jnp.cumsum(gc, axis=2)
    eG = jnp.exp(G)
    lo = jnp.tril(jnp.ones((chunk, chunk), bool))
    st = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    D = jnp.where(lo, jnp.exp(jnp.where(lo, G - jnp.swapaxes(G, 2, 3), 0.0)), 0.0)
    mm = lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    A = jnp.where(st, bc * mm(kc, jnp.swapaxes(kc, 2, 3)) * D, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    Tinv = jax.scipy.linalg.solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True,
                                             unit_diagonal=True)
    Ub = mm(Tinv, bc * vc)  # U = Ub - W S0
    W = mm(Tinv, bc * eG * kc)
    P = mm(qc, jnp.swapaxes(kc, 2, 3)) * D
    gl = G[:, :, -1:, :]  # [HV, n, 1, 1]
    wdec = jnp.exp(gl - G)

    def step(S, xs):
        qc_, kc_, eG_, Ub_, W_, P_, gl_, wd_ = xs
        u = Ub_ - mm(W_, S)
        o = SCALE * (eG_ * mm(qc_, S) + mm(P_, u))
        return jnp.exp(gl_) * S + mm(jnp.swapaxes(kc_, 1, 2), wd_ * u), o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qc, kc, eG, Ub, W, P, gl, wdec))  # chunks first
    S, o = jax.lax.scan(step, jnp.zeros((hv, kd, vd), jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1).reshape(hv, T, vd).astype(v.dtype), S


def xla_decode(idx, q, k, v, g, beta, pool):
    """One GDN token per row in ``jax.numpy`` on our kernel's operands: ``(o [B, HV, V], new states [B, HV, K,
    V])``. idx ``[B]`` int32; q, k ``[B, H, K]`` (l2-normalized); v ``[B, HV, V]``; g, beta ``[B, HV]`` f32;
    pool ``[P, HV, K, V]`` f32."""
    import jax.numpy as jnp

    r = v.shape[1] // q.shape[1]
    qf = jnp.repeat(q.astype(jnp.float32), r, axis=1)
    kf = jnp.repeat(k.astype(jnp.float32), r, axis=1)
    S = pool[idx] * jnp.exp(g)[..., None, None]
    u = beta[..., None] * (v.astype(jnp.float32) - jnp.einsum("bhk,bhkv->bhv", kf, S))
    S = S + kf[..., :, None] * u[..., None, :]
    return (SCALE * jnp.einsum("bhk,bhkv->bhv", qf, S)).astype(v.dtype), S


def _xla(fn, structs, n: int, layout: bool, scale: int = 1, note: str = "") -> Impl:
    """XLA's compilation of ``fn``, its estimate times ``scale`` (``structs`` a reduced problem, as ours), plus
    the same wrapper bytes at the HBM roofline as ours."""
    from ..perf import clock_hz, hbm_bandwidth

    def cycles(est, chip):
        extra = wrapper_bytes(n, layout) / hbm_bandwidth(chip) * clock_hz(chip)
        return est.cycles(fn, structs, chip) * scale + int(extra), None

    return Impl("xla", "xla", cycles, config=note + "XLA fusion + l2norm, gates" + (", transposes" if layout else "")
                + " at the HBM roofline")


def xla_prefill_impl(T: int) -> Impl:
    """:func:`xla_prefill` estimated on the same reduced problem as ours (``HV / PREFILL_HEAD_DIV`` value heads,
    ``min(T, PREFILL_EST_T)`` tokens; its chunks and heads are independent but for the scan over chunks, so its
    work is linear in both) and scaled: at full size libtpu's estimate of it holds ~15 GB of host memory at
    T = 4096 and grows with T."""
    import jax
    import jax.numpy as jnp

    h, hv, t = H // PREFILL_HEAD_DIV, HV // PREFILL_HEAD_DIV, min(T, PREFILL_EST_T)
    scale = PREFILL_HEAD_DIV * (T // t)
    bf, f32 = jnp.bfloat16, jnp.float32
    return _xla(jax.jit(xla_prefill), [_s((h, t, K), bf), _s((h, t, K), bf), _s((hv, t, V), bf), _s((hv * t, 1), f32),
                                       _s((hv * t, 1), f32)], T, True, scale, f"H={h} HV={hv} T={t} x{scale}; ")


def xla_decode_impl(B: int) -> Impl:
    import jax
    import jax.numpy as jnp

    bf, f32 = jnp.bfloat16, jnp.float32
    return _xla(jax.jit(xla_decode), [_s((B,), jnp.int32), _s((B, H, K), bf), _s((B, H, K), bf), _s((B, HV, V), bf),
                                      _s((B, HV), f32), _s((B, HV), f32), _s((B + 1, HV, K, V), f32)],
                B, False)


# ----------------------------------------------------------------------------------------------- tpu-inference
def _tpu_inference(what: str):
    from .._imports import import_tpu_inference

    module = {"v3": "kernels.gdn.v3.wrapper", "v2 decode": "kernels.gdn.v2.gdn_decode_kernel"}.get(
        what, "kernels.gdn.v2.recurrent_scan_v2")
    return import_tpu_inference(module, f"GDN kernel ({what})")


def v3_program(T: int, N: int):
    """``(fn, structs)``: tpu-inference 0.32.0's ``fused_conv1d_gdn`` over ``T`` tokens of ``N`` sequences
    (prefill: ``N = 1``; decode: ``T = N``), state pool of ``N + 1`` slots, its default tile sizes."""
    import jax
    import jax.numpy as jnp

    W = _tpu_inference("v3")
    dim = 2 * H * K + HV * V

    def tpu_inference_v3(qkv, b, a, conv_state, rec_state, conv_w, a_log, dt_bias, qsl, si, dist, lens, rsi):
        (_, rs), out = W.fused_conv1d_gdn(qkv, b, a, conv_state, rec_state, conv_w, None, a_log, dt_bias, qsl, si,
                                          dist, lens, rsi, n_kq=H, n_v=HV, d_k=K, d_v=V, kernel_size=CONV)
        return out, rs

    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    structs = [_s((T, dim), bf), _s((T, HV), bf), _s((T, HV), bf), _s((N + 1, CONV - 1, dim), bf),
               _s((N + 1, HV, K, V), f32), _s((dim, 1, CONV), bf), _s((HV,), f32), _s((HV,), f32),
               _s((N + 1,), i32), _s((N,), i32), _s((3,), i32), _s((N,), i32), _s((N,), i32)]
    return jax.jit(tpu_inference_v3, donate_argnums=(3, 4)), structs  # its state caches are updated in place


def v2_decode_program(B: int):
    import jax
    import jax.numpy as jnp

    m = _tpu_inference("v2 decode")
    dim = 2 * H * K + HV * V

    def tpu_inference_v2_decode(qkv, b, a, rec_state, a_log, dt_bias, qsl, si, dist):
        rs, out = m.ragged_gated_delta_rule_decode_only(qkv, b, a, rec_state, a_log, dt_bias, qsl, si, dist,
                                                        n_kq=H, n_v=HV, d_k=K, d_v=V)
        return out, rs

    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    structs = [_s((B, dim), bf), _s((B, HV), bf), _s((B, HV), bf), _s((B + 1, HV, K, V), f32), _s((HV,), f32),
               _s((HV,), f32), _s((B + 1,), i32), _s((B,), i32), _s((3,), i32)]
    return jax.jit(tpu_inference_v2_decode, donate_argnums=(3,)), structs


def v2_prefill_program(T: int):
    import jax
    import jax.numpy as jnp

    m = _tpu_inference("v2 prefill")
    dim = 2 * H * K + HV * V

    def tpu_inference_v2_scan(qkv, b, a, rec_state, a_log, dt_bias, qsl, si, dist):
        rs, out = m.recurrent_scan(qkv, b, a, rec_state, a_log, dt_bias, qsl, si, dist, n_kq=H, n_v=HV, d_k=K, d_v=V)
        return out, rs

    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    structs = [_s((T, dim), bf), _s((T, HV), bf), _s((T, HV), bf), _s((2, HV, K, V), f32), _s((HV,), f32),
               _s((HV,), f32), _s((2,), i32), _s((1,), i32), _s((3,), i32)]
    return jax.jit(tpu_inference_v2_scan, donate_argnums=(3,)), structs


def _peer(name: str, program, size, config: str, floor_us) -> Impl:
    """A tpu-inference kernel (``program(*size)``); where libtpu cannot estimate it, its roofline is given as a
    floor (a lower bound, marked as such)."""

    def cycles(est, chip):
        fn, structs = program(*size)
        return est.cycles(fn, structs, chip), config

    return Impl(name, "public", cycles, config=config, floor_us=floor_us)


# ----------------------------------------------------------------------------------------------- cases
def cases(chips) -> list[Case]:
    from ..perf import model_time

    out = []
    specs = [("prefill fwd", f"T={T}", prefill_bytes(T), prefill_flops(T), ours_prefill(T), [
        ("tpu-inference v3", v3_program, (T, 1), "fused_conv1d_gdn, mixed_tile_size=64 (+ conv1d, gates, l2norm)"),
        ("tpu-inference v2", v2_prefill_program, (T,), "recurrent_scan, chunk_size=128, BT=128 (+ gates, l2norm)"),
    ], xla_prefill_impl(T)) for T in PREFILL]
    specs += [("decode", f"B={B}", decode_bytes(B), decode_flops(B), ours_decode(B), [
        ("tpu-inference v3", v3_program, (B, B), "fused_conv1d_gdn, decode_tile_size=4 (+ conv1d, gates, l2norm)"),
        ("tpu-inference v2", v2_decode_program, (B,), "ragged_gated_delta_rule_decode_only (+ gates, l2norm)"),
    ], xla_decode_impl(B)) for B in DECODE]
    for op, shape, hbm, flops, ours, peers, xla in specs:
        def floor(chip, hbm=hbm, flops=flops):
            return model_time(chip, None, hbm, flops).roofline_us

        for chip in chips:
            impls = [ours] + [_peer(n, prog, size, cfg, floor) for n, prog, size, cfg in peers] + [xla]
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=flops, impls=impls))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get(row["op"])
