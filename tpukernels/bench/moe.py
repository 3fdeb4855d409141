"""MoE layer family: one routed-expert MoE block (router, permute, gate/up grouped matmul, gated activation, down
grouped matmul, combine), forward, bf16, at the expert shapes of three current MoE models, decode and prefill.

Models (:data:`MODELS`, the routed experts only; shared experts and the router's own linear are not counted):

* ``Qwen3-30B-A3B``: hidden 2048, expert intermediate 768, 128 experts, top-8, softmax, renormalised, SiLU;
* ``gpt-oss-120b``: hidden 2880, intermediate 2880, 128 experts, top-4, softmax over the selected (= softmax then
  renormalise), gate/up bias and interleaved fused gate/up (HF's layout), clamped SwiGLU (``swigluoai``), down bias;
* ``DeepSeek-V3``: hidden 7168, intermediate 2048, 256 experts, top-8, sigmoid with the correction bias and grouped
  top-k (8 groups, top-4 groups), renormalised, SiLU.

Phases (:data:`PHASES`): decode at 64 and 256 tokens, prefill at 8192 tokens.

Implementations:

* ``tpukernels``: what :func:`tpukernels.fused_moe_jax` runs (the torch ``fused_moe`` runs the same kernels): the
  router kernel (``router_topk_fwd``), the permute gather (``moe_gather_fwd``), the gate/up ``grouped_matmul_fwd``
  (float32 accumulation, bf16 out) with its on-device schedule, the activation (``gated_activation_fwd`` reading the gate/up output's
  halves in place, h written in bf16; gpt-oss's clamped SwiGLU in jnp on the interleaved columns), the down
  ``grouped_matmul_fwd`` with its schedule, the weighted combine (``moe_scatter_add_fwd`` where its float32
  accumulator fits the chip's VMEM, else ``moe_gather_reduce_fwd``: :func:`scatter_combine`), and the XLA ops
  between them (:func:`ours_xla_glue`: the sort of the expert ids, the positions and group sizes, gpt-oss's split
  and activation). Each kernel at the config a full-size call gets on the chip.
* ``jax megablox + xla routing``: the unfused MoE a JAX or torch user writes around JAX's megablox ``gmm``: routing,
  permute, activation and combine in XLA (:func:`xla_moe_glue`: softmax / sigmoid, ``lax.top_k``, a stable argsort,
  gathers, a weighted sum) and megablox ``gmm`` (tiling ``(512, 1024, 1024)`` clamped to the shape,
  ``transpose_rhs=True``, bf16 out, in its favour) for both projections, plus its ``make_group_metadata``.
* ``tpu-inference fused_moe v1``: tpu-inference 0.32.0's fused kernel (``kernels/fused_moe/v1``, ``fused_ep_moe``).
  It exports for a TPU target (on a 1 x 1 abstract mesh), but libtpu 0.0.52 cannot estimate it on any chip (v6e and
  tpu7x: the LLO type check, "Expected vector-bf16packed, got vector-int32"; v5e: "Unsupported DMA direction"; tried
  2026-12-07), so it is not attempted (each attempt logs the whole program) and its row is the roofline floor.

**Grouped matmuls: a fit in work items.** libtpu's static profiler reads the work-item table as zeros, so it costs a
grouped matmul as its static bound of work items (ours ``ceil(M / bm) + G - 1`` per output-column block, megablox
``tiles_m + G - 1``), each a full ``[bm, K] x [K, bn]`` step. At 128 or 256 experts that grid is too large to
estimate directly (ours at 8 row tiles and 32 groups took 195 s on v6e), but the estimate is linear in the items: at
8 row tiles of 512 rows, K 2048, bn 1024 on v6e, 15 / 23 / 39 items (8 / 16 / 32 groups) estimate 82,453 / 119,437
/ 193,419 cycles, 4,623 and 4,624 cycles per item, and two column blocks at 8 groups 152,070 (the fit: 151,805).
So each grouped matmul is estimated at two reduced problems, 8 row tiles with ``G = 8`` and ``G = 16`` groups and
one output-column block (:func:`column_blocks`: the whole width, or half of it, where the block is ragged), by
:class:`ItemFit`, and evaluated at the full problem's items times its column blocks, at the config the full call
gets (``bm`` clamped to the rows); the schedule program (ours) or ``make_group_metadata`` (megablox) is estimated at
the full problem and added.

**The row-DMA kernels** (the permute gather and the gather-reduce combine) are estimated whole up to 32 MiB of row
copies (:data:`FIT_BYTES`), or where their source is resident in VMEM (no copies), and above that fitted in tokens
from two reduced problems (:func:`row_copy_cycles`): libtpu 0.0.52's tpu7x profiler costs a kernel copying more
than 64 MiB at ~1,000x. Any program estimated at more than
:data:`NOT_CREDIBLE_ROOFLINES` times the whole layer's roofline is left out as a profiler fault, and the row is then
a floor: the sum of the programs that were estimated (so is a row where a program cannot be estimated at all).

What the static model sees at decode: every one of the ``G`` experts' weights read once per column block (all items
compute); with 64 x 8 = 512 token slots over 128 experts about 126 experts are hit, so this is close to what a real
decode step moves. Neither kernel's skipping of empty groups is modelled.

Bytes (the roofline): tokens in and out, the router logits, and the weights (and biases) of the experts a uniform
router is expected to hit, ``E * (1 - (1 - k / E) ** T)``; FLOPs ``2 * T * k * 3 * H * I``. The figures are a
model (libtpu 0.0.52's static estimate on CPU), not measurements.
"""

