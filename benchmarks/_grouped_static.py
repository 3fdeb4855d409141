"""libtpu's fitted static estimate of tpukernels' grouped matmul kernels at an explicit config (models, no
measurement), shared by ``grouped_matmul_configs.py`` (forward) and ``grouped_matmul_tgmm_configs.py``.

It runs the bench family's own implementation (``tpukernels.bench.grouped_matmul._ours``: reduced problems,
the fit ``a + blocks * (b + q * rows)``, the separately estimated schedule program) with ``config`` in place
of the config a full-size call resolves, through the shared estimate cache, so ``tpukernels bench`` later
reuses every estimate made here.
"""

from __future__ import annotations


def static_estimate(kernel, args, kwargs, M: int, K: int, N: int, chip: str, config: dict,
                    timeout_s: float = 280) -> dict:
    """``{"static_us": µs, "static_pct": % of the MXU roofline 2*M*K*N / peak}`` of ``kernel`` at ``config``.

    Raises:
        tpukernels.bench.core.EstimateError: libtpu could not estimate a program (cached as such).
    """
    from tpukernels.bench import core
    from tpukernels.bench import grouped_matmul as bgm
    from tpukernels.perf import clock_hz, peak_flops

    est = core.Estimator(core.default_cache_path(), timeout_s=timeout_s)
    real = bgm.kernel_program
    # _ours asks kernel_program for the config a full-size call gets; answer with ``config`` instead
    bgm.kernel_program = lambda k, c, a, kw, config_=None: real(k, c, a, kw, dict(config))
    try:
        impl = bgm._ours(kernel, args, kwargs, lambda c: 0.0, chip)
        cyc, _ = impl.cycles(est, chip)
    finally:
        bgm.kernel_program = real
    us = cyc / clock_hz(chip) * 1e6
    ideal_us = 2 * M * K * N / peak_flops(chip) * 1e6
    return dict(static_us=round(us, 1), static_pct=round(100 * ideal_us / us, 1))
