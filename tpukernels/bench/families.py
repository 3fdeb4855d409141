"""The benchmark families and default chips (``tpukernels bench --family`` / ``--chips``).

Kept out of :mod:`tpukernels.bench.core` and listed in its ``NOT_IN_FIGURES``: naming a new family here (with its
module ``bench/<family>.py``) changes no other family's source digest, so adding a family does not flag every
existing family's figures as stale.
"""

from __future__ import annotations

#: the model families (one module each in this package): libtpu estimates for compile-only TPU chips
MODEL_FAMILIES = ("norms", "matmul", "attention", "quantized_matmul", "linear_cross_entropy", "grouped_matmul", "moe",
                  "paged_attention", "linear_attention", "calibration")
#: every family: the model families, then the host-side measurements
FAMILIES = MODEL_FAMILIES + ("host",)
#: model families whose rows are not implementations of a case (their own report section, no summary row)
CALIBRATION_FAMILIES = ("calibration",)
DEFAULT_CHIPS = ("v5e", "v6e", "tpu7x")
