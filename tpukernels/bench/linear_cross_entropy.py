"""Linear + cross-entropy family: tpukernels' fused LM-head loss vs XLA's unfused ``logits -> cross-entropy``
at the Llama-3-8B LM head (``h [8192, 4096]``, ``W [128256, 4096]`` bf16, int32 labels).

* ``tpukernels``: ``linear_cross_entropy_fwd`` (forward) and ``linear_cross_entropy_fwd_dh +
  linear_cross_entropy_bwd_dw`` (forward + backward, as the public op runs when ``h`` requires grad: ``dh`` in
  the forward pass, ``dW`` with one recompute of the logits), at the config a call gets on the chip;
* ``tpukernels chunked 1024`` (forward + backward only): the public op with ``chunk_rows=1024`` (issue 40), per
  chunk of 1024 rows ``linear_cross_entropy_fwd_s`` (the forward, f32 logits written to HBM),
  ``linear_cross_entropy_dh_s`` and ``linear_cross_entropy_dw_s`` / ``..._dw_s_acc`` (``dW += ds^T h`` into an
  f32 accumulator) from the stored logits: ``6 N V H`` FLOPs, each kernel estimated on a reduced grid at one
  chunk's shapes and multiplied by the chunk count; its memory figure is the whole chunk loop compiled at the
  full problem;
* ``xla unfused``: the unfused formulation in ``jax.numpy``, what ``F.cross_entropy(h @ W.T)`` lowers to:
  ``logits = dot(h, W^T)`` (bf16, f32 accumulation), ``lse = logsumexp(f32(logits))``, mean of
  ``lse - logits[label]``; the backward is ``jax.value_and_grad`` of it (XLA fuses what it can).

**Peak activation memory** (the ``peak_temp_MiB`` column, tpukernels / xla): the temporary HBM XLA allocates
for the whole program compiled for the chip at the **full** problem (``compiled.memory_analysis()
.temp_size_in_bytes``, compile-only, beyond arguments and outputs): for the unfused version the ``[N, V]``
logits and their gradient, for tpukernels the per-row ``loss``/``lse`` columns, the f32 ``g`` and (forward +
backward) the gathered rows ``W[labels]`` (``[N, H]``, read by the forward's DMA). That
is the activation memory the fusion saves (Liger-Kernel's headline figure). ``peak_MiB``: XLA's peak of all
live buffers, arguments (``h``, ``W``: 1.07 GB) and outputs (``dh``, ``dW``) included
(``peak_memory_in_bytes``).

**Time** (a model): libtpu's static profiler cannot take the full problem (the estimate server ran out of
host memory after ~460 s on tpukernels' forward at ``N/4`` rows; XLA's unfused program aborted in
``llo_execution_graph.cc``), so every program is estimated on a reduced problem and scaled by its work:

* tpukernels: each kernel at the full problem's shapes and config, its grid cut to ``OURS_STEPS`` = 64 steps
  by :func:`tpukernels.autotune.model.reduce_grid` (outer axes shrunk, the innermost reduction axis kept, as
  the autotuner's ``--estimate-steps``), cycles scaled by ``steps / 64`` (forward ``bn=bv=1024``: grid
  ``(8, 126)`` -> ``(1, 64)``, x15.75; ``bwd_dw``, whose inner axis is N, keeps all of it: ``(8, 8)``). The
  reduced grid never reaches the last V step (the V tail, which ``fwd_dh`` masks only there), 1 of 126.
* XLA: the same program at ``N / 4`` rows and ``V / 4`` vocabulary (forward: ``h [2048, 4096]``,
  ``W [32064, 4096]``, x16) or ``V / 8`` (forward + backward: ``W [16032, 4096]``, x32), cycles scaled by
  ``N V / (n v)``: every op of the unfused program is linear in ``N V`` (its ``N H`` / ``V H`` parts are small
  epilogues), and a 2048 x 4096 x 16032 matmul is well inside XLA's large-matmul regime.

Reduction check (v6e, libtpu 0.0.52, cycles; each reduction charges the reduced program's pipeline start-up
once per scaled copy, so more reduction reads high): tpukernels at 16 vs 64 steps: forward 21.72 M vs
20.88 M (+4.0%), ``bwd_dh`` 40.71 M vs 38.56 M (+5.6%), ``bwd_dw`` 39.94 M vs 37.76 M (+5.8%); XLA forward at
``N/8 x V/8`` vs ``N/4 x V/4``: 21.25 M vs 19.61 M (+8.3%); XLA forward + backward at ``N/8 x V/8`` and
``N/4 x V/8`` vs ``N/4 x V/4``: 62.35 M (+5.4%) and 60.04 M (+1.5%) vs 59.13 M. The vocabulary padding of
the reduced problems is not the cause (XLA forward + backward at ``W [16384, 4096]`` vs ``[16032, 4096]``:
62.10 M vs 62.35 M). At ``N/4 x V/4`` XLA's forward + backward needs 10.6 GB of estimator memory (91 s), over
this machine's per-estimate budget, hence ``V/8`` for it. Each estimate here takes 15-90 s and <= ~6 GB.

Where libtpu fails on XLA's program, its row is a **floor**: the larger of the MXU roofline of the work the
op needs and the HBM time of the inputs plus writing and reading the bf16 ``[N, V]`` logits once. Where it
fails on tpukernels', the row has no figure (a floor there would enter the ratios); its reason gives the MXU
time of the matmuls the kernels execute (``2 N V H`` forward, ``8 N V H`` forward + backward). libtpu
0.0.52 aborts (``llo_execution_graph.cc:149``) on every v5e XLA program tried (``N/4 x V/4``, ``N/4 x V/8``,
``N/8 x V/8``, ``1024 x 16384``, ``512 x 8016``), on tpu7x's forward + backward at ``N/4 x V/8`` and
``N/8 x V/8`` (it estimates ``512 x 8016``), on v5e's ``bwd_dh`` at ``bv >= 512``, and its static-profile
compile of tpukernels' tpu7x forward runs out of VMEM (see the reasons in the report).

Bytes: the inputs read once and the outputs written once (``h``, ``W``, labels; backward also ``dh``,
``dW``). FLOPs: ``2 N V H`` (forward) and ``6 N V H`` (forward + the two gradient matmuls): the work the op
needs. tpukernels' forward + backward computes the logits twice (``8 N V H`` executed: ``fwd_dh`` 4, ``bwd_dw``
4), which its % of roofline shows: at most 75% of it at a perfect MXU.
"""

