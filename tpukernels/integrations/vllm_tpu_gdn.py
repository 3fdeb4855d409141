"""tpukernels in vLLM-TPU's linear-attention slot: the fused causal conv1d + gated DeltaNet step of Qwen3-Next /
Qwen3.5's GDN layers (tpu-inference 0.32.0 ``LinearAttentionBackend``).

:func:`tpukernels.integrations.vllm_tpu.register` registers the ``tpukernels`` name with
``register_attention_backend(..., linear_attention=TpuKernelsLinearAttentionBackend)``; tpu-inference's
``run_jax_gdn_attention`` (``layers/common/gdn_attention.py``) then shard-maps
``TpuKernelsLinearAttentionBackend().conv1d_gdn_kernel()``, which is :func:`fused_conv1d_gdn`: the signature
of tpu-inference's ``kernels/gdn/v3/wrapper.fused_conv1d_gdn`` on tpukernels' kernels.

One step, per layer (token-major ragged batch ``mixed_qkv [T, dim]``, ``dim = 2 * n_kq * d_k + n_v * d_v``,
``query_start_loc``, ``distribution = (decode_end, prefill_end, num_seqs)``; tokens past
``query_start_loc[num_seqs]`` are padding)::

    xp_s   = [conv_state[read_state_indices[s]] if seq_lens[s] > q_len[s] else 0,  x of sequence s]
    y      = silu(bias + depthwise causal conv of xp_s)          (kernel_size taps, per sequence)
    q, k   = l2norm(y[:, :n_kq d_k]), l2norm(y[:, n_kq d_k: 2 n_kq d_k])     (eps 1e-6), v = y[:, 2 n_kq d_k:]
    g      = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    o, S   = gated delta rule (value head h reads q/k head h // (n_v / n_kq), scale d_k ** -0.5) from
             S_0 = recurrent_state[read_state_indices[s]] (zeros when seq_lens[s] == q_len[s])
    conv_state[state_indices[s]] = the last kernel_size - 1 inputs of xp_s;  recurrent_state[state_indices[s]] = S

Kernels: ``tpukernels::causal_conv1d_fwd`` (:mod:`tpukernels.library.causal_conv1d`) over the packed tokens with
per-token segment ids (no tap crosses a sequence); then the gated delta rule by the rows' kind
(``distribution``): the decode rows ``[0, decode_end)`` (one token each) by ``tpukernels::gdn_recurrent_fwd``
(grid over rows and value heads, the initial state read from the cache through ``read_state_indices``), the
prefill / mixed rows ``[decode_end, num_seqs)`` by ``tpukernels::gdn_chunk_fwd``
(:mod:`tpukernels.library.linear_attention.gdn_ops`) with ``cu_seqlens`` from ``query_start_loc`` (the decode tokens
one sequence of their own whose output is unused, the padding another). Each part runs under a ``lax.cond``
only when the batch has such rows. Padding tokens (past ``query_start_loc[num_seqs]``) are never read by a real
sequence (segment ids, per-sequence masks; ``jnp.where`` everywhere, so a NaN there stays there), their output is
0 and no state is written for them; sequences past ``num_seqs`` write no state. Contract (vLLM-TPU's): a decode
row has exactly one token; a slot written by one sequence in a step is not read by another in the same step.

Layouts: what is mapped without a copy and where copies remain.

* ``query_start_loc`` is the kernels' ``cu_seqlens`` (clamped past ``num_seqs``; the decode block and the
  padding sequence added: ``S + 3`` int32), ``state_indices`` / ``read_state_indices`` index the caches as they
  are;
* ``recurrent_state``: decode rows read it in place (the recurrent kernel's scalar-prefetched index table);
  prefill rows read a gather of the ``S`` rows ``read_state_indices`` (a copy of ``S * n_v * d_k * d_v`` floats:
  the chunked kernel reads its initial states by sequence). New states are written by XLA scatters at
  ``state_indices`` (``.at[].set``): in place when the cache is donated, as this function's ``jax.jit`` and
  vLLM-TPU's step do (checked on the compiled TPU program: the caches are aliased to the outputs and the
  temporaries are smaller than one cache). A cache not float32 is converted (a copy);
* ``conv_state``: a gather of the ``S`` rows (``S * (W-1) * dim``) and a scatter of the new ones; the first
  ``W - 1`` conv outputs of each sequence (the ones that read the state) are recomputed from it in XLA
  (``S * (W-1) * dim`` values, as tpu-inference's ragged reference and tpukernels' ``causal_conv1d_fn`` do);
* ``mixed_qkv [T, dim]`` -> the conv kernel's channels-first ``[1, dim, T]`` and back, and the prefill rows'
  q / k / v -> the chunked kernel's head-major ``[heads, T, d]``, its output back to ``[T, n_v * d_v]``:
  transposes (copies of the activations; the decode rows' are gathers of one token per row).

Differences from tpu-inference's v3 kernel: speculative decoding (``num_spec_tokens > 0`` / ``read_offsets``) is
not supported (a typed error); ``decode_tile_size`` / ``mixed_tile_size`` (their tiling) are accepted and ignored;
``compute_precision`` must be float32 (ours computes in float32); the conv output is rounded to ``mixed_qkv``'s
dtype before the GDN (as tpu-inference's reference; their fused kernel keeps it in float32); the output of padding
tokens is always 0 (theirs with ``zero_initialize_out=True``).
"""

