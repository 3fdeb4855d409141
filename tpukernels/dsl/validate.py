"""Checks run on a launch description before anything is lowered.

* Block-shape rules of the Pallas TPU lowering (``jax/_src/pallas/mosaic/lowering.py``,
  ``_check_block_mappings``): for rank >= 2 the last block dim is a multiple of 128 or the full array dim,
  the second-to-last a multiple of 8 or the full dim; rank-1 blocks are the full dim, a multiple of
  ``8 * 128``, or a power of two >= ``128 * (32 // bitwidth)``. Violations raise :class:`BlockShapeError`.
* Packing (performance only): 16-bit dtypes pack 16 rows per (8, 128) vreg tile and 8-bit dtypes 32, so
  a bf16 block of 8 rows wastes half of every load; this emits a :class:`PerformanceWarning`.
* VMEM footprint: every VMEM-resident block is allocated ``buffer_count`` times (2 by default: Pallas
  double-buffers the pipeline), padded to the (sublane x 128) tile of its dtype, plus the VMEM scratch
  shapes. Compared with the chip's scoped limit (``vmem_limit_bytes`` or the chip default) and its
  physical capacity; over either raises :class:`VmemError`. The estimate matches Mosaic exactly for
  plain blocked kernels (see ``tests/test_validate.py::test_vmem_estimate_matches_compiler``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from ..chips import Chip, MiB
from ..errors import BlockShapeError, PerformanceWarning, VmemError

LANES = 128
SUBLANES = 8


def _is_static(v) -> bool:
    return isinstance(v, (int, np.integer))


def block_dims(block_shape: Sequence) -> tuple[int, ...]:
    """Block shape with squeezed (``None`` / ``pl.Squeezed()``) dims as 1 and ``pl.Blocked(n)`` as n."""
    out = []
    for d in block_shape:
        if d is None:
            out.append(1)
        elif _is_static(d):
            out.append(int(d))
        elif hasattr(d, "block_size"):
            out.append(int(d.block_size))
        else:  # pl.Squeezed()
            out.append(1)
    return tuple(out)


def _memory_space_name(spec) -> str:
    ms = getattr(spec, "memory_space", None)
    return "" if ms is None else str(ms).lower()


def is_vmem_block(spec) -> bool:
    """True for specs whose blocks are pipelined through VMEM (the default memory space)."""
    ms = _memory_space_name(spec)
    return not any(s in ms for s in ("any", "hbm", "smem", "semaphore"))


def sublane_tile(dtype) -> int:
    """Rows of one native (sublane, 128) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit dtypes."""
    bits = np.dtype(dtype).itemsize * 8
    return SUBLANES * max(1, 32 // bits)


def padded_bytes(shape: Sequence[int], dtype) -> int:
    """Bytes of one VMEM buffer of ``shape``: minor dim padded to 128 lanes, second-minor to the tile."""
    dims = list(shape) or [1]
    dims[-1] = -(-dims[-1] // LANES) * LANES
    if len(dims) >= 2:
        t = sublane_tile(dtype)
        dims[-2] = -(-dims[-2] // t) * t
    return int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize


def check_block(spec, array_shape: Sequence[int], dtype, where: str) -> None:
    """Check one BlockSpec against its array; raise :class:`BlockShapeError` naming ``where``.

    Args:
        spec: a ``pl.BlockSpec``.
        array_shape: full shape of the operand it tiles.
        dtype: the operand's dtype.
        where: e.g. ``"in_specs[1] (y)"`` for the message.
    """
    if not is_vmem_block(spec) or spec.block_shape is None:
        return
    bs = block_dims(spec.block_shape)
    shp = tuple(int(s) for s in array_shape)
    if len(bs) != len(shp):
        raise BlockShapeError(
            f"{where}: block shape {tuple(spec.block_shape)} has rank {len(bs)} but the array {shp} has rank {len(shp)}"
        )
    name = np.dtype(dtype).name
    if len(bs) >= 2:
        (b1, b0), (a1, a0) = bs[-2:], shp[-2:]
        if not (b0 == a0 or b0 % LANES == 0) or not (b1 == a1 or b1 % SUBLANES == 0):
            raise BlockShapeError(
                f"{where}: block {bs[-2:]} violates the ({SUBLANES},{LANES}) rule for {name} array {shp}: "
                f"the last block dim must be a multiple of {LANES} or equal {a0}, the second-to-last a multiple "
                f"of {SUBLANES} or equal {a1}"
            )
        tile = sublane_tile(dtype)
        if b1 != a1 and b1 % tile != 0:
            warnings.warn(
                f"{where}: {name} block rows {b1} are not a multiple of {tile}; {name} packs {tile} rows per "
                f"(8,128) tile, so every load of this block is partly empty",
                PerformanceWarning,
                stacklevel=4,
            )
    else:
        (b0,), (a0,) = bs, shp
        min_tiling = LANES * max(1, 32 // (np.dtype(dtype).itemsize * 8))
        if not (b0 == a0 or b0 % (SUBLANES * LANES) == 0 or (b0 >= min_tiling and b0 & (b0 - 1) == 0)):
            raise BlockShapeError(
                f"{where}: rank-1 block ({b0},) on {name} array {shp} must equal the array length, be a "
                f"multiple of {SUBLANES * LANES}, or be a power of two >= {min_tiling}"
            )


@dataclasses.dataclass(frozen=True)
class VmemEstimate:
    """Estimated VMEM footprint of one kernel launch, in bytes.

    Attributes:
        blocks_bytes: pipelined in/out blocks, times their buffer count.
        scratch_bytes: VMEM scratch shapes.
        total_bytes: the sum.
        detail: (label, bytes) per contributor, largest first.
    """

    blocks_bytes: int
    scratch_bytes: int
    detail: tuple

    @property
    def total_bytes(self) -> int:
        return self.blocks_bytes + self.scratch_bytes

    def __str__(self) -> str:
        return f"{self.total_bytes / MiB:.2f} MiB"


def estimate_vmem(specs_and_arrays, scratch_shapes: Sequence = ()) -> VmemEstimate:
    """Estimate the VMEM footprint of a launch.

    Args:
        specs_and_arrays: iterable of ``(label, BlockSpec, array_shape, dtype)`` for inputs and outputs.
        scratch_shapes: the launch's scratch shapes (``pltpu.VMEM`` entries count; SMEM/semaphores don't).
    """
    detail = []
    blocks = 0
    for label, spec, shape, dtype in specs_and_arrays:
        if not is_vmem_block(spec):
            continue
        bshape = shape if spec.block_shape is None else block_dims(spec.block_shape)
        nbuf = 2
        pm = getattr(spec, "pipeline_mode", None)
        if pm is not None and getattr(pm, "buffer_count", None):
            nbuf = int(pm.buffer_count)
        b = nbuf * padded_bytes([int(s) for s in bshape], dtype)
        blocks += b
        detail.append((f"{label} {tuple(int(s) for s in bshape)} x{nbuf}", b))
    scratch = 0
    for i, s in enumerate(scratch_shapes):
        ms = str(getattr(s, "memory_space", "")).lower()
        shape = getattr(s, "shape", None)
        dtype = getattr(s, "dtype", None)
        if shape is None or dtype is None or "smem" in ms or "sem" in ms:
            continue
        b = padded_bytes([int(d) for d in shape], dtype)
        scratch += b
        detail.append((f"scratch[{i}] {tuple(shape)}", b))
    detail.sort(key=lambda t: -t[1])
    return VmemEstimate(blocks, scratch, tuple(detail))


def check_vmem(est: VmemEstimate, chip: Chip, vmem_limit_bytes: int | None, kernel: str,
               config: Mapping | None = None) -> None:
    """Raise :class:`VmemError` if ``est`` exceeds the chip's scoped limit or physical capacity.

    ``config``: the kernel's tunables as resolved for this call; the message names them (``block_rows=256``)
    so that "smaller blocks" says which of the kernel's own knobs to turn."""
    cap = chip.vmem_capacity_bytes
    knobs = ", ".join(f"{k}={v}" for k, v in (config or {}).items())
    blocks = f"smaller blocks (this config: {knobs})" if knobs else "smaller blocks"
    top = ", ".join(f"{label}: {b / MiB:.2f} MiB" for label, b in est.detail[:3])
    if vmem_limit_bytes is not None and vmem_limit_bytes > cap:
        raise VmemError(
            f"{kernel}: vmem_limit_bytes {vmem_limit_bytes / MiB:.0f} MiB > {cap / MiB:.0f} MiB VMEM on {chip.name}",
            estimate_bytes=est.total_bytes, limit_bytes=cap,
        )
    if est.total_bytes > cap:
        raise VmemError(
            f"{kernel}: VMEM {est.total_bytes / MiB:.2f} MiB > {cap / MiB:.0f} MiB on {chip.name} "
            f"(largest: {top}); use {blocks}", estimate_bytes=est.total_bytes, limit_bytes=cap,
        )
    limit = vmem_limit_bytes if vmem_limit_bytes is not None else chip.default_scoped_vmem_bytes
    if est.total_bytes > limit:
        how = (
            f"raise vmem_limit_bytes (at most {cap / MiB:.0f} MiB) or use {blocks}"
            if vmem_limit_bytes is None
            else f"raise vmem_limit_bytes or use {blocks}"
        )
        raise VmemError(
            f"{kernel}: VMEM {est.total_bytes / MiB:.2f} MiB > scoped limit {limit / MiB:.0f} MiB on {chip.name} "
            f"(largest: {top}); {how}", estimate_bytes=est.total_bytes, limit_bytes=limit,
        )