from __future__ import annotations

import dataclasses

from .core import Case, Impl, kernel_program, xla_impl

FAMILY = "linear_cross_entropy"
LIBRARY = ("linear_cross_entropy_ops",)  # the library modules its figures depend on (bench.core.source_digest)
N, H, V = 8192, 4096, 128256
#: tpukernels' kernels are estimated on at most this many grid steps (reduce_grid) and scaled
OURS_STEPS = 64
#: XLA's unfused program is estimated at (N / rows, V / vocab) and scaled by rows * vocab (module docstring)
XLA_DIV = {False: (4, 4), True: (4, 8)}

_RECOMPUTE = (
    "One recompute: the forward kernel (fwd_dh) computes dh in the same pass as the loss (flash-attention style: "
    "an f32 [bn, H] accumulator of exp(z - m) @ W_blk rescaled as the running max moves, W[labels] subtracted "
    "at the end), the backward's dW kernel recomputes the logits once: 8 N V H FLOPs executed against the 6 N V H "
    "of the unfused version, which keeps its [N, V] logits in HBM (~6 GiB of temporaries, the peak_temp_MiB "
    "column) and reads them back. 8/6 of the work caps the ratio at 0.75x XLA's MXU efficiency (0.91x on v6e, "
    "where XLA's unfused program reads 82% of its roofline, only at 100% MXU for ours). Fewer FLOPs would need "
    "the logits stored (O(N V), or Liger-Kernel's [N/k, V] chunks plus k read-modify-write passes over an f32 "
    "[V, H] dW): that is the chunked strategy (chunk_rows=, the 'tpukernels chunked' row), slower by this model. "
    "Before this, dh and dW each recomputed the logits (10 N V H): 0.62x on v6e")
