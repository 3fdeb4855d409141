"""Linear + cross-entropy family: tpukernels' fused LM-head loss vs XLA's unfused ``logits -> cross-entropy``
at the Llama-3-8B LM head (``h [8192, 4096]``, ``W [128256, 4096]`` bf16, int32 labels).

* ``tpukernels``: ``linear_cross_entropy_fwd`` (forward) and ``+ linear_cross_entropy_bwd_dh +
  linear_cross_entropy_bwd_dw`` (forward + backward), at the config a call gets on the chip;
* ``xla``: the unfused formulation in ``jax.numpy``, what ``F.cross_entropy(h @ W.T)`` lowers to:
  ``logits = dot(h, W^T)`` (bf16, f32 accumulation), ``lse = logsumexp(f32(logits))``, mean of
  ``lse - logits[label]``; the backward is ``jax.value_and_grad`` of it (XLA fuses what it can).

Besides the time, each row's config column carries ``peak_temp_MiB``: the temporary HBM XLA allocates for
the compiled program (``compiled.memory_analysis().temp_size_in_bytes``, compile-only for the chip, beyond
arguments and outputs) — for the unfused version the ``[N, V]`` logits and their gradient, for tpukernels
only the per-row ``loss``/``lse`` columns and the f32 ``g``. That is the activation memory the fusion saves.

Bytes: the inputs read once and the outputs written once (``h``, ``W``, labels; backward also ``dh``,
``dW``). FLOPs: ``2 N V H`` (forward) and ``6 N V H`` (forward + the two gradient matmuls): the work the op
needs. tpukernels' backward recomputes the logits in both gradient kernels (``10 N V H`` executed), which
its % of roofline shows.
"""

from __future__ import annotations

from .core import Case, Impl, kernel_program, ours_impl, xla_impl

FAMILY = "linear_cross_entropy"
N, H, V = 8192, 4096, 128256
#: libtpu's static profiler cannot take the full problem (the tpukernels estimate server runs out of host
#: memory after ~460 s; XLA's unfused program aborts in llo_execution_graph.cc), so both are estimated at
#: ``N / SCALE`` rows (tpukernels at the config the full problem resolves to) and scaled by ``SCALE``: every
#: kernel's grid is uniform in N, and XLA's [N_est, V] matmuls are still large.
SCALE = 4

REASONS = {}


def _peak_temp_bytes(fn, structs, chip: str) -> int:
    """XLA's temporary HBM allocation for ``fn`` compiled for ``chip`` (compile-only), bytes."""
    import jax

    from ..targets.compile_only import tpu_device

    dev = tpu_device(chip)
    sh = jax.sharding.SingleDeviceSharding(dev)
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s in structs]
    with jax.default_device(dev):
        compiled = jax.jit(fn).lower(*structs).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def unfused(h, w, y):
    """Mean cross-entropy of ``h @ w^T`` against ``y [N, 1]`` (XLA's unfused version)."""
    import jax
    import jax.numpy as jnp

    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32).astype(h.dtype).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, y, axis=-1)[:, 0]
    return jnp.mean(lse - tgt)


def _ours_program(chip: str, backward: bool):
    """The jax function of tpukernels' kernels chained as the public op runs them (for memory analysis)."""
    import jax.numpy as jnp

    import tpukernels.library  # noqa: F401
    from ..library import linear_cross_entropy as _public  # noqa: F401
    import sys

    lce = sys.modules["tpukernels.library.linear_cross_entropy"]
    args = (f"{N}x{H}:bf16", f"{V}x{H}:bf16", f"{N}x1:i32")
    kw = {"ignore_index": -100, "softcap": None}
    fwd, fs, _, _ = kernel_program(lce.linear_cross_entropy_fwd, chip, args, kw)
    if not backward:
        return (lambda h, w, y: fwd(h, w, y)[0].sum() / N), fs
    rows = (f"{N}x1:f32", f"{N}x1:f32")
    dh, _, _, _ = kernel_program(lce.linear_cross_entropy_bwd_dh, chip, (*args, *rows), kw)
    dw, _, _, _ = kernel_program(lce.linear_cross_entropy_bwd_dw, chip, (*args, *rows), kw)

    def both(h, w, y):
        loss, lse = fwd(h, w, y)
        g = jnp.full((N, 1), 1.0 / N, jnp.float32)
        return loss.sum() / N, dh(h, w, y, lse, g), dw(h, w, y, lse, g)

    return both, fs


