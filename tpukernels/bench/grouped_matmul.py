"""Grouped matmul family: tpukernels' grouped_matmul vs XLA's ``jax.lax.ragged_dot``, JAX's megablox ``gmm`` /
``tgmm`` and tpu-inference's megablox fork, bf16 in, bf16 out, at Mixtral-8x7B expert shapes.

Shapes: :data:`tpukernels.library.grouped_matmul_ops.STANDARD_CASES`: 8192 tokens, top-2 = 16384 rows over 8
experts, hidden 4096, ffn 14336: the gate/up projection ``x[16384, 4096] @ W1[g].T`` (``W1 [8, 14336, 4096]``,
``transpose_rhs=True``, HF's layout), the down projection ``h[16384, 14336] @ W2[g].T`` (``[8, 4096, 14336]``)
and ``x @ W[g]`` with ``W [8, 4096, 14336]`` (``transpose_rhs=False``, megablox's layout); the weight
gradient (tgmm) of the first, ``d_W[g] = x[rows of g]^T @ dO[rows of g]``.

* ``tpukernels``: ``grouped_matmul_fwd`` / ``grouped_matmul_tgmm`` at the config a full-size call gets on the
  chip (shipped tuning DB, else heuristic), plus its on-device work-item schedule;
* ``xla ragged_dot``: ``jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=f32).astype(bf16)``
  (``rhs`` pre-transposed for the ``W.T`` cases: the transpose is not counted, in its favour); for the
  weight gradient ``jax.lax.ragged_dot_general`` with the ragged contracting dimension (what
  ``jax.grad(ragged_dot)`` emits);
* ``jax megablox gmm`` / ``tgmm``: ``jax.experimental.pallas.ops.tpu.megablox`` at tiling
  ``(512, 1024, 1024)`` (tgmm ``(512, 512, 1024)``), clamped to the shape; ``transpose_rhs=True`` where we
  use it; plus its ``make_group_metadata``;
* ``tpu-inference megablox gmm``: tpu-inference 0.32.0's fork of megablox (``kernels/megablox/gmm.py``, installed
  ``--no-deps``; forward only, it has no tgmm) at the tiling it takes itself (:func:`tpu_inference_tiling`: its tuned
  table, which has no Mixtral entry, else its default ``(512, 2048, 2048)`` here), clamped to the shape; it has no
  ``transpose_rhs``, so the ``W[g].T`` rows give it ``[G, K, N]`` weights (the transpose not counted, in its favour);
  its grid and metadata are treated as JAX megablox's below (the same ``make_group_metadata``).

**Reduced problems, the same way for every implementation.** libtpu's static profiler needs ~20 GB and
> 15 min for one full 16384-row grid (its time grows faster than the grid: ours at 2048 / 4096 / 8192 rows
of one output block took 14 / 24 / 73 s and 1.7 / 3.0 / 6.7 GB). So each implementation's kernel is
estimated at three reduced problems -- ``M1 = 2048`` and ``M2 = 4096`` rows (``FIT_ROWS``; the group sizes
scaled, they do not enter any static program) with one block of ``N_EST = 2048`` output columns (tgmm: one
``2048 x 2048`` d_W block, ``K_EST_TGMM``; one d_W block of ours where its ``bk`` or ``bn`` is larger), and
``M1`` rows with two blocks -- and the cycles are fitted as
``a + nb * (b + q * M)`` (``a``: once per launch, the pipeline prologue; ``b``: per output block, e.g. our
``G - 1`` extra work items; ``q``: per row) and evaluated at the full ``M`` and ``nb = N / 2048`` blocks
(tgmm ``K/2048 * N/2048``). The metadata program (our schedule, megablox's ``make_group_metadata``) is
estimated separately at the full problem and added (libtpu sums per-op estimates anyway). Check on v6e, up
projection, at the shipped config: the fit predicts ours' 8192-row estimate within 0.01% (364,477 vs
364,447 cycles) and its 4-block one within 0.09% (589,276 vs 588,722); megablox's both exactly (553,346
and 1,052,432 cycles). XLA's program is fitted the same way (where libtpu can estimate it at all).

**megablox's grid.** megablox sizes its grid with ``num_active_tiles``, a traced value; libtpu's static
profiler assumes a fixed ~42 iterations for a dynamic grid axis whatever the problem (calibrated on a toy
kernel with a dynamic vs a static grid on v6e: 42.7 / 42.2 / 42.1 iterations at three per-step costs;
megablox's estimate at 1024 and 2048 rows differ by 0.06%). The bench therefore gives megablox's kernel the
static bound ``tiles_m + G - 1`` as its grid length -- what its grid runs at most, and the count ours is
estimated at (libtpu reads neither schedule: SMEM is zeros to it) -- by wrapping ``make_group_metadata``
while tracing (:func:`_static_metadata`); the kernel is megablox's, its metadata constant zeros (as libtpu
sees any data), and the real ``make_group_metadata`` is the separately estimated metadata program.

**Where libtpu 0.0.52 cannot estimate** the row keeps the error and shows a **floor** (a lower bound):
``max(the case's roofline, the kernel's fitted estimate when only the metadata program failed)``.
XLA's ragged_dot aborts the profiler on every chip (``llo_evaluator.cc:90``; XLA lowers it to a
ragged convolution fusion with an iteration skipper at group starts), so its rows are the roofline floor.
On v5e the profiler aborts on megablox's kernel and its metadata (``llo_execution_graph.cc:149``; for
the metadata "Unsupported DMA direction" in a scatter fusion; our schedule is written without gathers
for this reason). megablox's tgmm estimate falls below the MXU roofline on v6e and tpu7x (flagged not
credible): with its metadata read as zeros its kernel sees only empty groups and skips the work. On tpu7x our kernel's profiling compile runs out of VMEM
(e.g. 92 MiB of 64 at the up projection's config: in profiling mode XLA allocates the kernel's pipeline
windows outside its 52 MiB scoped limit; the same program compiles without the profiler,
``tests/test_grouped_matmul.py`` aot), so ours is the roofline floor there; the same holds for our tgmm on
tpu7x (86 MiB of 64 at its 36 MiB config). Our tgmm used to time out (> 300 s per reduced estimate, ~20 GB)
while its all-zero work-item table read as every item being its group's first and last (a d_W-block zero-fill
and store per step); with only ``COMPUTE`` stored complemented a reduced estimate takes ~15-30 s.

**Quantized experts** (``grouped_matmul_quantized``, kernel ``grouped_matmul_quant_fwd``; :data:`QUANT_CASES`): the
up projection with int8 experts and per-channel scales (w8a16) and with int4 experts, 128-column block scales
and zero points (w4a16), HF's ``[G, N, K]`` layout; ours only (tpu-inference's megablox ``gmm``, which takes
8-bit ``[G, K, N]`` experts with ``rhs_scale``, is not estimated here; the bf16 rows above are the unquantized
comparison), fitted from the same reduced problems (rhs and scales cut to the reduced output columns), bytes
with 1-byte (int8) or half-byte (int4) weights plus the f32 scales. The int8 row is estimated like the bf16 rows
(when it was added, one reduced problem on v6e took 87.2 µs of cycles against 37.3 µs of MXU roofline: the
quantized module's docstring); the int4 one took more than 150 s per reduced problem (stopped; not attempted by
the bench, ``QUANT_NOT_ESTIMABLE``: its row is the roofline floor). The kernel compiles for v5e / v6e / tpu7x at
this shape (``tests/test_grouped_matmul_quant.py``, aot).

Group sizes do not enter the model: every program is estimated statically, ours at its static bound of
``ceil(M / bm) + G - 1`` work items all computing (an upper bound; real runs skip padding items), megablox
at ``tiles_m + G - 1``. What the data changes is in each tpukernels row's ``reason`` (:func:`data_cost`:
the exact pipeline copies and MXU work of our schedule at skewed Mixtral group sizes, analytic). Bytes
``(M*K + G*K*N + M*N) * 2`` (each operand once, the minimum); FLOPs ``2*M*K*N`` (every row once).
"""

