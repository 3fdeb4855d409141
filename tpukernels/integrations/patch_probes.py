"""Numerical probes behind :func:`tpukernels.integrations.transformers.apply_tpukernels`.

A replacement (norm, linear, gated MLP, RoPE function, attention implementation) is accepted only where it
computes what the module it replaces computes: run both on a probe input, on the module's **own** weights
(and, for norms, also on a copy with random weights, so a ``(1 + w)`` formula cannot pass by the accident of
one weight vector), and compare within a tolerance set by the weights' dtype. Names decide nothing: a class is
a *candidate* by its structure, the probe decides. Each verdict is ``None`` (equal) or a one-line reason
(the class stays stock; the caller warns once naming it).

Verdicts are cached per (class, dtype, variant) for the process: the first module of a class decides for
all of them (their forward is the same code; a per-instance attribute the formula reads, such as eps, is
copied from each instance).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Callable, Optional

import torch

#: max |ours - stock| / max(|stock|) allowed by the probes, by the dtype the module computes in. Float32:
#: reduction-order differences of one kernel (observed <= 1e-6); 16-bit: one rounding of the output.
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 4e-3}

#: whole-model probes (attention): a few layers and the LM head amplify one kernel's rounding
MODEL_TOLERANCE = {torch.float32: 2e-3, torch.float64: 1e-6, torch.bfloat16: 8e-2, torch.float16: 2e-2}

verdicts: dict = {}

#: the top-k of a DSA indexer (``index_topk``: DeepSeek-V3.2, GLM-MoE-DSA) while the whole-model attention probe
#: runs: below the probe's length, so the selection (``indices=``) is what is compared, not all keys
PROBE_TOPK = 4


@contextlib.contextmanager
def narrowed_index_topk(model: torch.nn.Module, k: int = PROBE_TOPK):
    """Within the block, every submodule with an int ``index_topk`` above ``k`` (a DSA indexer) selects ``k``
    keys; restored after. The weights are the model's own: only how many keys the indexer keeps changes, so
    a sparse attention that ignored or misread the selection differs from the stock model on the probe."""
    saved = []
    for m in model.modules():
        v = m.__dict__.get("index_topk")
        if isinstance(v, int) and not isinstance(v, bool) and v > k:
            saved.append((m, v))
            m.index_topk = k
    try:
        yield
    finally:
        for m, v in saved:
            m.index_topk = v


def relative_error(got, want) -> float:
    """``max |got - want| / max |want|`` in float64 (inf where the shapes differ or ``got`` is not a tensor;
    NaN positions must agree)."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.shape != want.shape:
        return float("inf")
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return float("inf")
    g, w = g.nan_to_num(0.0), w.nan_to_num(0.0)
    scale = float(w.abs().max()) if w.numel() else 0.0
    return float((g - w).abs().max()) / max(scale, 1e-30) if w.numel() else 0.0


def single_input_forward(module: torch.nn.Module) -> Optional[str]:
    """None if ``module.forward`` takes exactly one tensor argument, else why not (a gated norm's ``gate``,
    a residual): a one-input replacement would drop the others."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward has no inspectable signature"
    extra = [p.name for p in params[1:] if p.kind not in (p.VAR_KEYWORD,)]
    if not params or extra:
        return f"its forward takes more than one input ({', '.join(p.name for p in params)})"
    return None


def _weight_of(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The module's ``weight`` (parameter or buffer), else its first floating parameter, else None."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    return next((p for p in module.parameters() if p.is_floating_point()), None)


def _probe_inputs(h: int, dtype, device, seed: int, n_inputs: int = 1) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 5, h, generator=g, dtype=torch.float32) for _ in range(n_inputs)]
    # unit scale, and a tiny one where eps dominates the mean square (a wrong eps shows there); a second
    # input (a gate) keeps its unit scale
    return [tuple(x.to(dtype=dtype, device=device) for x in xs),
            tuple((x * (1e-3 if i == 0 else 1.0)).to(dtype=dtype, device=device) for i, x in enumerate(xs))]


def compare_modules(stock: torch.nn.Module, ours: torch.nn.Module, h: int, dtype, device, seed: int = 0,
                    n_inputs: int = 1) -> Optional[str]:
    """Run ``stock`` and ``ours`` on the same ``n_inputs`` ``[3, 5, h]`` inputs (a gated norm: ``x, gate``);
    None if within :data:`TOLERANCE` of dtype."""
    tol = TOLERANCE.get(dtype, 2e-2)
    with torch.no_grad():
        for x in _probe_inputs(h, dtype, device, seed, n_inputs):
            try:
                want = stock(*x)
            except Exception as e:  # noqa: BLE001 - a forward we cannot call on the probe is not ours to replace
                return f"its forward fails on a probe input ({type(e).__name__}: {e})"
            try:
                got = ours(*x)
            except Exception as e:  # noqa: BLE001
                return f"the replacement fails on a probe input ({type(e).__name__}: {e})"
            err = relative_error(got, want)
            if not err <= tol:
                return f"the replacement differs from its forward by {err:.3g} (relative; tolerance {tol:g} for {dtype})"
    return None


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``module`` with random floating weights/biases (so a formula cannot match by accident)."""
    m = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            if t is not None and t.is_floating_point():
                t.copy_((1.0 + 0.5 * torch.randn(t.shape, generator=g)).to(t.dtype))
    return m