from __future__ import annotations

import dataclasses
import importlib

from .core import Case, EstimateError, Impl, kernel_program

FAMILY = "moe"
#: library modules whose code and tuning data the figures depend on
LIBRARY = ("fused_moe_ops", "moe_routing", "grouped_matmul_ops", "gated_mlp", "vmem")
#: other families' bench modules this one is built from (megablox and our grouped matmul's programs)
BENCH = ("grouped_matmul",)
#: megablox's tiling (tm, tk, tn), clamped to the shape: the grouped_matmul family's
JAX_TILING = (512, 1024, 1024)
#: groups of the two reduced problems of :class:`ItemFit`, and their row tiles
FIT_GROUPS = (8, 16)
FIT_TILES = 8
#: gpt-oss's clamped SwiGLU constants (transformers' and tpu-inference's defaults, fused_moe's)
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


@dataclasses.dataclass(frozen=True)
class MoEModel:
    """One model's routed-expert MoE block: ``H`` hidden, ``I`` expert intermediate size, ``E`` experts, ``k`` top-k;
    ``router``: ``"softmax"`` or ``"grouped"`` (DeepSeek: sigmoid + correction bias, ``n_group`` / ``topk_group``);
    ``act``: ``"silu"`` or ``"swigluoai"``; ``bias``: gate/up and down biases; ``interleaved``: gate/up interleaved."""

    name: str
    H: int
    I: int  # noqa: E741  (the field's name)
    E: int
    k: int
    router: str = "softmax"
    act: str = "silu"
    bias: bool = False
    interleaved: bool = False
    n_group: int = 1
    topk_group: int = 1
    logits_dtype: str = "bf16"

    @property
    def label(self) -> str:
        return f"{self.name} MoE (H{self.H} I{self.I} E{self.E} k{self.k})"


MODELS = (
    MoEModel("Qwen3-30B-A3B", H=2048, I=768, E=128, k=8),
    MoEModel("gpt-oss-120b", H=2880, I=2880, E=128, k=4, act="swigluoai", bias=True, interleaved=True),
    MoEModel("DeepSeek-V3", H=7168, I=2048, E=256, k=8, router="grouped", n_group=8, topk_group=4,
             logits_dtype="f32"),
)
PHASES = (("decode", 64), ("decode", 256), ("prefill", 8192))
_TPU_INFERENCE_WHY = (
    "not attempted: libtpu 0.0.52 cannot estimate tpu-inference 0.32.0's fused_ep_moe on any chip (it exports on a "
    "1 x 1 abstract mesh; v6e and tpu7x fail the LLO type check, \"Expected vector-bf16packed, got vector-int32\", "
    "v5e \"Unsupported DMA direction: 10 on VL/VLP\"; tried 2026-12-07, each attempt logging the whole program)")
