"""Linear + cross-entropy family: tpukernels' fused LM-head loss vs XLA's unfused ``logits -> cross-entropy``
at the Llama-3-8B LM head (``h [8192, 4096]``, ``W [128256, 4096]`` bf16, int32 labels).

* ``tpukernels``: ``linear_cross_entropy_fwd`` (forward) and ``+ linear_cross_entropy_bwd_dh +
  linear_cross_entropy_bwd_dw`` (forward + backward), at the config a call gets on the chip;
* ``xla unfused``: the unfused formulation in ``jax.numpy``, what ``F.cross_entropy(h @ W.T)`` lowers to:
  ``logits = dot(h, W^T)`` (bf16, f32 accumulation), ``lse = logsumexp(f32(logits))``, mean of
  ``lse - logits[label]``; the backward is ``jax.value_and_grad`` of it (XLA fuses what it can).

**Peak activation memory** (the ``peak_temp_MiB`` column, tpukernels / xla): the temporary HBM XLA allocates
for the whole program compiled for the chip at the **full** problem (``compiled.memory_analysis()
.temp_size_in_bytes``, compile-only, beyond arguments and outputs): for the unfused version the ``[N, V]``
logits and their gradient, for tpukernels only the per-row ``loss``/``lse`` columns and the f32 ``g``. That
is the activation memory the fusion saves (Liger-Kernel's headline figure).

**Time** (a model): libtpu's static profiler cannot take the full problem (the estimate server ran out of
host memory after ~460 s on tpukernels' forward at ``N/4`` rows; XLA's unfused program aborted in
``llo_execution_graph.cc``), so every program is estimated on a reduced problem and scaled by its work:

* tpukernels: each kernel at the full problem's shapes and config, its grid cut to ``OURS_STEPS`` steps by
  :func:`tpukernels.autotune.model.reduce_grid` (outer axes shrunk, the innermost reduction axis kept, as the
  autotuner's ``--estimate-steps``), cycles scaled by ``steps / reduced steps`` (e.g. forward on v5e:
  grid ``(8, 126)`` -> ``(1, 16)``, x63). ``bwd_dw``, whose inner axis is N, keeps all of it: ``(2, 8)``.
* XLA: the same program at ``N / XLA_DIV`` rows and ``V / XLA_DIV`` vocabulary (``h [1024, 4096]``,
  ``W [16032, 4096]``: a 1024 x 4096 x 16032 matmul and 64 MB of f32 logits, well inside XLA's large-matmul
  regime), cycles scaled by ``XLA_DIV**2`` = 64: every op of the unfused program is linear in ``N V``
  (the ``N H`` / ``V H`` parts are the small gradient epilogues).

Both reductions are about x64 and both charge each reduced program's pipeline start-up ~64 times (a few
% high). Checked once on v6e (``benchmarks``-style, one chip): see :data:`REDUCTION_CHECK`.

Where libtpu aborts on XLA's program the row is a **floor**: the larger of the MXU roofline of the work
the op needs and the HBM time of writing and reading the bf16 ``[N, V]`` logits once (plus the inputs).

Bytes: the inputs read once and the outputs written once (``h``, ``W``, labels; backward also ``dh``,
``dW``). FLOPs: ``2 N V H`` (forward) and ``6 N V H`` (forward + the two gradient matmuls): the work the op
needs. tpukernels' backward recomputes the logits in both gradient kernels (``10 N V H`` executed), which
its % of roofline shows.
"""

from __future__ import annotations

import dataclasses

from .core import Case, Impl, kernel_program, xla_impl

FAMILY = "linear_cross_entropy"
N, H, V = 8192, 4096, 128256
#: tpukernels' kernels are estimated on at most this many grid steps (reduce_grid) and scaled
OURS_STEPS = 16
#: XLA's unfused program is estimated at N / XLA_DIV rows and V / XLA_DIV vocabulary, scaled by XLA_DIV**2
XLA_DIV = 8
#: reduced vs less-reduced estimates on one chip (filled in from benchmarks/..., see module docstring)
REDUCTION_CHECK: dict = {}

