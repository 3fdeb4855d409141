"""Normalization layers: RMSNorm, LayerNorm, fused residual-add + RMSNorm and gated RMSNorm, forward and backward.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors; ``x: [..., H]``, any leading dims, normalized over the last dim)::

    torch.ops.tpukernels.rms_norm(x, weight=None, eps=1e-6, offset=0.0, casting="llama") -> y
    torch.ops.tpukernels.fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0, casting="llama")
        -> (y, new_residual)
    torch.ops.tpukernels.layer_norm(x, weight=None, bias=None, eps=1e-5) -> y
    torch.ops.tpukernels.gated_rms_norm(x, z, weight, eps=1e-6, norm_before_gate=True, group_size=None) -> y

    tpukernels.library.rms_norm / fused_add_rms_norm / layer_norm / gated_rms_norm    the same, as functions
    tpukernels.library.TPURMSNorm / TPULayerNorm / TPUGatedRMSNorm                    nn.Module drop-ins

Formulas. Statistics are always float32, whatever the input dtype (a float16 sum of squares would overflow
at |x| > 256); ``cast`` rounds to the input dtype; ``w`` is the weight upcast to float32::

    rms_norm     rstd = 1 / sqrt(mean(x**2) + eps),  n = x * rstd
                 casting="llama" (default): y = cast(cast(n) * (offset + w))   HF ``LlamaRMSNorm``
                 casting="gemma":           y = cast(n * (offset + w))         HF ``GemmaRMSNorm`` (offset=1)
    layer_norm   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)**2) + eps),  y = cast((x - mean) * rstd * w + b)
    fused_add    new_residual = cast(x + residual),  y = rms_norm(new_residual)      (vLLM ``fused_add_rms_norm``)

``offset + w`` is formed in float32 (Gemma stores ``w`` around 0 and scales by ``1 + w``; in bfloat16 the
``1 +`` would round away every |w| <= 2**-8). The variance is two-pass (``mean((x - mean)**2)``), not
``E[x**2] - E[x]**2``, since each kernel holds the full row. Backward (Zhang & Sennrich 2019; Ba et al.
2016), with ``g = dy * (offset + w)`` (rms) or ``g = dy * w`` (layer norm), ``xhat = (x - mean) * rstd``::

    rms:   dx = rstd * (g - n * mean(g * n)),                          dw = sum_rows(dy * n)
    layer: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),          dw = sum_rows(dy * xhat), db = sum_rows(dy)

Files: :mod:`.common` (defaults, VMEM-aware block sizing, checks, shared body helpers), :mod:`.rms_norm_ops`,
:mod:`.fused_add_rms_norm_ops`, :mod:`.layer_norm_ops` and :mod:`.gated_rms_norm_ops` (the gated norm of hybrid
linear-attention / SSM layers, with its own formulas; each: kernel bodies, kernels with their tunable space and
backward, the public op, the float64 reference), :mod:`.modules` (``nn.Module`` drop-ins). Every name is
importable from ``tpukernels.library.norms``.

Sources: HF transformers ``modeling_llama.LlamaRMSNorm`` / ``modeling_gemma.GemmaRMSNorm`` (casting points),
vLLM ``fused_add_rms_norm``, ``torch.nn.functional.layer_norm``.

float16: Mosaic (libtpu 0.0.52) cannot load, store or convert float16 vectors on v5e/v6e/tpu7x, so the
public ops widen float16 tensors to float32 (exact), run the float32 kernels with the float16 roundings of
the formulas (``cast`` above) emulated in float32/int32 arithmetic (:func:`round_to_f16`), and round the
outputs once to float16. Same numbers as a native float16 kernel, about 4x the HBM traffic of bfloat16.

casting="llama" with bfloat16 x, bfloat16 weight and offset 0 multiplies ``cast(n) * w`` in bfloat16: the
product of two bfloat16 values is exact in float32, so one rounding gives the same number as HF's float32
multiply, without the float32 round trip of ``n`` (the kernel is VALU-bound on tpu7x in libtpu's model).

Defaults: ``eps=1e-6`` for RMSNorm (Gemma/Qwen/Llama-3 configs use 1e-6..1e-5), ``1e-5`` for LayerNorm
(torch's default); never derived from the input dtype. ``casting="llama"`` is the default casting mode.

Design. Five internal kernel ops carry the work, each one ``@tpu_kernel`` on ``[rows, H]`` blocks of
``(block_rows, H)`` (the full hidden size is one block, which satisfies the (8, 128) rule for every H)::

    tpukernels::rms_norm_fwd(x, weight, eps, offset, casting, round_f16) -> (y, rstd[rows, 1] f32)
    tpukernels::fused_add_rms_norm_fwd(x, residual, weight, ..., round_f16) -> (y, new_residual, rstd)
    tpukernels::rms_norm_bwd(dy, x, rstd, weight, dres, offset)          -> (dx, dweight[1, H] f32)
    tpukernels::layer_norm_fwd(x, weight, bias, eps)                     -> (y, mean, rstd)
    tpukernels::layer_norm_bwd(dy, x, mean, rstd, weight)                -> (dx, dweight[1, H] f32, dbias[1, H] f32)

The forward ops return the float32 statistics as extra outputs; their backward (``def_backward``) calls
the backward op with them. The statistic outputs carry no gradient (an incoming gradient for them is
ignored), which is why they are internal: the public ops are ``CompositeImplicitAutograd`` functions that
flatten ``x`` to rows, call the forward op and return only ``y`` (autograd and ``torch.compile`` then see
the kernel ops). ``dweight``/``dbias`` accumulate in a float32 ``(1, H)`` output resident across the
(sequential) row grid; the last row block may overhang the array, its rows read NaN in TPU interpret mode
(garbage on a TPU), so they are masked with :func:`tpukernels.mask_tail` before the reduction. Row counts
are bucketed (``rows=``) so changing token counts reuse compiled kernels; the weight-gradient outputs are
``OutSpec(rows=False)``. The fused-add backward reuses ``rms_norm_bwd`` with ``dres`` (the gradient of
``new_residual``) added to ``dx``. No double backward.

Tuning: one tunable, ``block_rows``, an upper bound: the launch lowers it until the double-buffered blocks
fit :data:`VMEM_BUDGET_BYTES` (below the smallest default scoped VMEM, 16 MiB on v5e) and to the row count.
Per-chip defaults ship in ``tpukernels/data/autotuning/<chip>/tpukernels.<op>.json`` (written by
``benchmarks/norms.py --write-defaults`` from libtpu's static estimates); elsewhere the VMEM-aware
heuristic picks the largest block that fits.

Performance (MODEL ESTIMATES: libtpu 0.0.52 static cost model combined with the HBM roofline by
:func:`tpukernels.perf.model_time`; not measurements), bf16, ``benchmarks/norms.py``: on v5e and v6e every
kernel sits at the HBM roofline at [8192, 4096] and [8192, 8192], like or ahead of XLA's fusion of the same
formula (one exception: layer_norm backward, v6e, H=8192: 88% of roofline, 0.94x XLA). On tpu7x
libtpu's model makes these kernels VALU-bound: rms_norm forward 97-99% of roofline and fused-add 100%, but
the backward kernels and layer_norm reach 48-76%; at H=4096 they beat XLA (1.10-1.33x), at H=8192 they
trail it by 3-9%.
"""