def probe_blocker(child: torch.nn.Module, n_inputs: int = 1) -> Optional[str]:
    """Why ``child`` cannot be probed as a one-input module (so no replacement is tried), or None.
    ``n_inputs=2``: a two-tensor forward (a gated norm's ``x, gate``) is expected instead."""
    why = single_input_forward(child) if n_inputs == 1 else None
    w = _weight_of(child)
    if why is None and w is not None and w.device.type == "meta":
        why = "its weights are on the meta device (nothing to probe)"
    return why


def verify_replacement(child: torch.nn.Module, build: Callable[[torch.nn.Module], torch.nn.Module], variant: str,
                       *, randomize: bool = True, hidden: Optional[int] = None, n_inputs: int = 1) -> Optional[str]:
    """Probe ``build(child)`` against ``child`` (own weights, then randomized weights); cached per class.

    ``build`` makes the replacement from a module (sharing its weights); ``variant`` names the formula tried
    (part of the cache key, with the class and weight dtype); ``hidden``: the input's last dim where it is
    not ``weight.shape[-1]`` (an MLP); ``n_inputs``: tensors the forward takes (2: a gated norm's ``x, gate``)."""
    w = _weight_of(child)
    dtype = w.dtype if w is not None and w.is_floating_point() else torch.float32
    key = (type(child), dtype, variant)
    if key in verdicts:
        return verdicts[key]
    why = probe_blocker(child, n_inputs)
    if why is None:
        h = hidden if hidden is not None else (w.shape[-1] if w is not None else None)
        if h is None:
            why = "no weight to take the probe's hidden size from"
    if why is None:
        device = w.device if w is not None else torch.device("cpu")
        subjects = [child] + ([_randomized(child, 1)] if randomize else [])
        for s in subjects:
            try:
                ours = build(s)
            except Exception as e:  # noqa: BLE001 - e.g. a typed error of the replacement's constructor
                why = f"the replacement cannot be built ({type(e).__name__}: {e})"
                break
            why = compare_modules(s, ours, h, dtype, device, n_inputs=n_inputs)
            if why:
                break
    verdicts[key] = why
    return why


def verify_function(stock: Callable, ours: Callable, make_args: Callable[[], tuple], key) -> Optional[str]:
    """Probe a replacement function (RoPE) on ``make_args()``; outputs compared elementwise (tuples too)."""
    if key in verdicts:
        return verdicts[key]
    args = make_args()
    why = None
    with torch.no_grad():
        try:
            want = stock(*args)
            got = ours(*args)
        except Exception as e:  # noqa: BLE001
            why = f"a probe call fails ({type(e).__name__}: {e})"
        else:
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            tol = TOLERANCE[torch.float32]
            errs = [relative_error(a, b) for a, b in zip(got, want)] if len(got) == len(want) else [float("inf")]
            if not max(errs) <= tol:
                why = f"it differs from the original by {max(errs):.3g} (relative; tolerance {tol:g})"
    verdicts[key] = why
    return why