REASONS = {}


def _lce():
    import sys

    import tpukernels.library  # noqa: F401

    return sys.modules["tpukernels.library.linear_cross_entropy"]


def _peak_temp_bytes(fn, structs, chip: str) -> int:
    """XLA's temporary HBM allocation for ``fn`` compiled for ``chip`` (compile-only), bytes."""
    return int(_memory_stats(fn, structs, chip).temp_size_in_bytes)


def _memory_stats(fn, structs, chip: str):
    """``compiled.memory_analysis()`` of ``fn`` compiled for ``chip`` (compile-only)."""
    import jax

    from ..targets.compile_only import tpu_device

    dev = tpu_device(chip)
    sh = jax.sharding.SingleDeviceSharding(dev)
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s in structs]
    with jax.default_device(dev):
        compiled = jax.jit(fn).lower(*structs).compile()
    return compiled.memory_analysis()


def unfused(h, w, y):
    """Mean cross-entropy of ``h @ w^T`` against ``y [N, 1]`` (XLA's unfused version)."""
    import jax
    import jax.numpy as jnp

    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32).astype(h.dtype).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, y, axis=-1)[:, 0]
    return jnp.mean(lse - tgt)


def _args(n: int = N, v: int = V, backward: bool = False) -> tuple:
    a = (f"{n}x{H}:bf16", f"{v}x{H}:bf16", f"{n}x1:i32")
    return (*a, f"{n}x1:f32", f"{n}x1:f32") if backward else a


_KW = {"ignore_index": -100, "softcap": None}


def _ours_program(chip: str, backward: bool):
    """The jax function of tpukernels' kernels chained as the public op runs them (for memory analysis)."""
    import jax.numpy as jnp

    lce = _lce()
    fwd, fs, _, _ = kernel_program(lce.linear_cross_entropy_fwd, chip, _args(), _KW)
    if not backward:
        return (lambda h, w, y: fwd(h, w, y)[0].sum() / N), fs
    dh, _, _, _ = kernel_program(lce.linear_cross_entropy_bwd_dh, chip, _args(backward=True), _KW)
    dw, _, _, _ = kernel_program(lce.linear_cross_entropy_bwd_dw, chip, _args(backward=True), _KW)

    def both(h, w, y):
        loss, lse = fwd(h, w, y)
        g = jnp.full((N, 1), 1.0 / N, jnp.float32)
        return loss.sum() / N, dh(h, w, y, lse, g), dw(h, w, y, lse, g)

    return both, fs


def _xla_program(backward: bool, n: int = N, v: int = V):
    import jax
    import jax.numpy as jnp

    structs = [jax.ShapeDtypeStruct((n, H), jnp.bfloat16), jax.ShapeDtypeStruct((v, H), jnp.bfloat16),
               jax.ShapeDtypeStruct((n, 1), jnp.int32)]
    return (jax.value_and_grad(unfused, argnums=(0, 1)) if backward else unfused), structs


def reduced_kernel_cycles(est, kernel, chip: str, args, kwargs, max_steps: int):
    """libtpu cycles of ``kernel`` at ``args`` (the config a call gets on ``chip``), estimated on its grid cut to
    ``max_steps`` steps (:func:`tpukernels.autotune.model.reduce_grid`) and scaled by the step ratio.

    Returns ``(cycles, config, source, grid, reduced_grid)``."""
    import jax

    from ..autotune import model
    from ..chips import get_chip
    from ..lowering import build_fn, lower
    from ..targets import bucket_specs
    from ..targets.compile_only import example_specs

    specs, statics = example_specs(kernel, args, kwargs)
    low = lower(kernel, bucket_specs(kernel, specs), statics, None, mode="mosaic", chip=get_chip(chip))
    launch = low.resolved.launch
    grid = tuple(int(g) for g in launch.grid)
    reduced = model.reduce_grid(grid, max_steps)
    fn = low.fn
    if reduced != grid:
        resolved = dataclasses.replace(low.resolved, launch=dataclasses.replace(launch, grid=reduced))
        fn = jax.jit(build_fn(kernel, resolved, "mosaic")[0], keep_unused=True)
    cyc = est.cycles(fn, list(low.arg_structs), chip)
    scaled = round(cyc * model.grid_steps(grid) / model.grid_steps(reduced))
    return scaled, dict(low.config), low.resolved.source, grid, reduced