_CHUNKED = (
    "Chunked strategy (issue 40; libtpu 0.0.52 estimates of one chunk's kernels x the chunk count, made "
    "2026-12-06 under load; the fused and XLA rows are the 2026-12-03 run's, those kernels unchanged): v6e "
    "chunk_rows=1024: fwd_s 1.59 + dh_s 1.95 ms per chunk (x8), dw_s 1.57, dw_s_acc 4.40 ms (x7) = 60.7 ms, "
    "0.56x XLA unfused (34.2 ms) and 0.71x the fused kernels (42.8 ms); chunk_rows=2048: 58.7 ms (dw_s 3.39, "
    "dw_s_acc 8.99 ms x3). Why: the 6 N V H saved against 8 is lost twice over, (a) its Pallas matmuls reach "
    "only 60-75% of the MXU (fwd_s 73%, dh_s 60%, dw_s 74%; XLA's whole chunk program below, softmax and "
    "accumulator included, 76%), (b) libtpu charges "
    "the f32 dW accumulator's read-modify-write (8 V H bytes = 4.2 GB per chunk, 2.6 ms at v6e's 1.64 TB/s) "
    "on top of the dW matmul instead of under it (dw_s_acc 4.40 ms vs dw_s 1.57 ms at 1024 rows). The same "
    "chunked algorithm written as one XLA program per chunk (tokamax's chunked_xla: f32 logits by one XLA "
    "dot, softmax, dh and dW += ... by XLA dots; estimated at V/8 and scaled) reads 37.0 ms (1024 rows, "
    "0.92x) and 34.9 ms (2048 rows, 0.98x) on v6e, 26.5 ms (1024 rows) on tpu7x: XLA overlaps the "
    "accumulator's traffic with its dot. Memory (peak_temp_MiB, the chunk loop compiled as a lax.scan at the "
    "full problem): 2513 MiB at 1024 rows and 3022 MiB at 2048 (v6e and tpu7x alike) against XLA's 6012 and "
    "the fused kernels' 128: 2.4x / 2.0x less than XLA. Any row-chunked scheme with an f32 dW keeps that "
    "accumulator (V H 4 bytes = 2004 MiB here, a third of XLA's temporaries) plus chunk x V x 4 bytes of "
    "logits (501 MiB at 1024 rows), so the issue's >= 40x less temporary memory (<= 150 MiB) is out of reach "
    "for it; only the fused kernels (vocabulary-chunked, dW summed in VMEM) get there (47x). Not met: >= 0.95x "
    "XLA at >= 40x less temporary memory")
REASONS_CHUNKED = {
    ("v6e", "lce fwd+bwd"): _CHUNKED,
    ("tpu7x", "lce fwd+bwd"): _CHUNKED + ". tpu7x: libtpu's static-profile compile runs out of its 64 MiB VMEM "
                                         "for the chunk kernels at the blocks a call gets (75 MiB asked) and for "
                                         "dw_s / dw_s_acc at every block tried ((1024, 256) to (512, 256): 67-103 "
                                         "MiB; the ordinary compile fits): no estimate. fwd_s "
                                         "(512, 512) 1.44 and dh_s (512, 1024) 1.39 ms per 1024-row chunk give "
                                         "22.7 ms before any dW work, against the fused kernels' 34.1 ms and "
                                         "XLA's 22.4 ms floor",
}
REASONS = {
    ("v5e", "lce fwd"): "At 95% of the MXU roofline; XLA's unfused figure is only a floor (its MXU roofline): "
                        "libtpu 0.0.52 aborts (llo_execution_graph.cc:149) on every v5e XLA program tried, so "
                        "there is no estimate to compare with",
    ("v5e", "lce fwd+bwd"): _RECOMPUTE + ". On v5e libtpu's profiler aborts on every XLA program: its row is a "
                            "floor (the MXU roofline of 6 N V H, 131.1 ms), against which 8 N V H can read at "
                            "most 0.75x",
    ("v6e", "lce fwd"): "libtpu charges 21.5k cycles per 1024 x 1024 block step (16-step estimate) against 16.4k "
                        "for its matmul at the MXU peak (v5e: 70.2k vs 65.5k, 95%). Variants of the kernel "
                        "estimated the same way show the label compare and the V-tail mask are not it (-1.2% "
                        "and 0% without them); the rest, the online-softmax epilogue on the f32 (bn, bv) tile "
                        "(an exp per logit, running max and sum) not hidden under the matmul or the matmul's own "
                        "efficiency at these blocks, is not separated (a matmul-only variant was optimised away "
                        "by the compiler). XLA's unfused forward pays a memory-bound logsumexp pass instead. The "
                        "fused forward wins on memory (4 MiB vs 6 GiB of temporaries), not on v6e model time",
    ("v6e", "lce fwd+bwd"): _RECOMPUTE,
    ("tpu7x", "lce fwd"): "No estimate: libtpu 0.0.52's static-profile compile runs out of tpu7x's 64 MiB VMEM "
                          "for the shipped bn=bv=1024 (and every bn*bv >= 1024*256; the ordinary compile fits); "
                          "its MXU roofline is 7.45 ms. At bn=bv=512, the largest estimable blocks, the forward "
                          "reads 12.5 ms (16-step estimate), slower than XLA's 9.7 ms",
    ("tpu7x", "lce fwd+bwd"): _RECOMPUTE + ". On tpu7x libtpu aborts on XLA's program at N/4 x V/8: its row is "
                              "a floor (22.4 ms); XLA's program at 512 x 8016 (x256) does estimate: 29.0 ms",
}