def _with_peak(impl: Impl, program) -> Impl:
    """``impl`` whose config also reports the program's peak temporary HBM (MiB)."""
    inner = impl.cycles

    def cycles(est, chip):
        cyc, cfg = inner(est, chip)
        fn, structs = program(chip)
        peak = round(_peak_temp_bytes(fn, structs, chip) / 2**20, 1)
        if cfg is None:
            cfg = {"impl": impl.config or "-"}
        elif not isinstance(cfg, dict):
            cfg = {"kernels": cfg}
        return cyc, dict(cfg, peak_temp_MiB=peak)

    return Impl(impl.name, impl.kind, cycles, config=impl.config, floor_us=impl.floor_us, probe=impl.probe)


def cases(chips) -> list[Case]:
    import jax
    import jax.numpy as jnp

    import sys

    import tpukernels.library  # noqa: F401

    lce = sys.modules["tpukernels.library.linear_cross_entropy"]
    bf16 = jnp.bfloat16
    sh, sw, sy = (jax.ShapeDtypeStruct((N, H), bf16), jax.ShapeDtypeStruct((V, H), bf16),
                  jax.ShapeDtypeStruct((N, 1), jnp.int32))
    xla_fwd = jax.jit(unfused)
    xla_both = jax.jit(jax.value_and_grad(unfused, argnums=(0, 1)))
    n = N // SCALE
    args = (f"{N}x{H}:bf16", f"{V}x{H}:bf16", f"{N}x1:i32")
    rows = (f"{N}x1:f32", f"{N}x1:f32")
    small = (f"{n}x{H}:bf16", f"{V}x{H}:bf16", f"{n}x1:i32")
    small_rows = (f"{n}x1:f32", f"{n}x1:f32")
    rh, ry = jax.ShapeDtypeStruct((n, H), bf16), jax.ShapeDtypeStruct((n, 1), jnp.int32)
    kw = {"ignore_index": -100, "softcap": None}
    shape = f"h {N}x{H} W {V}x{H}"
    in_bytes = (N * H + V * H) * 2 + N * 4
    out = []
    for chip in chips:
        out.append(Case(FAMILY, "lce fwd", shape, chip, hbm_bytes=in_bytes + 4, flops=2 * N * V * H, impls=[
            _with_peak(ours_impl([(lce.linear_cross_entropy_fwd, small, kw, args)], scale=SCALE),
                       lambda c: _ours_program(c, False)),
            _with_peak(xla_impl(xla_fwd, [rh, sw, ry], name="xla unfused", scale=SCALE),
                       lambda c: (unfused, [sh, sw, sy])),
        ]))
        out.append(Case(FAMILY, "lce fwd+bwd", shape, chip, hbm_bytes=in_bytes + (N * H + V * H) * 2,
                        flops=6 * N * V * H, impls=[
            _with_peak(ours_impl([(lce.linear_cross_entropy_fwd, small, kw, args),
                                  (lce.linear_cross_entropy_bwd_dh, (*small, *small_rows), kw, (*args, *rows)),
                                  (lce.linear_cross_entropy_bwd_dw, (*small, *small_rows), kw, (*args, *rows))],
                                 scale=SCALE),
                       lambda c: _ours_program(c, True)),
            _with_peak(xla_impl(xla_both, [rh, sw, ry], name="xla unfused", scale=SCALE),
                       lambda c: (jax.value_and_grad(unfused, argnums=(0, 1)), [sh, sw, sy])),
        ]))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get((row["chip"], row["op"]))