from __future__ import annotations

import importlib

from .core import Case, EstimateError, Impl, kernel_program

FAMILY = "grouped_matmul"
#: library modules whose code and tuning data the figures depend on (``vmem``: the scoped-VMEM request)
LIBRARY = ("grouped_matmul_ops", "vmem")
JAX_TILING = (512, 1024, 1024)  # tm, tk, tn
JAX_TILING_TGMM = (512, 512, 1024)
#: the rows of the two reduced problems of the fit (group sizes scaled; see the module docstring)
FIT_ROWS = (2048, 4096)
#: output columns of one reduced problem (forward), and the (K, N) of one d_W block (tgmm)
N_EST = 2048
K_EST_TGMM = 2048

_UP, _DOWN = "16384x4096 @ (8x14336x4096).T", "16384x14336 @ (8x4096x14336).T"
_KN, _TG = "16384x4096 @ 8x4096x14336", "16384x4096^T @ 16384x14336, G=8"
_FWD_V6E = ("85.4-85.8% of the MXU roofline in the static model at all three forward shapes (bm=256, bk = K, bn = "
            "3584, or 1024 at K = 14336: 63-71 MiB of VMEM under the per-chip cap of 7/8 of v6e's 128 MiB), with the "
            "rhs prefetch chain (rhs copied by hand into a 2-slot buffer a whole run of items ahead; the grid "
            "pipeline's rhs blocks, one step ahead: 84.3% at the up projection, 84.4-84.8% before the chain). The "
            "static model reads the work-item table as zeros, i.e. one group and one rhs copy per output-column pass, so what it credits the chain with is the "
            "copy at each pass change, started a pass ahead instead of one step; the copies at the G - 1 group "
            "changes per pass it sees in neither kernel. Short of 87%, the schedule's static ceiling: per pass it "
            "counts {items} work items for {tiles} row tiles (the G - 1 = 7 tiles a group boundary may split are "
            "visited twice: {waste:.2f}x the MXU work; megablox has the same, 39 items for 32 tiles of 512 rows), "
            "and a 256-row item costs 1.036x its MXU time at peak (58.0 vs 56.0 cycles per row, from the fit). "
            "bm=128 halves the boundary waste but a 128-row item costs ~1.5x its MXU time on the 256-wide MXU "
            "(62.5% estimated); bm=512 doubles it (39 items for 32 tiles). The group-change copies are what a "
            "step-by-step walk of the real schedule sees (benchmarks/grouped_matmul_configs.py, copies sharing HBM "
            "bandwidth): up / down / x @ W[g] 85.8 / 82.3 / 85.8% with the chain, 76.4 / 76.1 / 76.4% with the grid "
            "pipeline's rhs blocks (a [K, bn] block copied while one item computes, 17.9 vs 8.2 µs)")