from __future__ import annotations

import numpy as np

from ..errors import ArgumentError, BackendUnavailableError, DTypeError, NotSupportedError

_STATICS = ("n_kq", "n_v", "d_k", "d_v", "kernel_size", "num_spec_tokens", "zero_initialize_out",
            "compute_precision", "decode_tile_size", "mixed_tile_size", "chunk_size", "interpret")
_WHERE = "vllm_tpu.fused_conv1d_gdn"


def _shape(x):
    return tuple(int(d) for d in x.shape)


def _check(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias, query_start_loc,
           state_indices, distribution, seq_lens, read_state_indices, read_offsets, *, n_kq, n_v, d_k, d_v,
           kernel_size, num_spec_tokens, compute_precision, chunk_size):
    """Every shape / dtype rule (static under jit), before any kernel runs."""
    import jax.numpy as jnp

    from ..library.causal_conv1d import MAX_WIDTH
    from ..library.linear_attention.gdn_ops import CHUNK_SIZES

    if num_spec_tokens or read_offsets is not None:
        raise NotSupportedError(f"{_WHERE}: speculative decoding (num_spec_tokens={num_spec_tokens}, read_offsets) "
                                f"is not supported by the tpukernels linear-attention backend")
    if np.dtype(compute_precision) != np.float32:
        raise ArgumentError(f"{_WHERE}: compute_precision must be float32 (tpukernels computes in float32), got "
                            f"{np.dtype(compute_precision).name}")
    for name, n in (("n_kq", n_kq), ("n_v", n_v), ("d_k", d_k), ("d_v", d_v)):
        if not isinstance(n, int) or n < 1:
            raise ArgumentError(f"{_WHERE}: {name} must be a positive int, got {n!r}")
    if n_v % n_kq:
        raise ArgumentError(f"{_WHERE}: n_v = {n_v} value heads must be a multiple of n_kq = {n_kq} q/k heads")
    if not isinstance(kernel_size, int) or not 2 <= kernel_size <= MAX_WIDTH:
        raise ArgumentError(f"{_WHERE}: kernel_size must be an int in [2, {MAX_WIDTH}], got {kernel_size!r}")
    if chunk_size not in CHUNK_SIZES:
        raise ArgumentError(f"{_WHERE}: chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    dim = 2 * n_kq * d_k + n_v * d_v
    if len(qkv.shape) != 2 or int(qkv.shape[1]) != dim:
        raise ArgumentError(f"{_WHERE}: mixed_qkv must be [T, 2 * n_kq * d_k + n_v * d_v] = [T, {dim}], got "
                            f"{_shape(qkv)}")
    if np.dtype(qkv.dtype).name not in ("bfloat16", "float32"):
        raise DTypeError(f"{_WHERE}: mixed_qkv must be bfloat16 or float32, got {np.dtype(qkv.dtype).name}")
    t = int(qkv.shape[0])
    for name, x in (("b", b), ("a", a)):
        if _shape(x) != (t, n_v):
            raise ArgumentError(f"{_WHERE}: {name} must be [T, n_v] = [{t}, {n_v}], got {_shape(x)}")
    w1 = kernel_size - 1
    if len(conv_state.shape) != 3 or _shape(conv_state)[1:] != (w1, dim):
        raise ArgumentError(f"{_WHERE}: conv_state must be [num_blocks, kernel_size - 1, dim] = [num_blocks, {w1}, "
                            f"{dim}], got {_shape(conv_state)}")
    nb = int(conv_state.shape[0])
    if _shape(recurrent_state) != (nb, n_v, d_k, d_v):
        raise ArgumentError(f"{_WHERE}: recurrent_state must be [num_blocks, n_v, d_k, d_v] = [{nb}, {n_v}, {d_k}, "
                            f"{d_v}] (num_blocks of conv_state), got {_shape(recurrent_state)}")
    for name, x in (("conv_state", conv_state), ("recurrent_state", recurrent_state), ("conv_weight", conv_weight),
                    ("conv_bias", conv_bias), ("A_log", a_log), ("dt_bias", dt_bias), ("b", b), ("a", a)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise DTypeError(f"{_WHERE}: {name} must be a float array, got {np.dtype(x.dtype).name}")
    if _shape(conv_weight) != (dim, 1, kernel_size):
        raise ArgumentError(f"{_WHERE}: conv_weight must be [dim, 1, kernel_size] = [{dim}, 1, {kernel_size}], got "
                            f"{_shape(conv_weight)}")
    if np.dtype(conv_weight.dtype).name not in ("bfloat16", "float32"):
        raise DTypeError(f"{_WHERE}: conv_weight must be bfloat16 or float32, got {np.dtype(conv_weight.dtype).name}")
    if conv_bias is not None and _shape(conv_bias) != (dim,):
        raise ArgumentError(f"{_WHERE}: conv_bias must be [dim] = [{dim}] or None, got {_shape(conv_bias)}")
    for name, x in (("A_log", a_log), ("dt_bias", dt_bias)):
        if _shape(x) != (n_v,):
            raise ArgumentError(f"{_WHERE}: {name} must be [n_v] = [{n_v}], got {_shape(x)}")
    if len(state_indices.shape) != 1:
        raise ArgumentError(f"{_WHERE}: state_indices must be [num_seqs], got {_shape(state_indices)}")
    s = int(state_indices.shape[0])
    for name, x, want in (("query_start_loc", query_start_loc, (s + 1,)), ("seq_lens", seq_lens, (s,)),
                          ("read_state_indices", read_state_indices, (s,)), ("distribution", distribution, (3,)),
                          ("state_indices", state_indices, (s,))):
        if _shape(x) != want:
            raise ArgumentError(f"{_WHERE}: {name} must be {list(want)} (num_seqs = state_indices.shape[0] = {s}), "
                                f"got {_shape(x)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise DTypeError(f"{_WHERE}: {name} must be an int array, got {np.dtype(x.dtype).name}")
    return t, s, nb, dim


def _conv(qkv, conv_state, conv_weight, conv_bias, cu, seg, rows, has_init, kernel_size, interpret):
    """``(silu(conv) [T, dim] in qkv's dtype, new conv states [S, W-1, dim] float32)``."""
    import jax
    import jax.numpy as jnp

    from ..library.causal_conv1d import HALO, causal_conv1d_fwd
    from ..targets.jax_entry import jax_call

    t, dim = qkv.shape
    w = kernel_size
    s = rows.shape[0]
    wk = conv_weight[:, 0, :]  # [dim, W]
    bk = None if conv_bias is None else conv_bias.reshape(dim, 1)
    xt = qkv.T[None]  # [1, dim, T]: the kernel's channels-first layout (a transpose)
    sg = seg[None, None, :]
    halo = t > HALO
    out = jax_call(causal_conv1d_fwd, xt, xt if halo else None, wk, bk, sg, sg if halo else None, None, True,
                   interpret=interpret)[0].T  # [T, dim]
    # each sequence's state (zeros without one): where, never a multiply, so a NaN in a stale slot stays there
    st = jnp.where(has_init[:, None, None], conv_state[rows].astype(jnp.float32), 0.0)  # [S, W-1, dim]
    start, qlen = cu[:-1], cu[1:] - cu[:-1]
    xf = qkv.astype(jnp.float32)

    def src(p):  # input p tokens after each sequence's start ([S, W-1] int), from the state when p < 0
        p = jnp.broadcast_to(p, (s, w - 1))
        tok = jnp.clip(start[:, None] + p, 0, max(t - 1, 0))
        sti = jnp.clip(p + (w - 1), 0, w - 2)
        return jnp.where((p < 0)[..., None], jnp.take_along_axis(st, sti[..., None], axis=1), xf[tok])

    # the first W-1 outputs of each sequence read its state: recomputed here (S * (W-1) * dim values)
    j = jnp.arange(w - 1)[None, :]  # [1, W-1]
    pre = sum(src(j - (w - 1) + k) * wk[:, k].astype(jnp.float32) for k in range(w))  # [S, W-1, dim]
    if conv_bias is not None:
        pre = pre + conv_bias.astype(jnp.float32)
    head = (pre * jax.nn.sigmoid(pre)).astype(out.dtype)
    tgt = jnp.where(j < qlen[:, None], start[:, None] + j, t)  # past T: dropped
    out = out.at[tgt.reshape(-1)].set(head.reshape(-1, dim), mode="drop")
    # new states: the last W-1 inputs of [state, x] per sequence
    final = src(qlen[:, None] - (w - 1) + j)  # [S, W-1, dim]
    return out, final


def _fused_conv1d_gdn(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, A_log, dt_bias,
                      query_start_loc, state_indices, distribution, seq_lens, read_state_indices, read_offsets=None, *,
                      n_kq, n_v, d_k, d_v, kernel_size, num_spec_tokens=0, zero_initialize_out=True,
                      compute_precision=np.float32, decode_tile_size=4, mixed_tile_size=64, chunk_size=64,
                      interpret=None):
    import jax
    import jax.numpy as jnp

    from ..library.linear_attention.gdn_ops import gdn_chunk_fwd, gdn_recurrent_fwd
    from ..targets.jax_entry import jax_call

    del zero_initialize_out, decode_tile_size, mixed_tile_size
    t, s, nb, dim = _check(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, A_log, dt_bias,
                           query_start_loc, state_indices, distribution, seq_lens, read_state_indices, read_offsets,
                           n_kq=n_kq, n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
                           num_spec_tokens=num_spec_tokens, compute_precision=compute_precision,
                           chunk_size=chunk_size)
    i32 = jnp.int32
    # ---- metadata: query_start_loc is cu_seqlens (clamped past num_seqs, the padding sequence appended)
    ns = jnp.clip(distribution[2].astype(i32), 0, s)
    qsl = jnp.clip(query_start_loc.astype(i32), 0, t)
    cu = jnp.where(jnp.arange(s + 1) <= ns, qsl, qsl[ns])
    cu = jax.lax.cummax(cu)  # non-decreasing whatever the caller's padding entries hold
    cu_ext = jnp.concatenate([cu, jnp.full((1,), t, i32)])  # [S + 2]: sequence S = the padding tokens
    live_seq = jnp.arange(s) < ns
    qlen = cu[1:] - cu[:-1]
    has_init = live_seq & (seq_lens.astype(i32) - qlen > 0)
    rows = jnp.where(live_seq, jnp.clip(read_state_indices.astype(i32), 0, nb - 1), 0)
    dest = jnp.where(live_seq, state_indices.astype(i32), nb)  # nb: out of range, dropped by the scatter
    tok = jnp.arange(t, dtype=i32)
    seg = jnp.searchsorted(cu_ext[1:], tok, side="right").astype(i32)  # sequence of each token (S: padding)
    live_tok = tok < cu[s]
    # ---- causal conv1d (+ silu)
    y, conv_final = _conv(qkv, conv_state, conv_weight, conv_bias, cu, seg, rows, has_init, kernel_size, interpret)
    new_conv = conv_state.at[dest].set(conv_final.astype(conv_state.dtype), mode="drop")
    # ---- gated delta rule
    kq, f32 = n_kq * d_k, jnp.float32
    r = n_v // n_kq
    scale = float(d_k) ** -0.5

    def l2norm(x):
        x = x.astype(f32)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = l2norm(y[:, :kq].reshape(t, n_kq, d_k))  # [T, n_kq, d_k] float32
    k = l2norm(y[:, kq:2 * kq].reshape(t, n_kq, d_k))
    v = y[:, 2 * kq:].reshape(t, n_v, d_v)
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))  # [T, n_v]
    beta = jax.nn.sigmoid(b.astype(f32))
    d0 = jnp.clip(distribution[0].astype(i32), 0, ns)  # sequences [0, d0) decode one token, [d0, ns) prefill
    is_dec = jnp.arange(s) < d0
    f32_pool = lambda rec: rec if rec.dtype == f32 else rec.astype(f32)  # noqa: E731  (a copy if not float32)
    out0 = jnp.zeros((t, n_v * d_v), qkv.dtype)

    def decode(carry):
        """Rows [0, d0): the recurrent kernel, one token per row, states read from the cache through the
        read indices (no gather); rows past d0 compute on the null block and are dropped."""
        rec, out = carry
        tok_s = jnp.clip(cu[:-1], 0, max(t - 1, 0))  # each row's token
        qd, kd, vd = q[tok_s], k[tok_s], v[tok_s]
        o, ht = jax_call(gdn_recurrent_fwd, jnp.where(is_dec, rows, 0), qd[..., None], kd[..., None],  # [S, H, K, 1]
                         vd[:, :, None], g[tok_s][:, :, None, None], beta[tok_s][:, :, None, None], f32_pool(rec),
                         scale, interpret=interpret)
        # a row without a state (a new one-token prompt) starts from zeros: one step's closed form, selected
        u = beta[tok_s][..., None] * vd.astype(f32)  # [S, n_v, d_v]
        qk = jnp.repeat(jnp.sum(qd * kd, axis=-1), r, axis=1)  # [S, n_v]
        o = jnp.where(has_init[:, None, None], o[:, :, 0].astype(f32), scale * qk[..., None] * u)
        ht = jnp.where(has_init[:, None, None, None], ht,
                       jnp.repeat(kd, r, axis=1)[..., None] * u[:, :, None, :])
        rec = rec.at[jnp.where(is_dec, dest, nb)].set(ht.astype(rec.dtype), mode="drop")
        out = out.at[jnp.where(is_dec, cu[:-1], t)].set(o.reshape(s, -1).astype(out.dtype), mode="drop")
        return rec, out

    def prefill(carry):
        """Sequences [d0, ns): the chunked kernel over all tokens, the decode tokens [0, cu[d0]) one sequence of
        their own (zero state, output unused: one pass per chunk), the padding another; initial states
        gathered (a copy of S rows: the kernel reads them by sequence)."""
        rec, out = carry
        c_d0 = cu[d0]
        cu_p = jnp.concatenate([jnp.zeros((1,), i32), c_d0[None], jnp.maximum(cu[1:], c_d0), jnp.full((1,), t, i32)])
        pre = live_seq & jnp.logical_not(is_dec)
        h0 = jnp.where((has_init & pre)[:, None, None, None], f32_pool(rec[rows]), 0.0)
        zero = jnp.zeros((1, n_v, d_k, d_v), f32)
        h0 = jnp.concatenate([zero, h0, zero])  # [S + 2]: decode block, sequences, padding
        o, ht, _ = jax_call(gdn_chunk_fwd, cu_p, q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2),
                            g.T[:, :, None], beta.T[:, :, None], h0, scale, False, int(chunk_size),
                            interpret=interpret)  # head-major layout of the kernel: transposes
        rec = rec.at[jnp.where(pre, dest, nb)].set(ht[1:s + 1].astype(rec.dtype), mode="drop")
        pre_tok = (tok >= c_d0) & live_tok
        out = jnp.where(pre_tok[:, None], o.transpose(1, 0, 2).reshape(t, n_v * d_v).astype(out.dtype), out)
        return rec, out

    # the carried cache is read and written by each branch in turn, so XLA updates it in place (both
    # branches reading the cache passed in would keep it alive past the first write: a copy of the cache)
    carry = (recurrent_state, out0)
    carry = jax.lax.cond(d0 > 0, decode, lambda c: c, carry)
    new_rec, out = jax.lax.cond(d0 < ns, prefill, lambda c: c, carry)
    return (new_conv, new_rec), out