_QWEN3 = MODELS[0].label
#: why ours is where it is, from the estimates (per-program breakdown by :func:`layer_kernels` and the fits); keyed
#: (chip, op, shape)
REASONS: dict = {
    ("v6e", _QWEN3, "prefill T=8192"): (
        "ahead of megablox with XLA routing in the model (2,237 vs 3,064 µs): our grouped matmuls gate/up 811 + down "
        "472 µs (bf16 out, at the shipped table's nearest entry that bf16 out keys, bm=256) vs its 1,773 + 600 at "
        "tm=512, schedules included; the rest of our layer models 954 µs against XLA's 687 for the same routing, "
        "permute, activation and combine: router kernel 76, permute gather 229 (the 8,192 tokens resident in VMEM, one "
        "row load each), activation kernel 125, combine 455 (the scatter-add: the 65,536 expert outputs read once, in "
        "order, into a float32 VMEM accumulator), XLA ops 69 (the stable argsort of the expert ids, the positions by a "
        "second sort and the group sizes by a fused count, the weights in expert order). Taken this round (3,979 -> "
        "2,237 µs): the resident gather (was 1,030 µs: 65,536 row DMAs of 4 KiB, ~28 cycles each in libtpu's model), "
        "the scatter-add combine (was 1,174: the gather-reduce's row DMAs) and the positions and group sizes without "
        "XLA scatters (XLA ops 293 -> 69; the peer's glue gets the same forms, 942 -> 687); the round before (4,864 -> "
        "3,979) the activation reading the gate/up halves in place and bf16 intermediates. libtpu estimates XLA's own "
        "gather under the time its bytes need at HBM bandwidth (14 vs 41 µs at 8,192 rows), so the peer's glue may cost"
        " more on a TPU than modelled. Not taken: the gather fused into the gate/up matmul and the combine into the "
        "down matmul (tpu-inference's fused kernel)"),
}
_V5E = ("v5e: no estimate of either layer: libtpu 0.0.52 aborts on the XLA programs of both (llo_execution_graph.cc:"
        "149; with the positions' and group sizes' scatters replaced by a sort and a fused count, which alone "
        "estimate at 93 µs, the rest of these programs still aborts) and, at gpt-oss's rows, on our combine and "
        "megablox's kernel; the figures are floors (ours: the sum of the programs it could estimate), not a comparison")
_TPU7X_QWEN3 = ("tpu7x: our down projection's grouped matmul (K = 768, the rhs prefetch chain) aborts libtpu 0.0.52's "
                "profiler (fifo_tracker.cc:436: at the float32-out heuristic config bm=256, bn=1024, bm=512 too, and at "
                "the shipped table's nearest entry that bf16 out now gets); the same kernel with the grid pipeline's "
                "rhs blocks estimates (61,055 cycles at 8 groups, two column blocks), so the figure is a floor: the "
                "sum of the other programs")
_DSV3 = MODELS[2].label
_TPU7X_DSV3 = ("tpu7x: our gate/up grouped matmul at the config bf16 out gets, the shipped tpu7x table's nearest "
               "entry (bm=128, bk=16384, bn=512, the rhs prefetch chain), aborts libtpu 0.0.52's profiler "
               "(fifo_tracker.cc:436; float32 out at that config too, while the grid pipeline's rhs blocks estimate: "
               "50,777 cycles at 8 groups), so the figure is a floor: the sum of the other programs. With float32 "
               "out (before bf16 intermediates: the heuristic's bm=256, bk=1024, bn=1024) the layer estimated 7,927 / "
               "8,169 / 18,055 µs (decode 64 / 256, prefill), 1.67x / 1.66x / 1.31x faster than megablox with XLA "
               "routing")


def _jdt(name: str):
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "f32": jnp.float32}[name]


def touched_experts(m: MoEModel, T: int) -> float:
    """Experts a uniform top-k router is expected to hit with ``T`` tokens: ``E * (1 - (1 - k / E) ** T)``."""
    return m.E * (1.0 - (1.0 - m.k / m.E) ** T)


def hbm_and_flops(m: MoEModel, T: int) -> tuple[int, int]:
    """``(bytes, FLOPs)`` of the layer (module docstring): tokens in / out, logits, the hit experts' weights."""
    lb = 4 if m.logits_dtype == "f32" else 2
    per_expert = 3 * m.H * m.I * 2 + ((2 * m.I + m.H) * 2 if m.bias else 0)
    hbm = 2 * T * m.H * 2 + T * m.E * lb + touched_experts(m, T) * per_expert
    return int(hbm), 2 * T * m.k * 3 * m.H * m.I