def _ours(kernels, backward: bool, max_steps: int = OURS_STEPS) -> Impl:
    def cycles(est, chip):
        total, parts = 0, []
        for k in kernels:
            args = _args(backward=not k.name.endswith("_fwd"))
            cyc, cfg, source, grid, red = reduced_kernel_cycles(est, k, chip, args, _KW, max_steps)
            total += cyc
            cfgs = ",".join(f"{a}={b}" for a, b in sorted(cfg.items()))
            parts.append(f"{k.name.replace('linear_cross_entropy_', '')}: {cfgs},source={source},"
                         f"grid={'x'.join(map(str, grid))} est. on {'x'.join(map(str, red))}")
        return total, "; ".join(parts)

    return Impl("tpukernels", "ours", cycles, memory=lambda chip: _peak(_ours_program(chip, backward), chip))


def _peak(program, chip: str) -> dict:
    """``peak_temp_MiB``: XLA's temporary allocation (beyond arguments and outputs); ``peak_MiB``: its peak of
    all live buffers, arguments and outputs included (``peak_memory_in_bytes``), both MiB."""
    fn, structs = program
    m = _memory_stats(fn, structs, chip)
    return {"peak_temp_MiB": round(m.temp_size_in_bytes / 2**20, 1),
            "peak_MiB": round(m.peak_memory_in_bytes / 2**20, 1)}


def _floor(backward: bool):
    """Lower bound on the unfused version's time, µs: MXU roofline of the needed work, or the HBM time of the
    inputs (and gradients) plus writing and reading the bf16 [N, V] logits once, whichever is larger."""

    def floor(chip: str) -> float:
        from ..perf import hbm_bandwidth, peak_flops

        flops = (6 if backward else 2) * N * V * H
        nbytes = _in_bytes(backward) + 2 * 2 * N * V
        return max(flops / peak_flops(chip, "bfloat16"), nbytes / hbm_bandwidth(chip)) * 1e6

    return floor


def _in_bytes(backward: bool) -> int:
    b = (N * H + V * H) * 2 + N * 4
    return b + (N * H + V * H) * 2 if backward else b + 4


def _xla(backward: bool, div: int = XLA_DIV) -> Impl:
    import jax

    fn, structs = _xla_program(backward, N // div, V // div)
    impl = xla_impl(jax.jit(fn), structs, name="xla unfused", scale=div * div, floor_us=_floor(backward))
    impl.config = f"XLA fusion, est. at h {N // div}x{H} W {V // div}x{H} x{div * div}"
    impl.memory = lambda chip: _peak(_xla_program(backward), chip)
    return impl


def cases(chips) -> list[Case]:
    lce = _lce()
    fwd, dh, dw = lce.linear_cross_entropy_fwd, lce.linear_cross_entropy_bwd_dh, lce.linear_cross_entropy_bwd_dw
    shape = f"h {N}x{H} W {V}x{H}"
    out = []
    for chip in chips:
        out.append(Case(FAMILY, "lce fwd", shape, chip, hbm_bytes=_in_bytes(False), flops=2 * N * V * H,
                        impls=[_ours([fwd], False), _xla(False)]))
        out.append(Case(FAMILY, "lce fwd+bwd", shape, chip, hbm_bytes=_in_bytes(True), flops=6 * N * V * H,
                        impls=[_ours([fwd, dh, dw], True), _xla(True)]))
    return out


def reason(row: dict) -> str | None:
    return REASONS.get((row["chip"], row["op"]))
