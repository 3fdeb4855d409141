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
per-token segment ids (no tap crosses a sequence), and ``tpukernels::gdn_chunk_fwd``
(:mod:`tpukernels.library.linear_attention.gdn_ops`) with ``cu_seqlens`` = ``query_start_loc`` (chunked for
every row, decode rows included: one token is a chunk of one). Padding tokens form one more sequence of their
own (zero state, output set to 0, state never written), so a NaN there reaches no real sequence; sequences past
``num_seqs`` are empty and their state slots are not written.

Layouts: what is mapped without a copy and where copies remain.

* ``query_start_loc`` is the kernels' ``cu_seqlens`` as is (clamped past ``num_seqs``, the padding sequence
  appended: ``S + 2`` int32);
* the caches: read by a gather of the ``S`` rows ``read_state_indices`` (``recurrent_state`` ``S * n_v * d_k *
  d_v`` floats, ``conv_state`` ``S * (W-1) * dim``) and written back by a scatter at ``state_indices`` (XLA's
  ``.at[].set``: in place when the cache is donated, as this function's ``jax.jit`` does and vLLM-TPU's step
  does). The gather remains a copy: ``gdn_chunk_fwd`` reads its initial states by sequence, not through an index
  table (``gdn_recurrent_fwd`` does, but it takes one length for every row);
* ``mixed_qkv`` ``[T, dim]`` -> the conv kernel's channels-first ``[1, dim, T]``, and the conv output -> the GDN
  kernel's head-major ``[heads, T, d]``, and its output ``[n_v, T, d_v]`` -> ``[T, n_v * d_v]``: transposes
  (copies of the activations, one each way: the kernels' layouts are channels-first / head-major);
* the first ``W - 1`` conv outputs of each sequence with a state are recomputed from the gathered state in XLA
  (``S * (W-1) * dim`` values, as tpu-inference's ragged reference and tpukernels' ``causal_conv1d_fn`` do).

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

    from ..library.linear_attention.gdn_ops import gdn_chunk_fwd
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
    # ---- gated delta rule (head-major layout of the kernel: a transpose)
    kq = n_kq * d_k
    f32 = jnp.float32

    def l2norm(x):
        x = x.astype(f32)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = l2norm(y[:, :kq].reshape(t, n_kq, d_k)).transpose(1, 0, 2)
    k = l2norm(y[:, kq:2 * kq].reshape(t, n_kq, d_k)).transpose(1, 0, 2)
    v = y[:, 2 * kq:].reshape(t, n_v, d_v).transpose(1, 0, 2)
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))  # [T, n_v]
    beta = jax.nn.sigmoid(b.astype(f32))
    h0 = jnp.where(has_init[:, None, None, None], recurrent_state[rows].astype(f32), 0.0)
    h0 = jnp.concatenate([h0, jnp.zeros((1, n_v, d_k, d_v), f32)])  # the padding sequence starts from zeros
    o, ht, _ = jax_call(gdn_chunk_fwd, cu_ext, q, k, v, g.T[:, :, None], beta.T[:, :, None], h0,
                        float(d_k) ** -0.5, False, int(chunk_size), interpret=interpret)
    out = o.transpose(1, 0, 2).reshape(t, n_v * d_v)
    out = jnp.where(live_tok[:, None], out, jnp.zeros((), out.dtype)).astype(qkv.dtype)
    new_rec = recurrent_state.at[dest].set(ht[:s].astype(recurrent_state.dtype), mode="drop")
    return (new_conv, new_rec), out


def _jitted():
    import jax

    return jax.jit(_fused_conv1d_gdn, donate_argnames=("conv_state", "recurrent_state"), static_argnames=_STATICS)


_JIT: dict = {}


def fused_conv1d_gdn(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, A_log, dt_bias,
                     query_start_loc, state_indices, distribution, seq_lens, read_state_indices, read_offsets=None, *,
                     n_kq: int, n_v: int, d_k: int, d_v: int, kernel_size: int, num_spec_tokens: int = 0,
                     zero_initialize_out: bool = True, compute_precision=np.float32, decode_tile_size: int = 4,
                     mixed_tile_size: int = 64, chunk_size: int = 64, interpret: str | None = None):
    """tpu-inference's ``fused_conv1d_gdn`` (``kernels/gdn/v3/wrapper.py``, 0.32.0) on tpukernels' causal-conv1d
    and gated-DeltaNet kernels (the formula, layouts and copies: module docstring). Jitted, the two state caches
    donated (as theirs: the arrays passed in are consumed; use the returned ones).

    Args:
        qkv: ``mixed_qkv [T, dim]`` bf16/f32, ``dim = 2 * n_kq * d_k + n_v * d_v`` (q | k | v). b, a:
            ``[T, n_v]`` (beta = sigmoid(b); a: the decay's input).
        conv_state: ``[num_blocks, kernel_size - 1, dim]``; recurrent_state: ``[num_blocks, n_v, d_k, d_v]``
            (float32 kept in float32; block 0 is vLLM's null block, never written here).
        conv_weight: ``[dim, 1, kernel_size]``; conv_bias: ``[dim]`` or None; A_log, dt_bias: ``[n_v]``.
        query_start_loc: int ``[num_seqs + 1]``; state_indices, seq_lens (tokens computed + scheduled),
            read_state_indices: int ``[num_seqs]``; distribution: int ``[3]`` ``(decode_end, prefill_end,
            num_valid_seqs)``. A sequence ``s < num_valid_seqs`` reads its initial states at
            ``read_state_indices[s]`` (zeros when ``seq_lens[s]`` equals its query length: a new prompt) and
            writes them at ``state_indices[s]``.
        read_offsets, num_spec_tokens: speculative decoding; must be None / 0.
        n_kq, n_v, d_k, d_v, kernel_size: the layer's (per-shard) head counts, head dims and conv width.
        zero_initialize_out, decode_tile_size, mixed_tile_size: their kernel's knobs, ignored (padding output is
            always 0). compute_precision: float32 only. chunk_size: GDN chunk (an extension; 64).
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