# ------------------------------------------------------------------------------------------ the item fit
class ItemFit:
    """A grouped matmul's static estimate fitted in work items (module docstring).

    ``program(chip, G) -> (fn, structs)``: the kernel alone at :data:`FIT_TILES` row tiles, ``G`` groups and one
    output-column block; ``items(G)``: that problem's work items; ``full_items``: the full problem's items per
    column block, ``nb`` its column blocks; ``meta(chip) -> (fn, structs)``: the schedule at the full problem.
    ``cycles = a + c * nb * full_items + meta``, with ``a`` and ``c`` from the two reduced estimates."""

    def __init__(self, program, items, full_items: int, nb: int, meta):
        self.program, self.items, self.full_items, self.nb, self.meta = program, items, full_items, nb, meta

    def cycles(self, est, chip: str) -> int:
        g1, g2 = FIT_GROUPS
        c1 = est.cycles(*self.program(chip, g1), chip)
        c2 = est.cycles(*self.program(chip, g2), chip)
        i1, i2 = self.items(g1), self.items(g2)
        per = (c2 - c1) / (i2 - i1)
        kernel = (c1 - per * i1) + per * self.nb * self.full_items
        return int(round(kernel)) + est.cycles(*self.meta(chip), chip)


def _gm():
    import tpukernels.library  # noqa: F401  (registers the library)

    return importlib.import_module("tpukernels.library.grouped_matmul_ops")


def _mm_dims(m: MoEModel, T: int, which: str) -> tuple[int, int, int]:
    """``(M, K, N)`` of the gate/up (``"up"``) or down projection."""
    return (T * m.k, m.H, 2 * m.I) if which == "up" else (T * m.k, m.I, m.H)


def column_blocks(N: int, bn: int) -> tuple[int, int]:
    """``(columns of a reduced problem, how many of them make N)``: one ``bn`` block where ``bn`` divides N; else
    (a ragged last block) the whole width, or half of it where each half holds a full block and the two have as
    many blocks as the whole (the whole 5760 columns of gpt-oss's gate/up projection abort libtpu 0.0.52's
    profiler, ``llo_execution_graph.cc:46``, for ours and megablox alike; its halves have 2 full blocks and a
    ragged one each, the whole 5 and a ragged one)."""
    if N % bn == 0:
        return bn, N // bn
    if N % 2 == 0 and N // 2 >= bn and 2 * -(-(N // 2) // bn) == -(-N // bn):
        return N // 2, 2
    return N, 1


def _mm_args(m: MoEModel, G: int, rows: int, K: int, N: int, bias: bool):
    return (f"{G}:i32", "1:i32", f"{rows}x{K}:bf16", f"{G}x{N}x{K}:bf16", f"{G}x1x{N}:bf16" if bias else None)


_MM_KW = {"transpose_rhs": True, "out_dtype": "bfloat16"}  # fused_moe: bf16 tokens, outputs in their dtype


def ours_grouped_matmul(m: MoEModel, T: int, which: str, chip: str) -> tuple[ItemFit, dict]:
    """Our ``grouped_matmul_fwd`` of one projection as :func:`fused_moe_jax` calls it (HF's ``[E, N, K]`` weights,
    ``transpose_rhs``, bf16 out (float32 accumulation), the model's bias), at the config a full call gets on ``chip``:
    ``(ItemFit, config)``."""
    from .grouped_matmul import ours_split

    gm = _gm()
    kernel = gm.grouped_matmul_fwd
    M, K, N = _mm_dims(m, T, which)
    full = _mm_args(m, m.E, M, K, N, m.bias)
    _, _, cfg, source = kernel_program(kernel, chip, full, _MM_KW)
    bm, bn = gm.clamp(M, cfg["bm"]), gm.clamp(N, cfg["bn"])
    cfg_r = dict(cfg, bm=bm)
    n_red, nb = column_blocks(N, bn)

    def program(chip_, G):
        return ours_split(kernel, _mm_args(m, G, FIT_TILES * bm, K, n_red, m.bias), _MM_KW, cfg_r, chip_)[0]

    fit = ItemFit(program, lambda G: gm.num_items(FIT_TILES * bm, G, bm), gm.num_items(M, m.E, bm), nb,
                  lambda chip_: ours_split(kernel, full, _MM_KW, cfg, chip_)[1])
    return fit, dict(cfg, source=source)