_NO_7X = ("no estimate of ours on tpu7x: libtpu 0.0.52's profiling compile needs the kernel's scoped VMEM limit "
          "plus its blocks and scratch (92 = 52 + 38 MiB of 64 at the shipped bm=256, bk=4096, bn=2048, with the rhs "
          "prefetch chain's 2-slot buffer as with the grid pipeline's rhs blocks; 84.6 = 49 + 35 at the down "
          "projection's bm=128, bk = K, bn=512), while the same program compiles without the profiler (tests, aot): "
          "only configs under ~26 MiB of blocks could be estimated, and the best of those ranks 4-6 points lower in "
          "a step-by-step walk of the real schedule (benchmarks/grouped_matmul_configs.py; up 75.8 vs 82.2%, down "
          "74.0 vs 77.5% with the chain; 81.0 / 73.3% at the shipped configs without it). The figure is the "
          "roofline floor")
_V5E = ("v5e: no static estimate of ours (libtpu 0.0.52 takes more than 280 s per reduced problem of the forward "
        "with the rhs prefetch chain on v5e), so the figure is the roofline floor. The same blocks (bm=128, v5e's "
        "MXU is 128 wide, bk = K, bn = 3584, or 1024 at K = 14336) with the grid pipeline's rhs blocks "
        "(rhs_prefetch=False) estimated 92.5-92.7% of the MXU roofline (the schedule's static ceiling is 94.8%: "
        "135 items for 128 row tiles). A step-by-step walk of the real schedule (benchmarks/"
        "grouped_matmul_configs.py) puts the chain at 92.8% and the grid pipeline at 88.4-88.5% (each group "
        "change exposes the next [K, bn] rhs block's copy), so the chain ships. megablox and ragged_dot cannot be "
        "estimated on v5e either (libtpu aborts): their figures are roofline floors too, not evidence either way")
#: why ours is where it is, from the estimates (module docstring); keyed (chip, op, shape)
#: (kernel name, chip) -> why its estimate is not attempted (timeouts are not cached, so each run would spend
#: them again). Empty: our tgmm used to time out (> 300 s at 2048 rows, ~20 GB) while its all-zero work-item
#: table read as "first and last item of its group" (a full d_rhs-block zero-fill and store every step); with
#: only COMPUTE stored complemented its reduced estimates take ~15-30 s
NOT_ESTIMABLE: dict = {
    ("grouped_matmul_fwd", "v5e"): (
        "libtpu 0.0.52's static estimate of the forward with the rhs prefetch chain exceeds 280 s per reduced "
        "problem on v5e (bm=128, bk = K, bn = 3584; tried 2026-12-02 with benchmarks/grouped_matmul_configs.py); "
        "the same blocks with the grid pipeline's rhs blocks (rhs_prefetch=False) estimated 92.5-92.7% of the "
        "MXU roofline"),
    ("grouped_matmul_fwd", "tpu7x"): (
        "libtpu 0.0.52's profiling compile of the forward runs out of VMEM on tpu7x at every shipped config "
        "(92.00 of 63.94 MiB at bm=256, bk=4096, bn=2048 with the rhs prefetch chain, tried 2026-12-02; 84.6 at "
        "the down projection's bm=128, bk = K, bn=512), while the ordinary compile fits (tests, aot)"),
}
REASONS: dict = {
    ("v6e", "gmm x @ W[g].T", _UP): _FWD_V6E.format(items=71, tiles=64, waste=71 / 64),
    ("v6e", "gmm x @ W[g]", _KN): _FWD_V6E.format(items=71, tiles=64, waste=71 / 64),
    ("v6e", "gmm x @ W[g].T", _DOWN): _FWD_V6E.format(items=71, tiles=64, waste=71 / 64),
    ("v5e", "tgmm (d_W)", _TG): (
        "93.1% of the MXU roofline in the static model at bm=128, bk = K = 4096, bn=3584 (128/2048/2048: 89.4%; "
        "88.8% there before the body wrote d_W blocks by its own copies); its ceiling is 94.8% (135 items for 128 "
        "row tiles: a tile a group boundary splits is visited once per group), a 128-row item costs 1.017x its "
        "MXU time in the fit. megablox's tgmm cannot be estimated on v5e (libtpu aborts): no comparison"),
    ("v6e", "tgmm (d_W)", _TG): (
        "86.7% of the MXU roofline in the static model at bm=256, bk = K = 4096, bn=3584 (256/4096/2048: 84.4%, "
        "82.7% before the body wrote d_W blocks by its own copies; before that: not estimable, ~40% at bm=512, "
        "bk=512, bn=1024, which is HBM-bound: both operands are streamed every step, bk*bn/(bk+bn) = 341 FLOP/B "
        "where v6e needs 561). The static bound counts 71 items for 64 row tiles at bm=256 (ceiling 90.1%) and a "
        "256-row item costs its MXU time plus a fixed ~490 cycles per grid step (14,833 vs 14,336 cycles from "
        "the fit, 1.035x; 1.06x at bn=2048); the grid pipeline's output blocks cost ~14k cycles per 4096x2048 d_W "
        "block in the model, the body's own copies (started at a group's last item, waited for a slot later) "
        "none: the all-zero table has no last item, so the model sees no d_W writeback (nor the per-item "
        "operand copies). One d_W staging slot at bn=3584 (two do not fit the 112 MiB cap). bm=128 costs 2.1x "
        "its MXU time per item on the 256-deep MXU, bm=512 counts 39 items for 32 tiles. Feeding lhs^T instead "
        "of the transposed-LHS dot does not help in the model (a dense tgmm-like kernel estimates within 4% "
        "either way). megablox's tgmm estimate is not credible (below the roofline): no comparison"),
    ("tpu7x", "tgmm (d_W)", _TG): (
        "no estimate of ours on tpu7x: libtpu 0.0.52's profiling compile runs out of VMEM (86 MiB of 64 at bm=256, "
        "bk = bn = 2048, whose blocks need 36 MiB; 65.6 at 256/1024/2048) while the program compiles without the "
        "profiler (tests, aot): roofline floor. bk = K = 4096 (v6e's choice) needs 70 MiB, over tpu7x's 56 MiB cap"),
    **{("tpu7x", op, sh): _NO_7X for op, sh in (("gmm x @ W[g].T", _UP), ("gmm x @ W[g].T", _DOWN),
                                                 ("gmm x @ W[g]", _KN))},
    **{("v5e", op, sh): _V5E for op, sh in (("gmm x @ W[g].T", _UP), ("gmm x @ W[g].T", _DOWN),
                                             ("gmm x @ W[g]", _KN))},
}
#: realistic skewed Mixtral routing for the data-dependent analysis (8192 tokens, top-2, 8 experts)
SKEW = 1.2


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(":")[0].split("x"))


