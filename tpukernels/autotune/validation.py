"""Validate the tpu-model against published TPU measurements (ranking and error).

The reference data is JAX's own Pallas TPU matmul guide: six bf16 matmuls on a TPU v5e (three sizes x two
block configs), stored with their citation in ``benchmarks/data/jax_pallas_tpu_matmul_v5e.json``. The
guide's kernel is rebuilt here with the DSL (:data:`docs_matmul`, not registered as a torch op), each row
is evaluated by :class:`~tpukernels.autotune.evaluators.TpuModelEvaluator` and compared:

* ``spearman``: rank correlation of model vs published times (1.0 = the published order);
* per-row relative error ``model / published - 1`` and its median of absolute values;
* the same figures for the model's variants (libtpu cycles alone, roofline + step overhead alone,
  and the literal ``max(cycles, bytes/BW, flops/peak) + steps * overhead``), from the same compiles.

The published times include Python dispatch (the guide says they are upper bounds), which dominates the
~10 µs 1024^3 row: expect that row's model to be far below it.

    python benchmarks/validate_model.py
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..dsl.kernel import TpuKernel
from ..dsl.spec import Launch, like

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "data",
                    "jax_pallas_tpu_matmul_v5e.json")


def _docs_matmul_body(x_ref, y_ref, z_ref, acc_ref, *, nsteps):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == nsteps - 1)
    def _():
        z_ref[...] = acc_ref[...].astype(z_ref.dtype)


def _docs_matmul_launch(x: torch.Tensor, y: torch.Tensor, *, bm: int, bk: int, bn: int) -> torch.Tensor:
    (m, k), n = x.shape, y.shape[1]
    return Launch(
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=like(x, shape=(m, n)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        body_kwargs={"nsteps": k // bk},
    )


def _make_docs_matmul() -> TpuKernel:
    from ..dsl.spec import Tunable

    blocks = [128, 256, 512, 1024]
    return TpuKernel(_docs_matmul_body, _docs_matmul_launch, name="docs_matmul", namespace="tpukernels_validation",
                     tunables={"bm": Tunable(blocks), "bk": Tunable(blocks), "bn": Tunable(blocks)}, register=False)


#: The JAX Pallas TPU guide's bf16 matmul, as a tpukernels kernel (not registered as a torch op).
docs_matmul = _make_docs_matmul()


def load(path: str = DATA) -> dict:
    with open(path) as f:
        return json.load(f)


@dataclasses.dataclass
class Validation:
    """Model vs published, per row and overall (every time in µs; model times are a model)."""

    chip: str
    rows: list
    spearman: dict
    median_abs_rel_err: dict
    published_order: bool

    def table(self) -> str:
        head = f"{'m=k=n':>6} {'bm,bk,bn':>14} {'published':>10} {'model':>10} {'err':>7} {'bound':>13} {'cycles':>40}"
        lines = [head]
        for r in self.rows:
            lines.append(f"{r['m']:>6} {r['blocks']:>14} {r['published_us']:>10.1f} {r['model_us']:>10.1f} "
                         f"{r['rel_err']['model']:>+7.0%} {r['bound']:>13} {(r['cycles_note'] or '')[:40]:>40}")
        lines.append("")
        lines.append(f"{'variant':<34} {'spearman':>8} {'median |err|':>12}")
        for v in self.spearman:
            lines.append(f"{v:<34} {self.spearman[v]:>8.3f} {self.median_abs_rel_err[v]:>12.0%}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


VARIANTS = {
    "model": "max(cycles, roofline + steps*overhead) [tpu-model]",
    "cycles": "libtpu cycles / clock only",
    "roofline+overhead": "max(bytes/BW, flops/peak) + steps*overhead",
    "additive": "max(cycles, bytes/BW, flops/peak) + steps*overhead",
}


def validate(data: dict | None = None, evaluator=None) -> Validation:
    """Evaluate every published row with the tpu-model and compare (see module docstring)."""
    import statistics

    from ..dsl.spec import Config
    from .evaluators import TpuModelEvaluator
    from .model import spearman
    from .space import Problem

    data = data or load()
    evaluator = evaluator or TpuModelEvaluator(chip=data["chip"])
    rows = []
    for r in data["rows"]:
        dt = {"bfloat16": "bf16", "float32": "f32"}[data["dtype"]]
        problem = Problem.from_args(docs_matmul, f"{r['m']}x{r['k']}:{dt}", f"{r['k']}x{r['n']}:{dt}")
        trial = evaluator.evaluate(problem, Config(bm=r["bm"], bk=r["bk"], bn=r["bn"]))
        if not trial.ok:
            raise RuntimeError(f"validation row {r}: {trial.status} {trial.error}")
        d = trial.details
        roof = max(d["memory_us"], d["compute_us"])
        times = {
            "model": trial.time_us,
            "cycles": d["cycles_us"] if d["cycles_us"] is not None else float("nan"),
            "roofline+overhead": roof + d["overhead_us"],
            "additive": max(d["cycles_us"] or 0.0, roof) + d["overhead_us"],
        }
        pub = r["time_s"] * 1e6
        rows.append({"m": r["m"], "blocks": f"{r['bm']},{r['bk']},{r['bn']}", "published_us": pub,
                     "model_us": trial.time_us, "times_us": times,
                     "rel_err": {k: v / pub - 1 for k, v in times.items()}, "bound": d["bound"],
                     "cycles_note": d.get("cycles_note"), "grid_steps": d["grid_steps"]})
    pub = [r["published_us"] for r in rows]
    rho = {v: spearman([r["times_us"][v] for r in rows], pub) for v in VARIANTS}
    med = {v: statistics.median(abs(r["rel_err"][v]) for r in rows) for v in VARIANTS}
    order_pub = sorted(range(len(rows)), key=lambda i: pub[i])
    order_model = sorted(range(len(rows)), key=lambda i: rows[i]["model_us"])
    return Validation(data["chip"], rows, rho, med, order_pub == order_model)
