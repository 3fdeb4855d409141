"""The ``tpu-model`` time of one kernel launch on a TPU generation: a **model**, not a measurement.

    model_us = max(cycles / clock,  max(hbm_bytes / hbm_bandwidth, flops / peak_flops) + steps * STEP_OVERHEAD_US)

* ``cycles``: libtpu's static ``estimated_cycles`` of the compiled kernel (:mod:`tpukernels.autotune.estimator`).
  libtpu simulates the whole pipelined grid loop, so the estimate already contains the cost of every grid
  step (DMA issue and waits, semaphores, loop control): on v5e it charges ~750 cycles per step to a
  128x128x128 bf16 matmul whose MXU work is ~32 cycles. That is why the per-step overhead is added to the
  roofline terms and not to the cycle term (adding it there too counts it twice; the validation in
  ``benchmarks/validate_model.py`` shows that variant's error). Grids with more than ``estimate_steps``
  steps are estimated on a reduced grid (outer axes shrunk, the innermost axes kept, so the inner loop
  and its reduction pattern are the real ones) and scaled by ``steps / reduced_steps``: libtpu's
  simulation time grows with the steps and their size (53 s for a 32768-step 128-block matmul, 130 s for
  a 1024-step 512x1024x1024-block one on this machine). Against full-grid estimates of the validation
  matmuls, the scaled 16-step estimate (the default) is 2-6% high, a 64-step one within 1% at ~2-4x the
  estimate time, an 8-step one 8-11% high.
* ``hbm_bytes``: the launch's ``cost_estimate.bytes_accessed`` when the author gave one; else the traffic
  of the Pallas pipeline (every block fetch / write-back: a block is re-fetched whenever its index changes
  between consecutive grid steps), computed from the BlockSpecs and the grid; else XLA's
  ``cost_analysis()`` of the compile-only executable (for a Mosaic custom call it reports only the operand
  and result sizes); else input + output bytes.
* ``flops``: ``cost_estimate.flops``; else jax's Pallas cost rules applied to the kernel body's jaxpr,
  times the number of grid steps; else 0 (the cycle term still carries the compute).
* ``STEP_OVERHEAD_US`` = 0.35 µs per grid step: the figure quoted for Pallas TPU from the JAX docs (the
  brief of issue 7 cites it as the Pallas TPU docs' figure; it is not in the docs text at
  jax-ml/jax@cec06d1, so treat the citation as unverified). It agrees with the docs' own v5e matmul table,
  where 128x128x128 blocks are pure step overhead: 91.84 ms / 64**3 steps = 0.350 µs and
  11.77 ms / 32**3 steps = 0.359 µs (``benchmarks/data/jax_pallas_tpu_matmul_v5e.json``).

Chip figures (clock, HBM bandwidth, peak FLOP/s) come from :mod:`tpukernels.perf` (jax's ``tpu_info``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .. import perf
from ..chips import Chip, get_chip

#: Fixed cost of one Pallas TPU grid step, µs (see module docstring for the source and its caveat).
STEP_OVERHEAD_US = 0.35
#: Grids larger than this are estimated on a reduced grid and scaled (see module docstring).
ESTIMATE_STEPS = 16


def grid_steps(grid: Sequence) -> int:
    """Number of grid steps (1 for ``grid=()``)."""
    return int(np.prod([int(g) for g in grid], dtype=np.int64)) if grid else 1


def reduce_grid(grid: Sequence, max_steps: int) -> tuple:
    """A grid of at most ``max_steps`` steps that keeps the innermost axes whole.

    Axes are taken from the innermost outwards while the product fits; the first axis that does not fit
    is shrunk to what does, outer axes become 1 (e.g. ``(32, 32, 32)``, 64 -> ``(1, 2, 32)``; 16 ->
    ``(1, 1, 16)``).
    """
    grid = tuple(int(g) for g in grid)
    if grid_steps(grid) <= max_steps:
        return grid
    out = [1] * len(grid)
    room = max(1, int(max_steps))
    for a in reversed(range(len(grid))):
        take = min(grid[a], room)
        out[a] = max(1, take)
        room //= max(1, take)
        if take < grid[a] or room <= 1:
            break
    return tuple(out)


def _block_index(spec, point: tuple) -> tuple | None:
    try:
        idx = spec.index_map(*point)
        idx = idx if isinstance(idx, (tuple, list)) else (idx,)
        return tuple(int(i) for i in idx)
    except Exception:  # index maps on scalar-prefetch refs, or anything not callable on ints
        return None


def index_dependence(spec, grid: Sequence, num_scalar_prefetch: int = 0) -> set | None:
    """Grid axes the block index of ``spec`` depends on (probing the index map), or None if unknown."""
    if num_scalar_prefetch or getattr(spec, "index_map", None) is None:
        return None
    grid = tuple(int(g) for g in grid)
    origin = (0,) * len(grid)
    base = _block_index(spec, origin)
    if base is None:
        return None
    dep = set()
    for a, g in enumerate(grid):
        if g > 1:
            p = list(origin)
            p[a] = 1
            got = _block_index(spec, tuple(p))
            if got is None:
                return None
            if got != base:
                dep.add(a)
    return dep


def block_fetches(spec, grid: Sequence, num_scalar_prefetch: int = 0) -> int:
    """How many times the pipeline copies this operand's block (grid in row-major order).

    The block is re-copied whenever its index changes between consecutive steps, i.e. once per distinct
    prefix of the grid up to the innermost axis it depends on. Unknown dependence: every step.
    """
    grid = tuple(int(g) for g in grid)
    dep = index_dependence(spec, grid, num_scalar_prefetch)
    if dep is None:
        return grid_steps(grid)
    if not dep:
        return 1
    return grid_steps(grid[: max(dep) + 1])


def _nbytes(shape, dtype) -> int:
    return int(np.prod([int(s) for s in shape], dtype=np.int64)) * np.dtype(dtype).itemsize


def io_bytes(specs: Sequence, out_shapes: Sequence) -> int:
    """Input + output array bytes: the minimum HBM traffic (read each input once, write each output once)."""
    return sum(_nbytes(s.shape, s.dtype) for s in specs if s is not None) + sum(
        _nbytes(o.shape, o.dtype) for o in out_shapes
    )


def pipeline_traffic(launch, specs: Sequence) -> int | None:
    """HBM bytes the Pallas pipeline moves: block bytes x block fetches, per input and output.

    Operands outside VMEM (``pl.ANY`` / HBM refs the body copies by hand) count once at full size (a lower
    bound). Returns None for an empty grid.
    """
    from ..dsl.validate import block_dims, grid_is_empty, is_vmem_block

    if grid_is_empty(launch.grid):
        return None
    present = [s for s in specs if s is not None][launch.num_scalar_prefetch:]
    pairs = list(zip(launch.in_specs, [(s.shape, s.dtype) for s in present]))
    pairs += list(zip(launch.out_spec_list, [(o.shape, o.dtype) for o in launch.out_shapes]))
    total = 0
    for spec, (shape, dtype) in pairs:
        if not is_vmem_block(spec) or getattr(spec, "block_shape", None) is None:
            total += _nbytes(shape, dtype)
            continue
        block = block_dims(spec.block_shape)
        per = _nbytes([min(int(b), int(a)) for b, a in zip(block, shape)], dtype)
        total += per * block_fetches(spec, launch.grid, launch.num_scalar_prefetch)
    return total


def _jaxpr_flops(jaxpr) -> int:
    """FLOPs of a jaxpr with jax's Pallas cost rules; conds count their most expensive branch."""
    from jax._src.pallas import cost_estimate as ce

    total = 0
    for eqn in jaxpr.eqns:
        rule = ce._cost_rules.get(eqn.primitive)
        if rule is not None:
            ctx = ce.Context(avals_in=[v.aval for v in eqn.invars], avals_out=[v.aval for v in eqn.outvars])
            total += int(rule(ctx, **eqn.params).flops)
            continue
        if eqn.primitive.name == "cond":
            total += max((_jaxpr_flops(b.jaxpr) for b in eqn.params["branches"]), default=0)
            continue
        mult = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                total += mult * _jaxpr_flops(inner)
    return total


