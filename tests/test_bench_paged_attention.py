"""The paged_attention bench family's fallback where libtpu's profiler aborts on the full batch: the reduced
batch (SMALL_S sequences) times S / SMALL_S, an upper bound, labelled in the config; and the check ratio
shown where the full batch estimates."""

from __future__ import annotations

from tpukernels.bench import paged_attention as bpa
from tpukernels.bench.core import EstimateError


class _FakeEstimator:
    """Cycles = 1000 per sequence + 500 fixed; 'aborts' on the full batch when ``abort_full``."""

    def __init__(self, abort_full: bool):
        self.abort_full = abort_full
        self.seen = []

    def cycles(self, fn, structs, chip):
        S = structs[0].shape[0]  # kv_lens [S]: the first operand of the kernel
        self.seen.append(S)
        if S == 64 and self.abort_full:
            raise EstimateError("estimate server exited: llo_execution_graph.cc:149 signal 6")
        return 1000 * S + 500


def _decode_ours():
    (case,) = [c for c in bpa.cases(["v6e"]) if c.op == "decode" and c.shape.endswith("page=16")]
    return case.impls[0]


def test_ours_falls_back_to_the_reduced_batch_scaled_up():
    est = _FakeEstimator(abort_full=True)
    cycles, cfg = _decode_ours().cycles(est, "v6e")
    assert est.seen == [64, bpa.SMALL_S]
    assert cycles == (1000 * bpa.SMALL_S + 500) * (64 // bpa.SMALL_S)
    assert f"estimated at S={bpa.SMALL_S}" in cfg and "upper bound" in cfg


def test_ours_shows_the_scaling_check_where_the_full_batch_estimates():
    est = _FakeEstimator(abort_full=False)
    cycles, cfg = _decode_ours().cycles(est, "v6e")
    assert cycles == 1000 * 64 + 500
    ratio = (1000 * bpa.SMALL_S + 500) * (64 // bpa.SMALL_S) / (1000 * 64 + 500)
    assert f"S={bpa.SMALL_S} x{64 // bpa.SMALL_S} / full = {ratio:.2f}" in cfg


def test_reasons_combine_the_chip_and_the_static_bound():
    r = bpa.reason({"kind": "ours", "op": "mixed", "chip": "v5e"})
    assert "llo_execution_graph.cc:149" in r and "static bound" in r
    assert bpa.reason({"kind": "ours", "op": "decode", "chip": "v6e"}) is None