from __future__ import annotations

from .common import (  # noqa: F401  (row_bytes, heuristic_rows: the sizing rule, tested)
    BLOCK_ROWS,
    CASTINGS,
    DEFAULT_LAYER_NORM_EPS,
    DEFAULT_RMS_EPS,
    F32,
    NAMESPACE,
    VMEM_BUDGET_BYTES,
    fit_block_rows,
    heuristic_rows,
    round_to_f16,
    row_bytes,
)
from .fused_add_rms_norm_ops import fused_add_rms_norm, fused_add_rms_norm_fwd, fused_add_rms_norm_reference  # noqa: F401
from .layer_norm_ops import layer_norm, layer_norm_bwd, layer_norm_fwd, layer_norm_reference  # noqa: F401
from .gated_rms_norm_ops import (gated_rms_norm, gated_rms_norm_bwd, gated_rms_norm_fwd,  # noqa: F401
                                 gated_rms_norm_reference)
from .modules import TPUGatedRMSNorm, TPULayerNorm, TPURMSNorm
from .rms_norm_ops import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_reference  # noqa: F401

__all__ = [
    "rms_norm", "fused_add_rms_norm", "layer_norm", "gated_rms_norm", "TPURMSNorm", "TPULayerNorm",
    "TPUGatedRMSNorm", "rms_norm_reference", "fused_add_rms_norm_reference", "layer_norm_reference",
    "gated_rms_norm_reference", "rms_norm_fwd", "rms_norm_bwd", "fused_add_rms_norm_fwd", "layer_norm_fwd",
    "layer_norm_bwd", "gated_rms_norm_fwd", "gated_rms_norm_bwd",
    "DEFAULT_RMS_EPS", "DEFAULT_LAYER_NORM_EPS", "CASTINGS", "BLOCK_ROWS", "VMEM_BUDGET_BYTES",
]

#: ``(kernel, compile_for args, kwargs)`` at the shape the shipped defaults are tuned for (``tpukernels demo``).
STANDARD_CASES = [
    (rms_norm_fwd, ("8192x4096:bf16", "1x4096:bf16"), {"eps": DEFAULT_RMS_EPS, "offset": 0.0, "casting": "llama",
                                                        "round_f16": False}),
    (rms_norm_bwd, ("8192x4096:bf16", "8192x4096:bf16", "8192x1:f32", "1x4096:bf16", None), {"offset": 0.0}),
    (fused_add_rms_norm_fwd, ("8192x4096:bf16", "8192x4096:bf16", "1x4096:bf16"),
     {"eps": DEFAULT_RMS_EPS, "offset": 0.0, "casting": "llama", "round_f16": False}),
    (layer_norm_fwd, ("8192x4096:bf16", "1x4096:bf16", "1x4096:bf16"), {"eps": DEFAULT_LAYER_NORM_EPS}),
    (layer_norm_bwd, ("8192x4096:bf16", "8192x4096:bf16", "8192x1:f32", "8192x1:f32", "1x4096:bf16"), {}),
]
