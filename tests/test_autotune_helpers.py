"""Kernels and a synthetic evaluator for the autotuner tests (importable by worker processes by path).

No tests here: pytest collects nothing from this module.
"""

import dataclasses
import math
import os
import time
import warnings

import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import tpukernels as tk
from tpukernels.autotune.evaluators import Evaluator, Trial


# --- a 3-tunable kernel with a constraint (the search-space tests) ----------------------------------------
def _tiles_body(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@tk.tpu_kernel(
    _tiles_body,
    namespace="tktest_autotune",
    tunables={
        "a": tk.Tunable([8, 16, 32, 64, 128], default=16),
        "b": tk.Tunable([128, 256, 512, 1024, 2048], default=256),
        "c": tk.Tunable([1, 2, 3, 4, 5], default=1),
    },
    constraints=[lambda cfg: cfg["a"] * cfg["b"] <= 64 * 1024 or "a * b must be <= 65536"],
)
def tiles(x: torch.Tensor, *, a: int, b: int, c: int) -> torch.Tensor:
    """A copy whose row block is a; b and c only exist to be searched."""
    spec = pl.BlockSpec((a, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], a),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x),
                     body_kwargs={"unused_b": b, "unused_c": c})


# --- a kernel whose br=16 config computes the wrong thing (the correctness check) -------------------------
def _twice_body(x_ref, o_ref, *, br):
    y = x_ref[...] * 2
    o_ref[...] = y + 1 if br == 16 else y


@tk.tpu_kernel(_twice_body, namespace="tktest_autotune", tunables={"br": tk.Tunable([8, 16, 32], default=8)},
               reference=lambda x: x * 2)
def twice(x: torch.Tensor, *, br: int) -> torch.Tensor:
    """2 * x (except the buggy br=16 config)."""
    spec = pl.BlockSpec((br, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], br),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


# --- an in-place kernel (input 0 aliased to output 0) ------------------------------------------------------
def _bump_body(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


@tk.tpu_kernel(_bump_body, namespace="tktest_autotune", tunables={"br": tk.Tunable([8, 16], default=8)})
def bump(x: torch.Tensor, *, br: int) -> torch.Tensor:
    """x + 1, written over x's buffer (input_output_aliases)."""
    spec = pl.BlockSpec((br, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], br),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x),
                     input_output_aliases={0: 0})


# --- a synthetic evaluator: a deterministic bowl, with scripted failures -----------------------------------
@dataclasses.dataclass
class SyntheticEvaluator(Evaluator):
    """time = 10 * (1 + sum over tunables of (log2(v) - log2(optimum))^2) µs; no compile, no device.

    ``fail`` / ``raise_for`` / ``crash`` / ``hang``: configs (as sorted item tuples) that come back failed,
    raise, kill the worker process, or sleep ``hang_s``; ``warn``: every evaluation raises a PerformanceWarning.
    ``mark_dir``: each evaluation first creates ``<mark_dir>/<a>-<b>-...-<pid>`` (who runs what, for tests that
    kill a worker mid-candidate).
    """

    chip: str = "v6e"
    optimum: dict = dataclasses.field(default_factory=dict)
    fail: tuple = ()
    raise_for: tuple = ()
    crash: tuple = ()
    hang: tuple = ()
    hang_s: float = 60.0
    sleep_s: float = 0.0
    mark_dir: str = ""
    warn: bool = False  # every evaluation warns (a PerformanceWarning naming its config), as a badly packed block
    name: str = "synthetic"
    label: str = "model"

    def chip_name(self):
        return self.chip

    def evaluate(self, problem, config):
        key = tuple(sorted(dict(config).items()))
        if self.mark_dir:
            name = "-".join(str(v) for _, v in key) + f"-{os.getpid()}"
            open(os.path.join(self.mark_dir, name), "w").close()
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.warn:
            warnings.warn(f"config {dict(config)} packs its blocks badly", tk.PerformanceWarning, stacklevel=2)
        if key in self.crash:
            os._exit(3)
        if key in self.hang:
            time.sleep(self.hang_s)
        if key in self.raise_for:
            raise RuntimeError("deliberate evaluator error")
        if key in self.fail:
            return Trial(dict(config), "failed", error_kind="compile", error="deliberate compile failure")
        t = 10.0 * (1 + sum((math.log2(v) - math.log2(self.optimum.get(k, v))) ** 2 for k, v in config.items()))
        return Trial(dict(config), "ok", time_us=t, details={"pid": os.getpid()})


def key(**cfg):
    return tuple(sorted(cfg.items()))


def tiny_inputs():
    return (torch.randn(64, 128),)


__all__ = ["tiles", "twice", "bump", "SyntheticEvaluator", "key", "tiny_inputs", "jnp"]