def megablox_grouped_matmul(m: MoEModel, T: int, which: str) -> tuple[ItemFit, str]:
    """JAX megablox ``gmm`` of one projection (bf16 out, ``transpose_rhs``, no bias: the caller adds it in XLA),
    at :data:`JAX_TILING` clamped to the shape: ``(ItemFit, config text)``."""
    import jax
    import jax.numpy as jnp

    from .grouped_matmul import megablox_program

    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    S = jax.ShapeDtypeStruct
    M, K, N = _mm_dims(m, T, which)
    tm, tk, tn = (min(b, d) for b, d in zip(JAX_TILING, (M, K, N)))
    n_red, nb = column_blocks(N, tn)

    def call(x, w, gs):
        return mb.gmm(x, w, gs, preferred_element_type=jnp.bfloat16, tiling=(tm, tk, tn), transpose_rhs=True)

    def program(chip, G):
        structs = [S((FIT_TILES * tm, K), jnp.bfloat16), S((G, n_red, K), jnp.bfloat16), S((G,), jnp.int32)]
        return megablox_program(mb, call, structs, zeros=True)

    def meta(chip):
        fn = jax.jit(lambda gs: tuple(jax.tree.leaves(mb.make_group_metadata(
            group_sizes=gs, m=M, tm=tm, start_group=jnp.zeros((), jnp.int32), num_nonzero_groups=m.E,
            visit_empty_groups=False)[0])))
        return fn, [S((m.E,), jnp.int32)]

    fit = ItemFit(program, lambda G: FIT_TILES + G - 1, -(-M // tm) + m.E - 1, nb, meta)
    return fit, f"tiling={tm},{tk},{tn},transpose_rhs"


# ------------------------------------------------------------------------------------------- the glue
def _reads_halves(m: MoEModel) -> bool:
    """:func:`fused_moe_jax` reads the model's one fused gate/up output in place (``fused_moe_ops.reads_halves``)."""
    from ..library.fused_moe_ops import reads_halves

    return reads_halves(1, m.I, m.interleaved)


def ours_xla_glue(m: MoEModel, T: int, scatter: bool = False):
    """``(fn, structs)``: the XLA ops :func:`fused_moe_jax` runs between its kernels (``moe_permute_jax``'s stable
    argsort, positions and group sizes; the router output's ``[:, :k]`` slices; with ``scatter`` (the scatter-add
    combine) the weights in expert order; the gate/up split unless the activation kernel reads the halves in place;
    gpt-oss's clamped SwiGLU in float32), on the kernels' output shapes (bf16 tokens: the matmuls write bf16, the
    combine writes the output, so no cast)."""
    import jax
    import jax.numpy as jnp

    from ..library.fused_moe_ops import split_gate_up, swigluoai_jnp
    from ..library.moe_routing.common import padded_k
    from ..library.moe_routing.permute_ops import count_ids, inverse_permutation

    S = jax.ShapeDtypeStruct
    f32, i32, bf16 = jnp.float32, jnp.int32, jnp.bfloat16
    k, M, kp = m.k, T * m.k, padded_k(m.k)

    def fn(wp, ip, gate_up):
        w, ids = wp[:, :k], ip[:, :k]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True).astype(i32)
        positions, sizes = inverse_permutation(order), count_ids(flat, m.E)
        routing = (w, order // k, positions, sizes) + ((w.reshape(-1)[order],) if scatter else ())
        if m.act != "swigluoai" and _reads_halves(m):  # the activation kernel reads gate_up in place
            return routing
        gate, up = split_gate_up([gate_up], m.I, m.interleaved)
        if m.act == "swigluoai":
            h = swigluoai_jnp(gate.astype(f32), up.astype(f32), SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT).astype(bf16)
            return *routing, h
        return *routing, gate, up

    structs = [S((T, kp), f32), S((T, kp), i32), S((M, 2 * m.I), bf16)]
    return jax.jit(fn), structs


def _jnp_route(m: MoEModel, logits, bias):
    """(weights f32, ids) of the model's router in jnp (``lax.top_k``; DeepSeek's grouped top-k as in transformers)."""
    import jax
    import jax.numpy as jnp

    x = logits.astype(jnp.float32)
    if m.router == "softmax":
        w, ids = jax.lax.top_k(jax.nn.softmax(x, -1), m.k)
        return w / jnp.sum(w, -1, keepdims=True), ids
    s = jax.nn.sigmoid(x)
    sc = s + bias[None, :]
    T = x.shape[0]
    g = sc.reshape(T, m.n_group, m.E // m.n_group)
    gscore = jnp.sum(jax.lax.top_k(g, 2)[0], -1)
    _, gidx = jax.lax.top_k(gscore, m.topk_group)
    gmask = jnp.zeros((T, m.n_group), jnp.bool_).at[jnp.arange(T)[:, None], gidx].set(True)
    masked = jnp.where(jnp.repeat(gmask, m.E // m.n_group, -1), sc, 0.0)
    _, ids = jax.lax.top_k(masked, m.k)
    w = jnp.take_along_axis(s, ids, -1)
    return w / jnp.sum(w, -1, keepdims=True) * 2.5, ids  # routed_scaling_factor 2.5


def xla_moe_glue(m: MoEModel, T: int):
    """``(fn, structs)``: routing, permute, activation and combine in XLA around megablox's two ``gmm`` calls (their
    bf16 outputs are inputs here; xs and h are outputs): softmax / DeepSeek's grouped sigmoid top-k, a stable
    argsort, the row gather, group sizes, the biases by expert (gpt-oss), the activation, the weighted combine. The
    positions and group sizes in the forms ours uses (a sort and a fused compare-and-sum, not XLA scatters, which
    libtpu's model costs ~5x higher and its v5e profiler aborts on), in the peer's favour."""
    import jax
    import jax.numpy as jnp

    from ..library.fused_moe_ops import split_gate_up, swigluoai_jnp
    from ..library.moe_routing.permute_ops import count_ids, inverse_permutation

    S = jax.ShapeDtypeStruct
    f32, i32, bf16 = jnp.float32, jnp.int32, jnp.bfloat16
    k, M = m.k, T * m.k

    def fn(tokens, logits, corr, up_out, down_out, b1, b2):
        w, ids = _jnp_route(m, logits, corr)
        flat = ids.reshape(-1).astype(i32)
        order = jnp.argsort(flat, stable=True).astype(i32)
        xs = tokens[order // k]
        sizes = count_ids(flat, m.E)
        gu = up_out.astype(f32)
        y = down_out.astype(f32)
        if m.bias:
            e_sorted = flat[order]
            gu = gu + b1[e_sorted].astype(f32)
            y = y + b2[e_sorted].astype(f32)
        gate, up = split_gate_up([gu], m.I, m.interleaved)
        if m.act == "swigluoai":
            h = swigluoai_jnp(gate, up, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT).astype(bf16)
        else:
            h = (jax.nn.silu(gate) * up).astype(bf16)
        positions = inverse_permutation(order).reshape(T, k)
        out = jnp.sum(y.astype(bf16).astype(f32)[positions] * w[..., None], 1).astype(bf16)
        return xs, sizes, h, out

    structs = [S((T, m.H), bf16), S((T, m.E), _jdt(m.logits_dtype)), S((m.E,), f32), S((M, 2 * m.I), bf16),
               S((M, m.H), bf16), S((m.E, 2 * m.I), bf16), S((m.E, m.H), bf16)]
    return jax.jit(fn), structs


# ------------------------------------------------------------------------------------------ implementations
#: above this many bytes of row copies the permute gather and the combine are fitted in tokens (:func:`row_copy_cycles`)
FIT_BYTES = 32 * 2 ** 20
#: a program estimated at more than this many times the whole layer's roofline is a profiler fault, left out
NOT_CREDIBLE_ROOFLINES = 50


def scatter_combine(m: MoEModel, T: int, chip=None) -> bool:
    """Whether the combine runs ``moe_scatter_add_fwd`` on ``chip`` (its float32 accumulator of T tokens fits:
    ``permute_ops.scatter_add_fits``), as ``fused_moe_jax`` decides; else ``moe_gather_reduce_fwd``."""
    from ..chips import get_chip
    from ..library.moe_routing import permute_ops

    return permute_ops.scatter_add_fits(T, m.H, 2, None if chip is None else get_chip(chip))


def layer_kernels(m: MoEModel, T: int, chip=None):
    """``[(kernel, args(T), kwargs, row bytes)]``: the non-matmul kernels :func:`fused_moe_jax` calls on ``chip``
    (router, permute gather, activation unless gpt-oss's, combine: :func:`scatter_combine`); ``args(t)`` their
    arguments at ``t`` tokens; ``row bytes``: for the row-DMA kernels (the gather and the gather-reduce combine,
    :func:`row_copy_cycles`) a row's bytes, else 0."""
    from ..library import gated_mlp
    from ..library.moe_routing import permute_ops, router_ops

    H, ld = m.H, m.logits_dtype
    s16 = permute_ops.row_view(H, 2)
    grouped = m.router == "grouped"
    route = dict(k=m.k, mode="grouped" if grouped else "softmax", renormalize=True,
                 n_group=m.n_group, topk_group=m.topk_group, scale=2.5 if grouped else 1.0)
    parts = [(router_ops.router_topk_fwd, lambda t: (f"{t}x{m.E}:{ld}", f"1x{m.E}:f32" if grouped else None), route,
              0),
             (permute_ops.moe_gather_fwd, lambda t: (f"{t}x{s16}x{H // s16}:bf16", f"{t * m.k}:i32"), {}, 2 * H)]
    if m.act != "swigluoai" and _reads_halves(m):  # the fused [T*k, 2I] output's halves read in place
        parts.append((gated_mlp.gated_activation_fwd,
                      lambda t: (f"{t * m.k}x{2 * m.I}:bf16", f"{t * m.k}x{2 * m.I}:bf16"),
                      {"activation": "silu", "halves": True, "out_dtype": "bfloat16"}, 0))
    elif m.act != "swigluoai":
        parts.append((gated_mlp.gated_activation_fwd, lambda t: (f"{t * m.k}x{m.I}:bf16", f"{t * m.k}x{m.I}:bf16"),
                      {"activation": "silu", "out_dtype": "bfloat16"}, 0))
    if scatter_combine(m, T, chip):  # the expert outputs read once, in order, summed into VMEM
        parts.append((permute_ops.moe_scatter_add_fwd,
                      lambda t: (f"{t * m.k}x{s16}x{H // s16}:bf16", f"{t * m.k}:i32", f"{t * m.k}:f32"),
                      {"num_tokens": T}, 0))
    else:
        parts.append((permute_ops.moe_gather_reduce_fwd,
                      lambda t: (f"{t * m.k}x{s16}x{H // s16}:bf16", f"{t * m.k}:i32", f"{t * m.k}:f32"),
                      {"top_k": m.k}, 2 * H))
    return parts


def row_copy_cycles(est, chip: str, kernel, args, kwargs, T: int, k: int, row_bytes: int) -> int:
    """A row-DMA kernel's estimate at ``T`` tokens (``args(t)``; ``T * k`` copies of ``row_bytes``) at the config of
    the full call: itself up to :data:`FIT_BYTES` of copies; above, linear in tokens from two reduced problems of at
    most that many bytes (multiples of 64 tokens; its cost is per grid step of a fixed block). libtpu 0.0.52's tpu7x
    profiler costs a kernel that copies more than 64 MiB at ~1,000x (the gather 1.21 s at 65,536 rows of 4 KiB, 112 µs
    at 16,384; the combine of DeepSeek-V3's 28 KiB rows 78.9 ms at 4,096 rows, 27.7 µs at 2,048). A kernel whose
    source is resident in VMEM (``source="vmem"``: no row copies) is estimated whole; reduced, its tpu7x estimate
    aborts (``bundle_analysis.cc:197`` below ~8,192 source rows)."""
    fn, structs, cfg, _ = kernel_program(kernel, chip, args(T), kwargs)
    if T * k * row_bytes <= FIT_BYTES or cfg.get("source") == "vmem":
        return est.cycles(fn, structs, chip)
    t2 = max(64, FIT_BYTES // (k * row_bytes) // 64 * 64)
    t1 = t2 // 2
    c1, c2 = (est.cycles(*kernel_program(kernel, chip, args(t), kwargs, cfg)[:2], chip) for t in (t1, t2))
    return int(round(c1 + (c2 - c1) * (T - t1) / (t2 - t1)))


class _Parts:
    """Sums the estimates of a layer's programs. A program libtpu cannot estimate is skipped and named; the row is
    then a floor: ``max(the roofline, the sum of the programs that were estimated)`` (the others cost >= 0)."""

    def __init__(self, roofline_us):
        self.roofline_us, self.partial = roofline_us, {}

    def run(self, chip, named_estimates) -> int:
        from ..perf import clock_hz

        total, failed = 0, []
        limit_us = NOT_CREDIBLE_ROOFLINES * self.roofline_us(chip)
        for name, estimate in named_estimates:
            try:
                cycles = estimate()
            except EstimateError as e:
                failed.append(f"{name}: {e}")
                continue
            us = cycles / clock_hz(chip) * 1e6
            if us > limit_us:  # libtpu's tpu7x profiler costs some DMA-heavy programs at ~1,000x (module docstring)
                failed.append(f"{name}: libtpu's estimate {us:,.0f} µs is over {NOT_CREDIBLE_ROOFLINES}x the whole "
                              f"layer's roofline: not credible, left out")
                continue
            total += cycles
        self.partial[chip] = total
        if failed:
            raise EstimateError("; ".join(failed))
        return total

    def floor_us(self, chip) -> float:
        from ..perf import clock_hz

        return max(self.roofline_us(chip), self.partial.get(chip, 0) / clock_hz(chip) * 1e6)


def _ours(m: MoEModel, T: int, roofline_us) -> Impl:
    parts = _Parts(roofline_us)

    def cycles(est, chip):
        names, programs = [], []
        for kernel, args, kwargs, copies in layer_kernels(m, T, chip):
            if copies:  # a row-DMA kernel: copies is its row bytes
                programs.append((kernel.name, lambda kernel=kernel, args=args, kwargs=kwargs, rb=copies:
                                 row_copy_cycles(est, chip, kernel, args, kwargs, T, m.k, rb)))
                continue
            fn, structs, _, _ = kernel_program(kernel, chip, args(T), kwargs)
            programs.append((kernel.name, lambda fn=fn, structs=structs: est.cycles(fn, structs, chip)))
        programs.append(("the XLA ops between the kernels",
                         lambda: est.cycles(*ours_xla_glue(m, T, scatter_combine(m, T, chip)), chip)))
        for w in ("up", "down"):
            fit, cfg = ours_grouped_matmul(m, T, w, chip)
            programs.append((f"grouped_matmul_fwd ({w})", lambda fit=fit: fit.cycles(est, chip)))
            names.append(f"{w}: bm={cfg['bm']},bk={cfg['bk']},bn={cfg['bn']},rhs_prefetch={cfg['rhs_prefetch']} "
                         f"({cfg['source']})")
        return parts.run(chip, programs), "; ".join(names)

    return Impl("tpukernels", "ours", cycles, floor_us=parts.floor_us)


def _megablox(m: MoEModel, T: int, roofline_us) -> Impl:
    fits = {w: megablox_grouped_matmul(m, T, w) for w in ("up", "down")}
    parts = _Parts(roofline_us)

    def cycles(est, chip):
        programs = [("the XLA routing, permute, activation and combine", lambda: est.cycles(*xla_moe_glue(m, T), chip))]
        programs += [(f"megablox gmm ({w})", lambda fit=fit: fit.cycles(est, chip)) for w, (fit, _) in fits.items()]
        return parts.run(chip, programs), None

    return Impl("jax megablox + xla routing", "public", cycles,
                config="; ".join(f"{w}: {c}" for w, (_, c) in fits.items()), floor_us=parts.floor_us)


def _tpu_inference(roofline_us) -> Impl:
    def cycles(est, chip):
        raise EstimateError(_TPU_INFERENCE_WHY)

    return Impl("tpu-inference fused_moe v1", "public", cycles, config="-", floor_us=roofline_us)


def cases(chips) -> list[Case]:
    from ..perf import model_time

    out = []
    for m in MODELS:
        for phase, T in PHASES:
            hbm, flops = hbm_and_flops(m, T)

            def roofline_us(chip, hbm=hbm, flops=flops):
                return model_time(chip, None, hbm, flops, "bfloat16").roofline_us

            for chip in chips:
                impls = [_ours(m, T, roofline_us), _megablox(m, T, roofline_us), _tpu_inference(roofline_us)]
                out.append(Case(FAMILY, m.label, f"{phase} T={T}", chip, hbm_bytes=hbm, flops=flops, impls=impls))
    return out


def reason(row: dict) -> str | None:
    """For our rows: why the figure is what it is (:data:`REASONS`, the v5e and tpu7x profiler faults)."""
    if row.get("kind") != "ours":
        return None
    if row["chip"] == "v5e" and row.get("figure") == "estimate":  # ours estimates here; the peers do not
        return (f"v5e: {row['pct_roofline']:.0f}% of the layer's roofline in the model; megablox's grouped matmul "
                "aborts libtpu 0.0.52's v5e profiler and tpu-inference's kernel cannot be estimated, so both peers' "
                "figures are floors (the roofline), not a comparison; where our layer loses its share of the roofline "
                "on v5e is not analysed")
    if row["chip"] == "v5e":
        return _V5E
    if row["chip"] == "tpu7x" and row["op"] == _QWEN3:
        return _TPU7X_QWEN3
    if row["chip"] == "tpu7x" and row["op"] == _DSV3 and row.get("figure") != "estimate":
        return _TPU7X_DSV3
    known = REASONS.get((row["chip"], row["op"], row["shape"]))
    if known or row.get("figure") != "estimate":
        return known
    return (f"{row['pct_roofline']:.0f}% of the layer's roofline in the model; tpu-inference's fused kernel cannot be "
            "estimated, so its figure is that roofline (a bound on it, not a comparison)")
