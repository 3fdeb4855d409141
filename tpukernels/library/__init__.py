"""Tuned kernel library (attention, matmul, normalization), all written with the tpukernels DSL.

Each kernel family is one module (kernel bodies, launch, tunable space, defaults, float64 reference,
registration) and may define ``STANDARD_CASES``: ``[(kernel, args, kwargs), ...]`` at the shapes its
defaults are tuned for, used by ``tpukernels demo``, ``tpukernels autotune --library`` and benchmarks.
"""

import sys as _sys

# Library modules (one import line each):


def standard_cases():
    """Every library module's ``STANDARD_CASES`` (kernel, example args, kwargs)."""
    out = []
    for name, mod in sorted(_sys.modules.items()):
        if name.startswith(__name__ + ".") and hasattr(mod, "STANDARD_CASES"):
            out.extend(mod.STANDARD_CASES)
    return out