def _lce():
    import sys

    import tpukernels.library  # noqa: F401

    return sys.modules["tpukernels.library.linear_cross_entropy_ops"]


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


def _args(n: int = N, v: int = V, backward: bool = False, dh: bool = False) -> tuple:
    a = (f"{n}x{H}:bf16", f"{v}x{H}:bf16", f"{n}x1:i32")
    if dh:  # fwd_dh: + wy = W[labels] [N, H], g [N, 1]
        return (*a, f"{n}x{H}:bf16", f"{n}x1:f32")
    return (*a, f"{n}x2:f32", f"{n}x1:f32") if backward else a  # bwd: + the lse (hi, lo) pair [N, 2], g [N, 1]


_KW = {"ignore_index": -100, "softcap": None}
#: the chunked strategy's rows per chunk, one bench row each (module docstring)
CHUNK_ROWS = (1024,)


def _ours_program(chip: str, backward: bool):
    """The jax function of tpukernels' kernels chained as the public op runs them (for memory analysis)."""
    import jax.numpy as jnp

    lce = _lce()
    fwd, fs, _, _ = kernel_program(lce.linear_cross_entropy_fwd, chip, _args(), _KW)
    if not backward:
        return (lambda h, w, y: fwd(h, w, y)[0].sum() / N), fs
    fdh, _, _, _ = kernel_program(lce.linear_cross_entropy_fwd_dh, chip, _args(dh=True), _KW)
    dw, _, _, _ = kernel_program(lce.linear_cross_entropy_bwd_dw, chip, _args(backward=True), _KW)

    def both(h, w, y):  # as the public op with reduction="mean" and an upstream gradient of 1
        g = jnp.full((N, 1), 1.0 / N, jnp.float32)
        wy = jnp.take(w, y[:, 0], axis=0)
        loss, lse, dh = fdh(h, w, y, wy, g)
        return loss.sum(), dh, dw(h, w, y, lse, g)

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


def _chunk_args(kind: str, c: int) -> tuple:
    """Example arguments of a chunked-strategy kernel for one chunk of ``c`` rows."""
    if kind == "fwd_s":
        return _args(c)
    x = f"{V}x{H}:bf16" if kind == "dh_s" else f"{c}x{H}:bf16"
    a = (f"{c}x{V}:f32", x, f"{c}x1:i32", f"{c}x2:f32", f"{c}x1:f32")
    return (*a, f"{V}x{H}:f32") if kind == "dw_s_acc" else a