def _clock(chip):
    from ..perf import clock_hz

    return clock_hz(chip)


class _Fitted:
    """One implementation's kernel estimated at three reduced problems and extrapolated (module docstring):
    ``program(chip, rows, blocks) -> (fn, structs)`` is its kernel alone at ``rows`` rows and ``blocks``
    output blocks; ``meta(chip) -> (fn, structs) | None`` its metadata computation at the full problem.

    ``cycles = a + nb * (b + q * M)`` is fitted to the kernel's estimates at ``(M1, 1)``, ``(M2, 1)`` and
    ``(M1, 2)`` and evaluated at ``(M, nb)``; the metadata estimate is added. Where the metadata program
    cannot be estimated (libtpu aborts), the kernel's figure is kept as a floor (a lower bound)."""

    def __init__(self, program, meta, M: int, nb: int):
        self.program, self.meta, self.M, self.nb = program, meta, M, nb
        self.kernel_cycles: dict = {}  # chip -> fitted kernel cycles (for the floor)
        self.fit: dict = {}

    def kernel(self, est, chip) -> int:
        m1, m2 = FIT_ROWS
        c11 = est.cycles(*self.program(chip, m1, 1), chip)
        c21 = est.cycles(*self.program(chip, m2, 1), chip)
        c12 = est.cycles(*self.program(chip, m1, 2), chip)
        q = (c21 - c11) / (m2 - m1)
        per_block = c12 - c11 + q * (self.M - m1)
        total = (2 * c11 - c12) + self.nb * per_block
        self.fit[chip] = dict(c11=c11, c21=c21, c12=c12)
        self.kernel_cycles[chip] = int(round(total))
        return self.kernel_cycles[chip]

    def cycles(self, est, chip) -> int:
        self.kernel_cycles.pop(chip, None)
        k = self.kernel(est, chip)
        m = self.meta(chip)
        return k + (est.cycles(*m, chip) if m is not None else 0)

    def floor_us(self, roofline_us):
        def f(chip):
            k = self.kernel_cycles.get(chip)
            return max(roofline_us(chip), 0.0 if k is None else k / _clock(chip) * 1e6)

        return f


def _gm():
    import tpukernels.library  # noqa: F401

    return importlib.import_module("tpukernels.library.grouped_matmul_ops")


def ours_split(kernel, args, kwargs, cfg, chip):
    """``(kernel alone, metadata)`` programs of our kernel at ``args`` and ``cfg``: the Pallas call with the
    work-item table as its scalar-prefetch input, and the on-device schedule (``Launch.prefetch``)."""
    import dataclasses

    import jax

    from ..lowering import build_fn

    gm = _gm()
    low = _lowered(kernel, chip, args, kwargs, cfg)
    launch = low.resolved.launch
    meta_structs = list(low.arg_structs[:2])
    meta_fn = jax.jit(launch.prefetch)
    (table,) = jax.eval_shape(meta_fn, *meta_structs)
    alone = dataclasses.replace(low.resolved, launch=dataclasses.replace(launch, prefetch=None, num_scalar_prefetch=1))
    fn, _ = build_fn(kernel, alone, "mosaic")
    del gm
    return (jax.jit(fn), [jax.ShapeDtypeStruct(table.shape, table.dtype), *low.arg_structs[2:]]), (meta_fn, meta_structs)


def _lowered(kernel, chip, args, kwargs, cfg):
    from ..chips import get_chip
    from ..lowering import lower
    from ..targets import bucket_specs
    from ..targets.compile_only import example_specs

    specs, statics = example_specs(kernel, args, kwargs)
    return lower(kernel, bucket_specs(kernel, specs), statics, cfg, mode="mosaic", chip=get_chip(chip))