def grid_is_empty(grid: Sequence) -> bool:
    return any(_is_static(g) and int(g) == 0 for g in grid)


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for ints (and SymInts)."""
    return -(-a // b)



#: grids with more steps than this are not walked by :func:`check_index_maps` (the check is skipped)
MAX_CHECKED_STEPS = 1 << 20


def _block_indices(spec, grid: Sequence[int], coords, extra=()) -> "np.ndarray | None":
    """``[steps, rank]`` block indices ``spec.index_map`` gives at every grid step (``coords``: ``[rank_g,
    steps]``), or None when the map cannot be evaluated on host arrays (data-dependent, traced-only ops)."""
    fn = getattr(spec, "index_map", None)
    if fn is None:
        return None
    try:
        import jax

        with jax.ensure_compile_time_eval():
            got = fn(*list(coords), *extra)
        got = got if isinstance(got, (tuple, list)) else (got,)
        steps = coords.shape[1]
        cols = [np.broadcast_to(np.asarray(g, dtype=np.int64).reshape(-1), (steps,)) for g in got]
    except Exception:  # noqa: BLE001  (a map we cannot evaluate here is left to the interpreter's checks)
        return None
    return np.stack(cols, axis=1) if cols else np.zeros((steps, 0), np.int64)


def _step(grid: Sequence[int], coords, k: int) -> tuple:
    return tuple(int(c[k]) for c in coords) if len(grid) else ()


def check_index_maps(qualname: str, grid: Sequence[int], inputs: Sequence, outputs: Sequence,
                     aliased_outputs: Sequence[int] = (), prefetch: Sequence = (), error=None) -> None:
    """Walk the grid and check every blocked operand's index map against the operand's extent.

    Args:
        inputs: ``(name, spec, shape)`` per blocked tensor input (scalar-prefetch operands excluded).
        outputs: ``(index, spec, shape)`` per output.
        aliased_outputs: outputs aliased to an input (``input_output_aliases``): they may be written in part.
        prefetch: the scalar-prefetch operands' values (numpy arrays) when the index maps take them: the maps
            are then evaluated on the data of this call (only the inputs are checked: which output blocks a
            data-dependent map leaves alone is the kernel's business).
        error: the error class for an input read past its end (default :class:`ArgumentError`).

    Raises:
        ArgumentError: an input block starts past the input's end at some grid step (the kernel would read
            memory the argument does not have: garbage on a TPU, NaN or an error in interpret mode), or an
            input tiled exactly like an output is smaller than that output (e.g. ``y`` with 300 rows
            beside ``x`` and ``out`` with 512) — naming the argument, its shape and the grid step.
        UnwrittenOutputError: some block of an output is the block of no grid step (it would keep whatever
            the memory held: NaN in interpret mode ``"tpu"``, garbage on a TPU) — naming the output and block.

    Index maps that need scalar-prefetch operands or cannot be evaluated on host arrays are skipped; so are
    grids of more than :data:`MAX_CHECKED_STEPS` steps and blocks outside VMEM (``pl.ANY`` / SMEM).
    """
    from ..errors import ArgumentError, UnwrittenOutputError

    grid = tuple(int(g) for g in grid)
    n = int(np.prod(grid, dtype=np.int64)) if grid else 1
    if n == 0 or n > MAX_CHECKED_STEPS:
        return
    coords = np.indices(grid, dtype=np.int32).reshape(len(grid), -1) if grid else np.zeros((0, 1), np.int32)
    evaluated = {}

    def idx_of(spec):
        key = id(spec.index_map)
        if key not in evaluated:
            evaluated[key] = _block_indices(spec, grid, coords, prefetch)
        return evaluated[key]

    def blocked(spec, shape):
        if spec is None or not is_vmem_block(spec) or getattr(spec, "block_shape", None) is None:
            return None
        if any(not (d is None or _is_static(d) or hasattr(d, "block_size")) and type(d).__name__ != "Squeezed"
               for d in spec.block_shape):
            return None  # Element / BoundedSlice blocks index elements, not blocks
        bs = block_dims(spec.block_shape)
        return bs if len(bs) == len(shape) else None

    out_tiling = []
    error = error or ArgumentError
    for i, spec, shape in outputs if not prefetch else ():
        shape = tuple(int(s) for s in shape)
        bs = blocked(spec, shape)
        idx = None if bs is None else idx_of(spec)
        if idx is None or idx.shape[1] != len(shape):
            continue
        out_tiling.append((i, bs, idx, shape))
        if i in aliased_outputs or any(s == 0 for s in shape):
            continue
        nblocks = [-(-s // b) for s, b in zip(shape, bs)]
        inside = np.all((idx >= 0) & (idx < np.asarray(nblocks)), axis=1)
        seen = np.unique(idx[inside], axis=0) if len(shape) else idx[inside][:1]
        total = int(np.prod(nblocks, dtype=np.int64))
        if len(seen) < total:
            have = {tuple(int(v) for v in r) for r in seen}
            missing = next(t for t in np.ndindex(*nblocks) if t not in have)
            raise UnwrittenOutputError(
                f"{qualname}: output {i} {shape} is tiled into {tuple(nblocks)} blocks of {bs}, but {total - len(seen)} "
                f"of them are the block of no grid step (first: block {missing}, elements "
                f"{tuple(f'{m * b}:{min((m + 1) * b, s)}' for m, b, s in zip(missing, bs, shape))}): the kernel "
                f"never writes them, so they would hold uninitialized memory. Check the grid {grid} and the "
                f"out_specs index_map", kernel=qualname, output=i, block=missing)
    for name, spec, shape in inputs:
        shape = tuple(int(s) for s in shape)
        bs = blocked(spec, shape)
        idx = None if bs is None else idx_of(spec)
        if idx is None or idx.shape[1] != len(shape) or any(s == 0 for s in shape):
            continue
        start = idx * np.asarray(bs, dtype=np.int64)
        bad = np.any((start >= np.asarray(shape)) | (idx < 0), axis=1)
        if bad.any():
            k = int(np.argmax(bad))
            d = int(np.argmax((start[k] >= np.asarray(shape)) | (idx[k] < 0)))
            raise error(
                f"{qualname}: argument {name!r} has shape {shape}, but at grid step {_step(grid, coords, k)} its "
                f"BlockSpec {bs} reads block {tuple(int(v) for v in idx[k])}, whose dim {d} starts at element "
                f"{int(start[k, d])}, past {name}'s size {shape[d]}: "
                + (f"the block index comes from this call's scalar-prefetch values (an index out of range?)"
                   if prefetch else f"{name} is smaller than the grid {grid} covers (a tensor smaller than the others?)"))
        for i, obs, oidx, oshape in out_tiling:
            if obs == bs and oidx.shape == idx.shape and np.array_equal(oidx, idx):
                small = [d for d in range(len(shape)) if shape[d] < oshape[d]]
                if small:
                    d = small[0]
                    raise ArgumentError(
                        f"{qualname}: argument {name!r} has shape {shape} but is tiled like output {i} {oshape} "
                        f"(same blocks {bs}, same index_map): its dim {d} has {shape[d]} elements where the output "
                        f"has {oshape[d]}, so output elements {shape[d]}..{oshape[d] - 1} would be computed from "
                        f"memory past {name}'s end. Pass {name} with the output's shape")
