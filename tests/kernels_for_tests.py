"""Small kernels shared by the core tests (defined once per process: op names are global)."""

import importlib.util
import os
import sys

import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import tpukernels as tk

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str):
    """Import examples/<name>.py once (its kernels register torch ops in the "examples" namespace)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# --- a row-scaling kernel with a static float, rows bucketing and a backward --------------------------
def _scale_body(x_ref, o_ref, *, alpha):
    o_ref[...] = (x_ref[...].astype(jnp.float32) * alpha).astype(o_ref.dtype)


@tk.tpu_kernel(_scale_body, namespace="tktest", tunables={"block_rows": tk.Tunable([16, 8, 32, 256])}, rows=("x",))
def scale(x: torch.Tensor, alpha: float = 2.0, *, block_rows: int) -> torch.Tensor:
    """alpha * x. x: [R, C]."""
    if x.ndim != 2:
        raise tk.ArgumentError(f"scale: x must be 2-D, got {tuple(x.shape)}")
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], block_rows),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


@scale.def_backward
def _scale_bwd(ctx, g):
    return {"x": scale(g, ctx.alpha)}


# --- a row sum over column blocks: the tail bug and its fix -------------------------------------------
def _rowsum_body(x_ref, o_ref, acc_ref, *, C: int, bc: int, masked: bool):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...].astype(jnp.float32)
    if masked:
        x = tk.mask_tail(x, axis=1, start=j * bc, size=C)
    acc_ref[...] += jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True), acc_ref.shape)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...]


def _rowsum_launch(x, masked, bc):
    from jax.experimental.pallas import tpu as pltpu

    R, C = x.shape
    return tk.Launch(
        grid=(tk.cdiv(R, 8), tk.cdiv(C, bc)),
        in_specs=[pl.BlockSpec((8, bc), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, 0)),
        out_shape=tk.OutSpec((R, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
        body_kwargs={"C": C, "bc": bc, "masked": masked},
    )


@tk.tpu_kernel(_rowsum_body, namespace="tktest", tunables={"bc": tk.Tunable([128, 256])})
def rowsum_masked(x: torch.Tensor, *, bc: int) -> torch.Tensor:
    """Row sums of x: [R, C] f32 (broadcast over 128 lanes): masks the column tail."""
    return _rowsum_launch(x, True, bc)


@tk.tpu_kernel(_rowsum_body, namespace="tktest", tunables={"bc": tk.Tunable([128, 256])})
def rowsum_unmasked(x: torch.Tensor, *, bc: int) -> torch.Tensor:
    """The same kernel with the tail bug: sums whatever lies past column C."""
    return _rowsum_launch(x, False, bc)


# --- two outputs, an optional tensor ------------------------------------------------------------------
def _addmul_body(*refs, has_bias: bool):
    if has_bias:
        x_ref, y_ref, b_ref, s_ref, p_ref = refs
        s_ref[...] = x_ref[...] + y_ref[...] + b_ref[...]
    else:
        x_ref, y_ref, s_ref, p_ref = refs
        s_ref[...] = x_ref[...] + y_ref[...]
    p_ref[...] = x_ref[...] * y_ref[...]


@tk.tpu_kernel(_addmul_body, namespace="tktest")
def add_mul(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y [+ bias], x * y). x, y: [R, C]; bias: [R, C] or None."""
    if x.shape != y.shape:
        raise tk.ArgumentError(f"add_mul: x {tuple(x.shape)} and y {tuple(y.shape)} must have equal shapes")
    spec = pl.BlockSpec((x.shape[0], x.shape[1]), lambda: (0, 0))
    n_in = 3 if bias is not None else 2
    return tk.Launch(grid=(), in_specs=[spec] * n_in, out_specs=[spec, spec], out_shape=(tk.like(x), tk.like(x)),
                     body_kwargs={"has_bias": bias is not None})


# --- a body that raises ---------------------------------------------------------------------------------
def _broken_body(x_ref, o_ref):
    raise RuntimeError("deliberate bug in the kernel body")


@tk.tpu_kernel(_broken_body, namespace="tktest")
def broken(x: torch.Tensor) -> torch.Tensor:
    spec = pl.BlockSpec(tuple(x.shape), lambda: (0,) * x.ndim)
    return tk.Launch(grid=(), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


def _copy_body(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@tk.tpu_kernel(_copy_body, namespace="tktest", tunables={"br": tk.Tunable([8, 12, 16, 4096])})
def copy_rows(x: torch.Tensor, *, br: int) -> torch.Tensor:
    """Row-block copy used to exercise the block-rule and VMEM checks."""
    spec = pl.BlockSpec((br, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], br),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


# --- an in-place style kernel: output 0 aliases input 0 (input_output_aliases) ------------------------
def _accum_body(acc_ref, x_ref, o_ref):
    o_ref[...] = acc_ref[...] + x_ref[...]


@tk.tpu_kernel(_accum_body, namespace="tktest")
def accumulate(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc + x, written into acc's buffer on TPU (``input_output_aliases={0: 0}``); functional as an op."""
    spec = pl.BlockSpec(tuple(acc.shape), lambda: (0,) * acc.ndim)
    return tk.Launch(grid=(), in_specs=[spec, spec], out_specs=spec, out_shape=tk.like(acc),
                     input_output_aliases={0: 0})


def _gather_body(idx_ref, t_ref, o_ref):
    o_ref[...] = t_ref[...] * 2


@tk.tpu_kernel(_gather_body, namespace="tktest")
def gather_rows(idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``out[i] = 2 * table[idx[i]]``, idx: int32 [n], table: [V, 1, D] (a data-dependent index map)."""
    (n,), (_, _, D) = idx.shape, table.shape
    return tk.Launch(grid=(n,), num_scalar_prefetch=1,
                     in_specs=[pl.BlockSpec((None, 1, D), lambda i, idx: (idx[i], 0, 0))],
                     out_specs=pl.BlockSpec((None, 1, D), lambda i, idx: (i, 0, 0)),
                     out_shape=tk.OutSpec((n, 1, D), table.dtype))


# --- a kernel whose launch depends on the target chip (what tpukernels.lowering.launch_chip returns) ----
def _chip_scale_body(x_ref, o_ref, *, factor):
    o_ref[...] = x_ref[...] * factor


@tk.tpu_kernel(_chip_scale_body, namespace="tktest")
def chip_scale(x: torch.Tensor) -> torch.Tensor:
    """``x`` times the launch chip's MXU columns (jax's tpu_info: 128 on v5e, 256 on v6e), 1 with no target chip."""
    from tpukernels.lowering import launch_chip

    chip = launch_chip()
    spec = pl.BlockSpec(tuple(x.shape), lambda: (0,) * x.ndim)
    return tk.Launch(grid=(), in_specs=[spec], out_specs=spec, out_shape=tk.like(x),
                     body_kwargs={"factor": 1.0 if chip is None else float(chip.info.mxu_column_size)})