def _reduced_args(kernel, args, kwargs, rows: int, blocks: int, cols: int = N_EST, kdim: int = K_EST_TGMM):
    """``args`` at ``rows`` rows and ``blocks`` reduced output blocks (``cols`` columns, default N_EST; tgmm:
    ``kdim x cols``, default K_EST_TGMM x N_EST)."""
    gm = _gm()
    a = list(args)
    if kernel is gm.grouped_matmul_tgmm:
        (_, K), (_, N) = _shape(a[2]), _shape(a[3])
        a[2], a[3] = f"{rows}x{min(K, kdim)}:bf16", f"{rows}x{min(N, cols) * blocks}:bf16"
        return tuple(a)
    (_, K) = _shape(a[2])
    G, d1, d2 = _shape(a[3])
    n = min(d1 if kwargs.get("transpose_rhs") else d2, cols) * blocks
    a[2] = f"{rows}x{K}:bf16"
    a[3] = f"{G}x{n}x{d2}:bf16" if kwargs.get("transpose_rhs") else f"{G}x{d1}x{n}:bf16"
    return tuple(a)


def _blocks(M, K, N, tgmm: bool, cols: int = N_EST, kdim: int = K_EST_TGMM) -> int:
    """How many reduced output blocks (of ``cols`` columns, default N_EST; tgmm ``kdim x cols``) the full
    problem has (module docstring)."""
    nb = -(-N // min(N, cols))
    return nb * -(-K // min(K, kdim)) if tgmm else nb


def _reduced_quant_args(args, kwargs, rows: int, blocks: int, cols: int = N_EST, kdim: int = K_EST_TGMM):
    """:func:`_reduced_args` of a quantized-expert case (``gs, go, lhs, rhs, rhs_scale, rhs_zero_point``): ``rhs``,
    ``rhs_scale`` and ``rhs_zero_point`` cut to ``blocks`` reduced output blocks of ``cols`` columns."""
    a = list(args)
    tr = bool(kwargs.get("transpose_rhs"))
    _, K = _shape(a[2])
    G, d1, d2 = _shape(a[3])
    n = min(d1 if tr else d2, cols) * blocks
    wdt = a[3].split(":")[1]
    a[2] = f"{rows}x{K}:bf16"
    a[3] = f"{G}x{n}x{d2}:{wdt}" if tr else f"{G}x{d1}x{n}:{wdt}"
    nb = _shape(a[4])[1]
    a[4] = f"{G}x{nb}x1x{n}:f32"
    if len(a) > 5 and a[5] is not None:
        a[5] = a[4]
    return tuple(a)


def _ours(kernel, args, kwargs, roofline_us, chip: str, reduce=None, skip: str | None = None) -> Impl:
    """Ours on ``chip`` at the config a full-size call gets there (known before estimating, so a row whose
    estimate fails still names it). ``reduce``: the reduced-problem builder (default :func:`_reduced_args`)."""
    gm = _gm()
    tgmm = kernel is gm.grouped_matmul_tgmm
    (M, K) = _shape(args[2])
    N = _shape(args[3])[1] if tgmm else (_shape(args[3])[1] if kwargs.get("transpose_rhs") else _shape(args[3])[2])
    _, _, cfg, source = kernel_program(kernel, chip, args, kwargs)  # the config a full call gets
    state = {chip: cfg}
    # forward: a reduced block is one output block of ours when bn > N_EST (bn = 3584 does not divide 2048)
    # (tgmm: one d_W block of ours when bk > K_EST_TGMM or bn > N_EST)
    cols = max(N_EST, min(N, int(cfg.get("bn", N_EST))))
    kdim = max(K_EST_TGMM, min(K, int(cfg.get("bk", K_EST_TGMM)))) if tgmm else K_EST_TGMM

    def program(chip, rows, blocks):
        small = (reduce(args, kwargs, rows, blocks, cols, kdim) if reduce else
                 _reduced_args(kernel, args, kwargs, rows, blocks, cols, kdim))
        return ours_split(kernel, small, kwargs, state[chip], chip)[0]

    def meta(chip):
        return ours_split(kernel, args, kwargs, state[chip], chip)[1]

    fit = _Fitted(program, meta, M, _blocks(M, K, N, tgmm, cols, kdim))

    def cycles(est, chip):
        why = skip or NOT_ESTIMABLE.get((kernel.name, chip))
        if why:
            raise EstimateError(f"not attempted: {why}")
        return fit.cycles(est, chip), dict(cfg, source=source)

    return Impl("tpukernels", "ours", cycles, config=dict(cfg, source=source), floor_us=fit.floor_us(roofline_us))


# ---------------------------------------------------------------------------------------------- megablox
def _static_metadata(real, zeros: bool):
    """megablox's ``make_group_metadata`` with its grid length replaced by the static bound
    ``tiles_m + num_groups - 1`` (module docstring); ``zeros``: constant all-zero metadata (the kernel alone)."""
    import jax
    import jax.numpy as jnp

    def make_group_metadata(*, group_sizes, m, tm, start_group, num_nonzero_groups, visit_empty_groups=True):
        meta, _ = real(group_sizes=group_sizes, m=m, tm=tm, start_group=start_group,
                       num_nonzero_groups=num_nonzero_groups, visit_empty_groups=visit_empty_groups)
        bound = -(-m // tm) + num_nonzero_groups - 1
        if zeros:  # a tuple of arrays (jax's), a registered dataclass of them (tpu-inference's GroupMetadata)
            meta = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), meta)
        return meta, bound

    return make_group_metadata


def megablox_program(mb, call, structs, zeros: bool):
    """``(jitted fn, structs)``: ``call(*args)`` of megablox module ``mb`` (JAX's or tpu-inference's fork) traced with
    :func:`_static_metadata` in place of its ``make_group_metadata`` (the grid at its static bound; ``zeros``: the
    kernel alone, its metadata constant zeros). Also the MoE family's megablox columns."""
    import jax

    def fn(*a):
        real = mb.make_group_metadata
        mb.make_group_metadata = _static_metadata(real, zeros)
        try:
            return call(*a)
        finally:
            mb.make_group_metadata = real

    return jax.jit(fn), structs


def tpu_inference_tiling(M: int, K: int, N: int, G: int) -> tuple[int, int, int]:
    """``(tm, tk, tn)`` tpu-inference 0.32.0's megablox ``gmm`` takes for bf16 ``[M, K] @ [G, K, N]`` with ``tiling=None``:
    its tuned table's entry, else its ``get_default_gmm_block_sizes`` (read here without the vllm logger's warning,
    which imports vllm's distributed stack)."""
    from .._imports import import_tpu_inference

    T = import_tpu_inference("kernels.megablox.tuned_block_sizes", "megablox gmm")

    key = (M, K, N, G, G, "bfloat16", "bfloat16", K)
    return tuple(T.TUNED_BLOCK_SIZES.get(key) or T.get_default_gmm_block_sizes(M, K, N, G))


def _megablox(M, K, N, G, tgmm: bool, tr: bool, roofline_us, peer: str = "jax") -> Impl:
    """megablox's ``gmm`` / ``tgmm``: JAX's (``peer="jax"``, at :data:`JAX_TILING`) or tpu-inference 0.32.0's fork
    (``peer="tpu-inference"``: ``gmm`` only, at :func:`tpu_inference_tiling`; it has no ``transpose_rhs``, so the
    ``W[g].T`` rows give it the weights pre-transposed to ``[G, K, N]``, the transpose not counted, in its favour)."""
    import jax
    import jax.numpy as jnp

    bf16, i32 = jnp.bfloat16, jnp.int32
    S = jax.ShapeDtypeStruct
    sg = S((G,), i32)
    Ke, Ne = (min(K, K_EST_TGMM) if tgmm else K), min(N, N_EST)
    ti = peer == "tpu-inference"
    if ti and tgmm:
        raise ValueError("tpu-inference's megablox fork has no tgmm")

    def module():
        if not ti:
            return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
        from .._imports import import_tpu_inference

        return import_tpu_inference("kernels.megablox.gmm", "megablox gmm")

    if tgmm:
        tm, tk, tn = (min(b, d) for b, d in zip(JAX_TILING_TGMM, (M, Ke, Ne)))
        tiling = lambda: (tm, tk, tn)  # noqa: E731
        config = f"tiling={tm},{tk},{tn}"

        def call(mb, x, y, gs):
            return mb.tgmm(x.T, y, gs, preferred_element_type=bf16, tiling=tiling())

        def structs(rows, blocks):
            return [S((rows, Ke), bf16), S((rows, Ne * blocks), bf16), sg]
    else:
        if ti:
            def tiling():  # its choice at the full problem, clamped to a reduced problem's columns
                return tuple(min(b, d) for b, d in zip(tpu_inference_tiling(M, K, N, G), (M, K, Ne)))

            config = None  # known once tpu-inference imports: returned with the estimate
        else:
            tm, tk, tn = (min(b, d) for b, d in zip(JAX_TILING, (M, K, Ne)))
            tiling = lambda: (tm, tk, tn)  # noqa: E731
            config = f"tiling={tm},{tk},{tn}" + (",transpose_rhs" if tr else "")
        kn = tr and not ti  # the weights as the kernel reads them: [G, N, K] (transpose_rhs) or [G, K, N]

        def call(mb, x, w, gs):
            if ti:
                return mb.gmm(x, w, gs, preferred_element_type=bf16, tiling=tiling())
            return mb.gmm(x, w, gs, preferred_element_type=bf16, tiling=tiling(), transpose_rhs=tr)

        def structs(rows, blocks):
            n = Ne * blocks
            return [S((rows, K), bf16), S((G, n, K) if kn else (G, K, n), bf16), sg]

    def program(chip, rows, blocks):
        mb = module()
        return megablox_program(mb, lambda *a: call(mb, *a), structs(rows, blocks), zeros=True)

    def meta(chip):
        real = module().make_group_metadata
        # its arrays as a tuple (jax.export cannot serialize tpu-inference's GroupMetadata dataclass)
        fn = jax.jit(lambda gs: tuple(jax.tree.leaves(real(
            group_sizes=gs, m=M, tm=tiling()[0], start_group=jnp.zeros((), i32), num_nonzero_groups=G,
            visit_empty_groups=tgmm)[0])))
        return fn, [sg]

    fit = _Fitted(program, meta, M, _blocks(M, K, N, tgmm))
    name = ("tpu-inference megablox gmm" if ti else
            "jax megablox tgmm" if tgmm else "jax megablox gmm")

    def cycles(est, chip):
        c = fit.cycles(est, chip)
        if not ti:
            return c, None
        tm, tk, tn = tpu_inference_tiling(M, K, N, G)
        return c, f"tiling={tm},{tk},{tn}" + (",rhs pre-transposed to [G, K, N] (not counted)" if tr else "")

    return Impl(name, "public", cycles, config=config, floor_us=fit.floor_us(roofline_us))


# --------------------------------------------------------------------------------------------------- xla
def _xla(M, K, N, G, tgmm: bool, roofline_us) -> Impl:
    import jax
    import jax.numpy as jnp

    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    S = jax.ShapeDtypeStruct
    sg = S((G,), i32)
    Ke, Ne = (min(K, K_EST_TGMM) if tgmm else K), min(N, N_EST)
    if tgmm:
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        fn = jax.jit(lambda x, y, gs: jax.lax.ragged_dot_general(x, y, gs, dims, preferred_element_type=f32).astype(bf16))

        def structs(rows, blocks):
            return [S((rows, Ke), bf16), S((rows, Ne * blocks), bf16), sg]
    else:
        fn = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=f32).astype(bf16))

        def structs(rows, blocks):
            return [S((rows, K), bf16), S((G, K, Ne * blocks), bf16), sg]

    fit = _Fitted(lambda chip, rows, blocks: (fn, structs(rows, blocks)), lambda chip: None, M, _blocks(M, K, N, tgmm))
    return Impl("xla ragged_dot", "xla", lambda est, chip: (fit.cycles(est, chip), None), config="XLA fusion",
                floor_us=fit.floor_us(roofline_us))


