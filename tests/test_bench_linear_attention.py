"""The linear_attention bench family: its rows build (shapes, bytes, FLOPs, implementations), ours adds the
wrapper's XLA bytes to the kernel's estimate, a peer that libtpu cannot estimate gets its roofline as a floor,
and the XLA baselines compute gated DeltaNet (against the float64 reference, at a small shape). No libtpu
estimate runs here (each takes minutes): a fake estimator answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpukernels.bench import linear_attention as bla
from tpukernels.bench.core import Case, EstimateError, run_case
from tpukernels.perf import clock_hz, hbm_bandwidth, model_time


class _FakeEstimator:
    def __init__(self, answer):
        self.answer, self.seen = answer, []

    def cycles(self, fn, structs, chip):
        self.seen.append([tuple(s.shape) for s in structs])
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_rows_cover_the_issue_shapes_chips_and_implementations():
    cases = bla.cases(["v5e", "v6e", "tpu7x"])
    assert [(c.op, c.shape) for c in cases[::3]] == [
        ("prefill fwd", "T=4096"), ("prefill fwd", "T=16384"), ("prefill fwd", "T=32768"),
        ("decode", "B=64"), ("decode", "B=256")]
    assert {c.chip for c in cases} == {"v5e", "v6e", "tpu7x"} and len(cases) == 15
    for c in cases:
        assert [i.name for i in c.impls] == ["tpukernels", "tpu-inference v3", "tpu-inference v2", "xla"]
        assert [i.kind for i in c.impls] == ["ours", "public", "public", "xla"]
    dec = next(c for c in cases if c.shape == "B=256")
    state = 256 * 32 * 128 * 128 * 4
    assert 2 * state < dec.hbm_bytes < 1.01 * 2 * state  # the decode roofline is the state read + write
    pre = next(c for c in cases if c.shape == "T=4096")
    assert pre.flops == 32 * 4096 * (4 * 64 * 128 + 2 * 64 * 128 + 6 * 128 * 128)


def test_prefill_is_benchmarked_at_the_chunk_a_call_gets():
    from tpukernels.library.linear_attention.gdn_ops import DEFAULT_CHUNK

    assert bla.CHUNK == DEFAULT_CHUNK


def test_ours_decode_scales_the_reduced_batch_and_adds_the_wrapper_bytes():
    (case,) = [c for c in bla.cases(["v6e"]) if c.shape == "B=64"]
    est = _FakeEstimator(1000)
    cycles, cfg = case.impls[0].cycles(est, "v6e")
    b = bla.DECODE_EST_B
    extra = int(bla.wrapper_bytes(64, False) / hbm_bandwidth("v6e") * clock_hz("v6e"))
    assert cycles == 1000 * (64 // b) + extra and extra > 0
    assert est.seen == [[(b,), (b, 1, 16, 128), (b, 1, 16, 128), (b, 1, 32, 128), (b, 1, 32), (b, 1, 32),
                         (b + 1, 32, 128, 128)]]
    assert "source" in cfg and f"x{64 // b}" in cfg["estimated"]


def test_a_peer_libtpu_cannot_estimate_gets_its_roofline_as_a_floor():
    (case,) = [c for c in bla.cases(["v6e"]) if c.shape == "B=64"]
    peer = case.impls[2]
    one = Case(case.family, case.op, case.shape, "v6e", case.hbm_bytes, case.flops, [peer])
    (row,) = run_case(one, _FakeEstimator(EstimateError("estimate server exited: bundle_analysis.cc:197")))
    assert row["figure"] == "floor" and "bundle_analysis" in row["error"]
    assert row["model_us"] == pytest.approx(model_time("v6e", None, case.hbm_bytes, case.flops).roofline_us)


def _inputs(T, H, HV, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, K, generator=g).bfloat16()
    gate = -torch.rand(1, T, HV, generator=g) * 0.5
    beta = torch.rand(1, T, HV, generator=g)
    return q, k, v, gate, beta


def test_xla_prefill_baseline_is_gated_deltanet(monkeypatch):
    import jax.numpy as jnp

    from tpukernels.library.linear_attention import gated_delta_rule_reference

    T, H, HV, K, C = 48, 2, 4, 128, 16
    q, k, v, g, beta = _inputs(T, H, HV, K)
    ref_o, ref_s = gated_delta_rule_reference(q, k, v, g, beta)
    hm = lambda x: jnp.asarray(x[0].transpose(0, 1).float().numpy(), jnp.bfloat16)  # noqa: E731
    col = lambda x: jnp.asarray(x[0].T.reshape(-1, 1).numpy())  # noqa: E731
    o, s = bla.xla_prefill(hm(q), hm(k), hm(v), col(g), col(beta), chunk=C)
    o = np.asarray(o.astype(jnp.float32)).transpose(1, 0, 2)
    np.testing.assert_allclose(o, ref_o[0].numpy(), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(s), ref_s[0].numpy(), atol=2e-3, rtol=2e-3)


def test_xla_decode_baseline_is_one_gated_deltanet_step():
    import jax.numpy as jnp

    from tpukernels.library.linear_attention import gated_delta_rule_reference

    B, H, HV, K = 3, 2, 4, 128
    q, k, v, g, beta = (x.transpose(0, 1) for x in _inputs(B, H, HV, K, seed=1))  # B rows of one token
    pool = torch.randn(B + 2, HV, K, K, generator=torch.Generator().manual_seed(2)) * 0.1
    idx = torch.tensor([4, 0, 2])
    ref_o, ref_s = gated_delta_rule_reference(q, k, v, g, beta, initial_state=pool[idx])
    j = lambda x: jnp.asarray(x[:, 0].float().numpy(), jnp.bfloat16)  # noqa: E731
    o, s = bla.xla_decode(jnp.asarray(idx.numpy(), jnp.int32), j(q), j(k), j(v), jnp.asarray(g[:, 0].numpy()),
                          jnp.asarray(beta[:, 0].numpy()), jnp.asarray(pool.numpy()))
    np.testing.assert_allclose(np.asarray(o.astype(jnp.float32)), ref_o[:, 0].numpy(), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), atol=2e-3, rtol=2e-3)


def test_reasons_name_the_lever_per_op():
    assert "VPU" in bla.reason({"op": "decode", "chip": "v6e", "shape": "B=64"})
    assert "chunk_size" in bla.reason({"op": "prefill fwd", "chip": "v5e", "shape": "T=4096"})
    assert bla.reason({"op": "other", "chip": "v6e", "shape": "-"}) is None