def _chunked_program(chip: str, rows: int):
    """The chunked strategy's jax program at the full problem (chunks of ``rows`` rows, dh and dW), for
    memory analysis: a ``lax.scan`` over the chunks, as the public op runs them one after the other (a Python
    loop here would let XLA schedule every chunk's ``fwd_s`` first and hold all their logits at once), dW's f32
    accumulator in the carry (zeros first: one ``dw_s_acc`` per chunk)."""
    import jax
    import jax.numpy as jnp

    lce = _lce()
    k = {kind: kernel_program(lce.KERNELS[kind], chip, _chunk_args(kind, rows), _KW)[0]
         for kind in ("fwd_s", "dh_s", "dw_s_acc")}
    one = lambda out: out[0] if isinstance(out, (tuple, list)) else out  # noqa: E731  (a 1-output kernel)
    _, fs, _, _ = kernel_program(lce.linear_cross_entropy_fwd, chip, _args(), _KW)

    def both(h, w, y):
        g = jnp.full((rows, 1), 1.0 / N, jnp.float32)

        def chunk(dw, hy):
            hc, yc = hy
            loss, lse, s = k["fwd_s"](hc, w, yc)
            dh = one(k["dh_s"](s, w, yc, lse, g))
            return one(k["dw_s_acc"](s, hc, yc, lse, g, dw)), ((loss * g).sum(), dh)

        dw, (losses, dh) = jax.lax.scan(chunk, jnp.zeros((V, H), jnp.float32),
                                        (h.reshape(N // rows, rows, H), y.reshape(N // rows, rows, 1)))
        return losses.sum(), dh.reshape(N, H), dw.astype(w.dtype)

    return both, fs


def _ours_chunked(rows: int, max_steps: int = OURS_STEPS) -> Impl:
    """tpukernels' chunked strategy (``chunk_rows=rows``): per chunk ``fwd_s + dh_s`` and ``dw_s`` (first
    chunk) or ``dw_s_acc`` (the others), each estimated on a reduced grid at the chunk's shapes and the config
    a call gets, summed over the ``N / rows`` chunks."""
    n_chunks = N // rows

    def cycles(est, chip):
        lce = _lce()
        total, parts = 0, []
        for kind, times in (("fwd_s", n_chunks), ("dh_s", n_chunks), ("dw_s", 1), ("dw_s_acc", n_chunks - 1)):
            k = lce.KERNELS[kind]
            cyc, cfg, source, grid, red = reduced_kernel_cycles(est, k, chip, _chunk_args(kind, rows), _KW, max_steps)
            total += cyc * times
            cfgs = ",".join(f"{a}={b}" for a, b in sorted(cfg.items()))
            parts.append(f"{kind} x{times}: {cfgs},source={source},grid={'x'.join(map(str, grid))} est. on "
                         f"{'x'.join(map(str, red))}")
        return total, "; ".join(parts)

    return Impl(f"tpukernels chunked {rows}", "ours", cycles,
                memory=lambda chip: _peak(_chunked_program(chip, rows), chip))


def _ours(kernels, backward: bool, max_steps: int = OURS_STEPS) -> Impl:
    def cycles(est, chip):
        total, parts = 0, []
        for k in kernels:
            args = _args(backward=not k.name.endswith("_fwd"), dh=k.name.endswith("_fwd_dh"))
            cyc, cfg, source, grid, red = reduced_kernel_cycles(est, k, chip, args, _KW, max_steps)
            total += cyc
            cfgs = ",".join(f"{a}={b}" for a, b in sorted(cfg.items()))
            parts.append(f"{k.name.replace('linear_cross_entropy_', '')}: {cfgs},source={source},"
                         f"grid={'x'.join(map(str, grid))} est. on {'x'.join(map(str, red))}")
        return total, "; ".join(parts)

    # no floor_us: a floor of ours would enter the report's ratios as if it were an estimate (the reasons
    # give the MXU time of the executed matmuls instead)
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


def _xla(backward: bool) -> Impl:
    import jax

    dn, dv = XLA_DIV[backward]
    fn, structs = _xla_program(backward, N // dn, V // dv)
    impl = xla_impl(jax.jit(fn), structs, name="xla unfused", scale=dn * dv, floor_us=_floor(backward))
    impl.config = f"XLA fusion, est. at h {N // dn}x{H} W {V // dv}x{H} x{dn * dv}"
    impl.memory = lambda chip: _peak(_xla_program(backward), chip)
    return impl


def cases(chips) -> list[Case]:
    lce = _lce()
    fwd, fdh, dw = lce.linear_cross_entropy_fwd, lce.linear_cross_entropy_fwd_dh, lce.linear_cross_entropy_bwd_dw
    shape = f"h {N}x{H} W {V}x{H}"
    out = []
    for chip in chips:
        out.append(Case(FAMILY, "lce fwd", shape, chip, hbm_bytes=_in_bytes(False), flops=2 * N * V * H,
                        impls=[_ours([fwd], False), _xla(False)]))
        out.append(Case(FAMILY, "lce fwd+bwd", shape, chip, hbm_bytes=_in_bytes(True), flops=6 * N * V * H,
                        impls=[_ours([fdh, dw], True), *(_ours_chunked(r) for r in CHUNK_ROWS), _xla(True)]))
    return out


def reason(row: dict) -> str | None:
    if row["impl"].startswith("tpukernels chunked"):
        return REASONS_CHUNKED.get((row["chip"], row["op"]))
    return REASONS.get((row["chip"], row["op"]))