def cases(chips) -> list[Case]:
    from ..perf import model_time

    gm = _gm()
    out = []
    for kernel, args, kwargs in gm.STANDARD_CASES:
        G = _shape(args[0])[0]
        tgmm = kernel is gm.grouped_matmul_tgmm
        M, K = _shape(args[2])
        if tgmm:
            N = _shape(args[3])[1]
            op, shape, tr = "tgmm (d_W)", f"{M}x{K}^T @ {M}x{N}, G={G}", False
        else:
            tr = bool(kwargs.get("transpose_rhs"))
            _, d1, d2 = _shape(args[3])
            N = d1 if tr else d2
            op = "gmm x @ W[g].T" if tr else "gmm x @ W[g]"
            shape = f"{M}x{K} @ ({G}x{N}x{K}).T" if tr else f"{M}x{K} @ {G}x{K}x{N}"
        hbm, flops = (M * K + G * K * N + M * N) * 2, 2 * M * K * N

        def roofline_us(chip, hbm=hbm, flops=flops):
            return model_time(chip, None, hbm, flops, "bfloat16").roofline_us

        others = [_xla(M, K, N, G, tgmm, roofline_us), _megablox(M, K, N, G, tgmm, tr, roofline_us)]
        if not tgmm:  # tpu-inference's megablox has no tgmm (an inference library)
            others.append(_megablox(M, K, N, G, tgmm, tr, roofline_us, peer="tpu-inference"))
        for chip in chips:
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=flops,
                            impls=[_ours(kernel, args, kwargs, roofline_us, chip), *others]))
    return out + quant_cases(chips)


