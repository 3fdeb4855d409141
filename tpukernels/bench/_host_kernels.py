"""Two tiny kernels for the tpu-path dispatch measurement (:func:`tpukernels.bench.host.tpu_dispatch`)."""

import torch
from jax.experimental import pallas as pl

import tpukernels as tk


def _add_body(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


def _scale_body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


@tk.tpu_kernel(_add_body, namespace="tpukernels_bench", shapes={"x": "R C", "y": "R C"})
def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y, one block. x, y: [R, C]."""
    spec = pl.BlockSpec(tuple(x.shape), lambda: (0, 0))
    return tk.Launch(grid=(), in_specs=[spec, spec], out_specs=spec, out_shape=tk.like(x))


@tk.tpu_kernel(_scale_body, namespace="tpukernels_bench", rows=("x",))
def scale_rows(x: torch.Tensor) -> torch.Tensor:
    """2 x, one block, rows bucketed. x: [R, C]."""
    spec = pl.BlockSpec(tuple(x.shape), lambda: (0, 0))
    return tk.Launch(grid=(), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


@torch.library.custom_op("tpukernels_bench::empty2", mutates_args=())
def empty2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The baseline: the torch dispatcher and a custom op that does nothing (returns a preallocated tensor)."""
    return _OUT


@torch.library.custom_op("tpukernels_bench::empty1", mutates_args=())
def empty1(x: torch.Tensor) -> torch.Tensor:
    """As :func:`empty2`, one tensor argument."""
    return _OUT


@torch.library.custom_op("tpukernels_bench::empty_rms", mutates_args=())
def empty_rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, casting: str,
              round_f16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`empty2`, with ``rms_norm_fwd``'s schema (the dispatcher parses the same scalars)."""
    return _OUT, _OUT2


_OUT = torch.zeros(8, 128)
_OUT2 = torch.zeros(8, 1)
