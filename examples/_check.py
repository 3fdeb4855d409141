"""Shared self-check for the examples: compare with a float64 torch reference in both interpret modes,
then compile for v5e, v6e and tpu7x. Exits non-zero on any mismatch or compile failure."""

from __future__ import annotations

import sys

import torch

import tpukernels as tk

CHIPS = ("v5e", "v6e", "tpu7x")


def check(name, run, reference, cases, compile_cases, atol, rtol) -> int:
    """Run ``run(*inputs)`` vs ``reference(*inputs_in_float64)`` for each case; compile ``compile_cases``.

    Returns the number of failures (0 = all good) and prints one line per check.
    """
    failures = 0
    for mode in ("fast", "tpu"):
        with tk.interpret_mode(mode):
            for inputs in cases:
                got = run(*inputs).double()
                want = reference(*[t.double() if isinstance(t, torch.Tensor) else t for t in inputs])
                tol = atol[inputs[0].dtype], rtol[inputs[0].dtype]
                ok = bool(torch.allclose(got, want, atol=tol[0], rtol=tol[1])) and got.shape == want.shape
                err = (got - want).abs().max().item() if got.numel() else 0.0
                shapes = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
                print(f"{name} cpu/{mode:4} {str(inputs[0].dtype):15} {shapes}: max|err|={err:.2e} {'ok' if ok else 'MISMATCH'}")
                failures += not ok
    for kernel, args, kwargs in compile_cases:
        for chip in CHIPS:
            r = tk.compile_for(kernel, chip, *args, **kwargs)
            print(f"{name} compile {r.summary()}")
            failures += not r.ok
    return failures


def exit_with(failures: int) -> None:
    print("PASS" if failures == 0 else f"FAIL ({failures} checks)")
    sys.exit(1 if failures else 0)