_R = 16384
#: quantized-expert rows (module docstring): (op, kernel args, weight bytes per element), Mixtral up projection
QUANT_CASES = [
    ("gmm w8a16 int8 x @ W[g].T, per-channel scales",
     ("8:i32", "1:i32", f"{_R}x4096:bf16", "8x14336x4096:i8", "8x1x1x14336:f32", None), 1.0),
    ("gmm w4a16 int4 x @ W[g].T, block 128 + zero points",
     ("8:i32", "1:i32", f"{_R}x4096:bf16", "8x14336x2048:u8", "8x32x1x14336:f32", "8x32x1x14336:f32"), 0.5),
]
#: quantized rows whose estimate is not attempted (op -> why; timeouts are not cached, so each run would spend them)
QUANT_NOT_ESTIMABLE = {
    QUANT_CASES[1][0]: ("libtpu 0.0.52's static estimate of one reduced problem (2048 rows, one 2048-column block, "
                        "bm=256, bk=4096, bn=1024) exceeded 150 s on v6e (tried 2026-12-03): the per-block int4 "
                        "unpack and half-width dots; the figure is the roofline floor"),
}


def quant_cases(chips) -> list[Case]:
    """The :data:`QUANT_CASES` rows on ``chips`` (ours only, fitted from reduced problems)."""
    from ..perf import model_time

    _gm()  # registers the library
    kernel = importlib.import_module("tpukernels.library.grouped_matmul_ops.quant").grouped_matmul_quant_fwd
    kwargs = {"transpose_rhs": True}
    out = []
    for op, args, wb in QUANT_CASES:
        G, nb = _shape(args[4])[0], _shape(args[4])[1]
        M, K = _shape(args[2])
        N = _shape(args[3])[1]
        shape = f"{M}x{K} @ ({G}x{N}x{K}).T"
        scales = G * nb * N * 4 * (1 + (args[5] is not None))
        hbm, flops = int(M * K * 2 + G * K * N * wb + scales + M * N * 2), 2 * M * K * N

        def roofline_us(chip, hbm=hbm, flops=flops):
            return model_time(chip, None, hbm, flops, "bfloat16").roofline_us

        for chip in chips:
            out.append(Case(FAMILY, op, shape, chip, hbm_bytes=hbm, flops=flops,
                            impls=[_ours(kernel, args, kwargs, roofline_us, chip, reduce=_reduced_quant_args,
                                         skip=QUANT_NOT_ESTIMABLE.get(op))]))
    return out