def _jitted():
    import jax

    return jax.jit(_fused_conv1d_gdn, donate_argnames=("conv_state", "recurrent_state"), static_argnames=_STATICS)


_JIT: dict = {}


def fused_conv1d_gdn(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, A_log, dt_bias,
                     query_start_loc, state_indices, distribution, seq_lens, read_state_indices, read_offsets=None, *,
                     n_kq: int, n_v: int, d_k: int, d_v: int, kernel_size: int, num_spec_tokens: int = 0,
                     zero_initialize_out: bool = True, compute_precision=np.float32, decode_tile_size: int = 4,
                     mixed_tile_size: int = 64, chunk_size: int = 128, interpret: str | None = None):
    """tpu-inference's ``fused_conv1d_gdn`` (``kernels/gdn/v3/wrapper.py``, 0.32.0) on tpukernels' causal-conv1d
    and gated-DeltaNet kernels (the formula, layouts and copies: module docstring). Jitted, the two state caches
    donated (as theirs: the arrays passed in are consumed; use the returned ones).

    Args:
        qkv: ``mixed_qkv [T, dim]`` bf16/f32, ``dim = 2 * n_kq * d_k + n_v * d_v`` (q | k | v). b, a:
            ``[T, n_v]`` (beta = sigmoid(b); a: the decay's input).
        conv_state: ``[num_blocks, kernel_size - 1, dim]``; recurrent_state: ``[num_blocks, n_v, d_k, d_v]``
            (float32 kept in float32; only the rows state_indices names for live sequences are written: vLLM's null
            block 0 and the slots of padding entries are not).
        conv_weight: ``[dim, 1, kernel_size]``; conv_bias: ``[dim]`` or None; A_log, dt_bias: ``[n_v]``.
        query_start_loc: int ``[num_seqs + 1]``; state_indices, seq_lens (tokens computed + scheduled),
            read_state_indices: int ``[num_seqs]``; distribution: int ``[3]`` ``(decode_end, prefill_end,
            num_valid_seqs)``: sequences ``[0, decode_end)`` have one token each (the recurrent kernel), the rest
            up to ``num_valid_seqs`` any number (the chunked kernel). A sequence ``s < num_valid_seqs`` reads its
            initial states at ``read_state_indices[s]`` (zeros when ``seq_lens[s]`` equals its query length: a new
            prompt) and writes them at ``state_indices[s]`` (distinct; a slot written in the step is read by no
            other sequence: vLLM-TPU's allocation).
        read_offsets, num_spec_tokens: speculative decoding; must be None / 0.
        n_kq, n_v, d_k, d_v, kernel_size: the layer's (per-shard) head counts, head dims and conv width.
        zero_initialize_out, decode_tile_size, mixed_tile_size: their kernel's knobs, ignored (padding output is
            always 0). compute_precision: float32 only. chunk_size: GDN chunk (an extension; 128, ``gdn_ops.DEFAULT_CHUNK``).
        interpret: ``"fast"`` / ``"tpu"`` interpret mode off TPU (default: the current mode).

    Returns:
        ``((new_conv_state, new_recurrent_state), output [T, n_v * d_v] in qkv's dtype)``; padding tokens'
        output is 0.

    Raises:
        ArgumentError: shapes that break the rules above, ``n_v`` not a multiple of ``n_kq``, kernel_size outside
            [2, 8], compute_precision not float32. DTypeError: qkv / conv_weight not bf16/f32, int metadata not
            int. NotSupportedError: speculative decoding.
    """
    from ..dsl.modes import current_interpret_mode

    if "fn" not in _JIT:
        _JIT["fn"] = _jitted()
    # the interpret mode (used off TPU) is part of the jit key: a trace in one mode is not reused in another
    interpret = interpret or current_interpret_mode()
    return _JIT["fn"](qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, A_log, dt_bias,
                      query_start_loc, state_indices, distribution, seq_lens, read_state_indices, read_offsets,
                      n_kq=n_kq, n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
                      num_spec_tokens=num_spec_tokens, zero_initialize_out=zero_initialize_out,
                      compute_precision=np.dtype(compute_precision), decode_tile_size=decode_tile_size,
                      mixed_tile_size=mixed_tile_size, chunk_size=chunk_size, interpret=interpret)


# --------------------------------------------------------------------------------------------- the backend


def _make_linear_backend_class():
    try:
        from tpu_inference.layers.common.attention_backend import LinearAttentionBackend
    except ImportError as e:
        raise BackendUnavailableError(f"vllm_tpu: tpu-inference is not importable ({e}); install it with "
                                      f"pip install 'tpukernels[vllm]'") from e

    class TpuKernelsLinearAttentionBackend(LinearAttentionBackend):
        """tpu-inference ``LinearAttentionBackend`` running tpukernels' causal conv1d + gated DeltaNet."""

        def conv1d_gdn_kernel(self):
            return fused_conv1d_gdn

    return TpuKernelsLinearAttentionBackend


_CLASSES: dict = {}


def linear_backend_class():
    """The ``LinearAttentionBackend`` subclass (built once; needs tpu-inference importable)."""
    if "linear" not in _CLASSES:
        _CLASSES["linear"] = _make_linear_backend_class()
    return _CLASSES["linear"]


def __getattr__(name: str):
    if name == "TpuKernelsLinearAttentionBackend":
        return linear_backend_class()
    raise AttributeError(name)


__all__ = ["fused_conv1d_gdn", "linear_backend_class"]