def _find_pallas_call(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                found = _find_pallas_call(inner)
                if found is not None:
                    return found
    return None


def body_flops(fn, arg_structs: Sequence) -> int | None:
    """FLOPs of one grid step of the kernel body (jax's Pallas cost rules on the body jaxpr), or None."""
    import jax

    try:
        eqn = _find_pallas_call(jax.make_jaxpr(fn)(*arg_structs).jaxpr)
        return None if eqn is None else _jaxpr_flops(eqn.params["jaxpr"])
    except Exception:
        return None


def compute_dtype(specs: Sequence) -> str:
    """The dtype that sets the MXU peak, from the kernel's MXU operands.

    MXU operands are the two largest inputs (by element count) that are matrices: a unit dimension among
    the last two marks a row or column vector (per-channel f32 scales ``[1, N]``, per-row ``lse`` / ``g``
    / ``delta`` columns ``[N, 1]`` or ``[B, H, 1, S]``, norm weights ``[1, C]``), which does not make a
    bf16 matmul an f32 one (when no input is a matrix, all inputs count). Integer inputs other than int8
    (labels, group sizes, page tables) are never operands. float32 if either operand is float32; int8 /
    float8 when both are (the int8 / fp8 peak of :func:`tpukernels.perf.peak_flops`); else bfloat16.

    Examples: ``[h bf16 [N, H], W bf16 [V, H], labels i32 [N, 1], lse f32 [N, 1]]`` -> bfloat16;
    ``[x bf16, w int8, scale f32 [1, N]]`` -> bfloat16 (w8a16 runs on the bf16 MXU);
    ``[x int8, w int8, scales f32]`` -> int8; ``[a f32, b bf16]`` (both matrices) -> float32.
    """
    present = [s for s in specs if s is not None and _is_operand_dtype(s.dtype)]
    matrices = [s for s in present if len(s.shape) >= 2 and 1 not in tuple(s.shape)[-2:]]
    present = matrices or present
    if not present:
        return "bfloat16"
    two = sorted(present, key=lambda s: -int(np.prod(s.shape, dtype=np.int64)))[:2]
    ops = [np.dtype(s.dtype).name for s in two]
    if "float32" in ops or "float64" in ops:
        return "float32"
    if all(n == "int8" for n in ops):
        return "int8"
    if all(n.startswith("float8") for n in ops):
        return ops[0]
    return "bfloat16"


def _is_operand_dtype(dtype) -> bool:
    d = np.dtype(dtype)
    return d.name == "int8" or d.kind == "f" or d.name.startswith(("bfloat16", "float8"))


@dataclasses.dataclass
class ModelEstimate:
    """A tpu-model time (µs) and every term it was built from (all model figures, none measured).

    ``time_us = max(cycles_us, max(memory_us, compute_us) + overhead_us)`` (``cycles_us`` None: the second
    term alone). ``roofline_us`` is the ideal: ``max(io_bytes / bandwidth, flops / peak)``.
    """

    chip: str
    time_us: float
    bound: str
    cycles: int | None
    cycles_us: float | None
    cycles_note: str | None
    memory_us: float
    compute_us: float
    overhead_us: float
    grid_steps: int
    hbm_bytes: int
    hbm_source: str
    flops: int
    flops_source: str
    roofline_us: float
    step_overhead_us: float

    @property
    def pct_of_roofline(self) -> float:
        return 100.0 * self.roofline_us / self.time_us if self.time_us else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pct_of_roofline"] = self.pct_of_roofline
        return d


def combine(
    chip: "str | Chip",
    *,
    cycles: int | None,
    steps: int,
    hbm_bytes: int,
    flops: int,
    min_bytes: int,
    dtype: str = "bfloat16",
    step_overhead_us: float = STEP_OVERHEAD_US,
    hbm_source: str = "",
    flops_source: str = "",
    cycles_note: str | None = None,
) -> ModelEstimate:
    """Build the :class:`ModelEstimate` (formula in the module docstring)."""
    chip = get_chip(chip)
    mt = perf.model_time(chip, cycles, hbm_bytes, flops, dtype)
    overhead = steps * step_overhead_us
    roof = max(mt.memory_us, mt.compute_us)
    pipelined = roof + overhead
    if mt.cycles_us is not None and mt.cycles_us >= pipelined:
        time_us, bound = mt.cycles_us, "libtpu-cycles"
    else:
        parts = {"hbm": mt.memory_us, "mxu": mt.compute_us, "grid-steps": overhead}
        time_us, bound = pipelined, max(parts, key=parts.get)
    ideal = max(min_bytes / perf.hbm_bandwidth(chip) * 1e6, mt.compute_us)
    return ModelEstimate(
        chip=chip.name, time_us=time_us, bound=bound, cycles=cycles, cycles_us=mt.cycles_us, cycles_note=cycles_note,
        memory_us=mt.memory_us, compute_us=mt.compute_us, overhead_us=overhead, grid_steps=int(steps),
        hbm_bytes=int(hbm_bytes), hbm_source=hbm_source, flops=int(flops), flops_source=flops_source,
        roofline_us=ideal, step_overhead_us=step_overhead_us,
    )


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    ra, rb = ranks(list(a)), ranks(list(b))
    n = len(ra)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")