def data_cost(kernel_name: str, M: int, K: int, N: int, sizes, config: dict, transpose_rhs: bool = False) -> dict:
    """What the static model cannot see, computed exactly for one set of group sizes (analytic, not a
    measurement): the Pallas pipeline's HBM bytes (a block is copied whenever its index differs from the
    previous grid step's, walked over the real schedule) and the MXU FLOPs of the work items that compute.

    Returns ``{"hbm_bytes", "mxu_flops", "items", "computing_items"}``.
    """
    import jax.numpy as jnp
    import numpy as np

    gm = importlib.import_module("tpukernels.library.grouped_matmul_ops")
    G = len(sizes)
    bm, bk, bn = (gm.clamp(d, config[b]) for d, b in ((M, "bm"), (K, "bk"), (N, "bn")))
    T = gm.num_items(M, G, bm)
    sched = gm.fwd_schedule if kernel_name.endswith("fwd") else gm.tgmm_schedule
    (tab,) = sched(jnp.asarray(sizes, jnp.int32), jnp.zeros(1, jnp.int32), M=M, G=G, bm=bm, T=T)
    tab = np.asarray(tab).reshape(gm.N_FIELDS_FWD if kernel_name.endswith("fwd") else gm.N_FIELDS, T)
    flags = tab[gm.F_FLAGS] ^ (gm.ALL if kernel_name.endswith("fwd") else gm.TGMM_COMPLEMENT)
    compute = (flags & gm.COMPUTE) != 0
    gk, gn = -(-K // bk), -(-N // bn)
    prev, nbytes = {}, 0

    def visit(name, idx, blk_bytes):
        nonlocal nbytes
        if prev.get(name) != idx:
            nbytes += blk_bytes
            prev[name] = idx

    if kernel_name.endswith("fwd"):
        for n in range(gn):
            for i in range(T):
                for k in range(gk):
                    ke = k if compute[i] else gk - 1
                    visit("lhs", (tab[gm.F_SRC_TILE, i], ke), bm * bk * 2)
                    visit("rhs", (tab[gm.F_GROUP, i], ke, n), bk * bn * 2)
                    visit("out", (tab[gm.F_TILE, i], n), bm * bn * 2)
        flops = int(compute.sum()) * gn * gk * 2 * bm * bk * bn
    else:  # tgmm: grid (K/bk, N/bn, T); x [M, K], y [M, N], out [G, K, N]
        for kk in range(gk):
            for n in range(gn):
                for i in range(T):
                    visit("x", (tab[gm.F_SRC_TILE, i], kk), bm * bk * 2)
                    visit("y", (tab[gm.F_SRC_TILE, i], n), bm * bn * 2)
                    visit("out", (tab[gm.F_GROUP, i], kk, n), bk * bn * 2)
        flops = int(compute.sum()) * gn * gk * 2 * bm * bk * bn
    return {"hbm_bytes": int(nbytes), "mxu_flops": flops, "items": T, "computing_items": int(compute.sum())}


def _parse_config(text: str) -> dict:
    out = {}
    for kv in (text or "").split(","):
        k, _, v = kv.partition("=")
        if k in ("bm", "bk", "bn"):
            out[k] = int(v)
    return out


def reason(row: dict) -> str | None:
    """For tpukernels rows: why the figure is what it is (``REASONS``, from the estimates) and the
    data-dependent cost at skewed Mixtral group sizes (analytic, exact schedule)."""
    if row.get("kind") != "ours":
        return None
    parts = [REASONS.get((row["chip"], row["op"], row["shape"]))]
    if row.get("model_us") is not None and not any(q in row["op"] for q in ("w8a16", "w4a16")):
        parts.append(_analytic(row))  # the bf16 kernels' schedule model (quantized rows: bytes differ)
    return ". ".join(p for p in parts if p) or None


def _analytic(row: dict) -> str | None:
    from ..perf import hbm_bandwidth, peak_flops

    gm = importlib.import_module("tpukernels.library.grouped_matmul_ops")
    cfg = _parse_config(row.get("config", ""))
    if set(cfg) != {"bm", "bk", "bn"}:
        return None
    mx = gm.MIXTRAL
    sizes = gm.skewed_group_sizes(mx["tokens"], mx["top_k"], mx["experts"], SKEW)
    M, K, N = _dims(row)
    name = "tgmm" if row["op"].startswith("tgmm") else "fwd"
    c = data_cost(name, M, K, N, sizes, cfg, transpose_rhs="T" in row["op"])
    mem_us = c["hbm_bytes"] / hbm_bandwidth(row["chip"]) * 1e6
    mxu_us = c["mxu_flops"] / peak_flops(row["chip"]) * 1e6
    return (f"analytic at skewed group sizes {sizes}: {c['computing_items']}/{c['items']} work items compute, "
            f"MXU work {c['mxu_flops'] / row['flops']:.2f}x the ideal ({mxu_us:,.0f} µs at peak), pipeline copies "
            f"{c['hbm_bytes'] / 1e9:.2f} GB ({mem_us:,.0f} µs at HBM bandwidth): the static model sees neither")


def _dims(row: dict) -> tuple[int, int, int]:
    """(M, K, N) of a row from its shape text."""
    import re

    nums = [int(x) for x in re.findall(r"\d+", row["shape"])]
    if row["op"].startswith("tgmm"):  # "MxK^T @ MxN, G=g"
        return nums[0], nums[1], nums[3]
    if "W[g].T" in row["op"]:  # "MxK @ (GxNxK).T"
        return nums[0], nums[1], nums[3]
    return nums[0], nums[1], nums[4]  # "MxK @ GxKxN"
