"""DTensor sharding rules on a real 2-process gloo group (cpu DeviceMesh, loopback): sharded outputs and
gradients equal the single-process ones, with no collectives in the forward (nothing was gathered).

The group is spawned once per module (spawning dominates the time) by ``torch.multiprocessing``; every rank
runs the checks of tests/distributed_workers.py and writes its results, the test process asserts on them.
Bounded: the group is killed after ``TIMEOUT_S``.
"""

import json
import os
import socket
import time

import pytest
import torch

import tpukernels as tk
from tpukernels.distributed import PARTIAL, Split, TensorMeta, splits_for

TIMEOUT_S = 600  # ~50-70 s on a quiet 2-core machine; generous for a loaded one (a fresh clone under load took > 240 s)
CHECKS = ["dtensor_checks", "fsdp2_llama", "expert_parallel", "ring_attention_torch", "tensor_parallel", "async_tp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    import torch.multiprocessing as tmp

    from distributed_workers import worker

    out = tmp_path_factory.mktemp("gloo")
    ctx = tmp.start_processes(worker, args=(2, _free_port(), str(out), CHECKS), nprocs=2, join=False,
                              start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the 2-process gloo group did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert "error" not in r, f"rank {r['rank']} failed:\n{r['error']}"
    return ranks


def test_two_process_group_dtensor_ops_fsdp2_expert_parallel_ring_attention_and_tensor_parallel(group_results):
    """One test for the whole group (xdist would spawn a group per worker otherwise)."""
    # DTensor ops: sharded outputs and gradients equal the single-process ones, computed on the local shards
    names = [c["name"] for c in group_results[0]["dtensor_checks"]]
    assert len(names) >= 7 and {"flash_attention heads", "matmul column-parallel (N)"} <= set(names)
    for rank in group_results:
        for c in rank["dtensor_checks"]:
            assert c["out_err"] < 1e-5, c
            assert c["grad_err"] and max(c["grad_err"].values()) < 1e-5, c
            assert c["fwd_collectives"] == 0, c  # nothing gathered in the forward
            assert all("Shard" in p for p in c["out_placements"]), c
    # FSDP2: the tpukernels-patched tiny Llama trains to the stock FSDP2 loss
    for rank in group_results:
        stock, ours = rank["fsdp2_llama"]["stock"], rank["fsdp2_llama"]["tpukernels"]
        assert ours["counts"]["attention"] and ours["counts"]["rms_norm"] == 5 and ours["norm_module"] == "TPURMSNorm"
        assert stock["param_placements"] == ours["param_placements"] == "(Shard(dim=0),)"  # FSDP2-sharded
        torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-4, atol=1e-5)
        assert ours["losses"][-1] < ours["losses"][0] - 0.05  # it trained
    assert group_results[0]["fsdp2_llama"] == group_results[1]["fsdp2_llama"]  # the mean loss is one number
    # expert parallelism (tpukernels.distributed.expert_parallel): dispatch -> local experts -> combine equals
    # single-device top-k MoE, gradients included (dW collects the other rank's tokens through the all-to-all)
    for rank in group_results:
        ep = rank["expert_parallel"]
        for case in ("random", "skew"):
            c = ep[case]
            assert max(c["out"], c["dx"], c["dw"], c["dW"]) < 1e-5, (rank["rank"], case, c)
            assert c["sizes"] == c["want_sizes"] and c["rows"] == sum(c["want_sizes"]), c
        tt = ep["torchtitan"]  # as TorchTitan's own AllToAllTokenDispatcher, through our token dispatcher
        assert tt["sizes_equal"] and max(tt["out"], tt["dx"], tt["dscores"], tt["dW"]) < 1e-5, tt
        assert "divisible by the group size 2" in ep["errors"]["indivisible"], ep["errors"]
        assert "disagree on x.shape[1]" in ep["errors"]["hidden_mismatch"], ep["errors"]  # every rank raised
        assert "disagree on x.dim()" in ep["errors"]["x_3d_on_one_rank"], ep["errors"]
        assert "disagree on expert ids in [0, num_experts)" in ep["errors"]["ids_out_of_range_on_one_rank"], ep
    assert group_results[1]["expert_parallel"]["skew"]["rows"] == 0  # rank 1 received nothing and combined
    # context parallelism from torch: ring attention over the group equals float64 dense attention, gradients too
    for rank in group_results:
        for case, errs in rank["ring_attention_torch"].items():
            assert max(errs.values()) < 2e-5, (rank["rank"], case, errs)
    # tensor parallelism with collective matmuls: tpukernels' styles and torch's on the same sequence-parallel MLP
    # both equal float64 (output, dx, every parameter's gradient); torch's plan gathers and reduce-scatters the
    # activations, ours passes them on a ring inside the matmuls (p2p; CommDebugMode lists only the rank checks)
    for rank in group_results:
        tp = rank["tensor_parallel"]
        for style in ("tpukernels", "torch"):
            c = tp[style]
            assert max(c["out"], c["dx"], *c["grads"].values()) < 1e-5, (rank["rank"], style, c)
            assert c["out_shape"] == [2, 8, 128] and len(c["grads"]) == 4, c
        assert tp["tpukernels"]["placements"] == tp["torch"]["placements"]  # parameters sharded as torch's styles
        assert tp["torch"]["fwd_comms"] == {"c10d_functional.all_gather_into_tensor": 1,
                                            "c10d_functional.reduce_scatter_tensor": 1}, tp["torch"]
        assert tp["tpukernels"]["fwd_comms"] == {"c10d.allgather_": 2}, tp["tpukernels"]  # one rank check per linear
        for style in ("group", "group_torch"):  # wq / wk / wv from one gathered input; wv through the fallback
            c = tp[style]
            assert max(c["out"], c["dx"], *c["grads"].values()) < 1e-5, (rank["rank"], style, c)
            assert len(c["grads"]) == 7, c
        assert tp["group"]["fwd_comms"] == {"c10d.allgather_": 2}, tp["group"]  # one ring for the three weights
        assert "c10d_functional.all_gather_into_tensor" in tp["group_torch"]["fwd_comms"], tp["group_torch"]
        for op in ("ag_bf16", "rs_bf16"):  # bf16 operands, float64 reference from them: the bf16 output rounding
            assert max(tp[op].values()) < 1e-2, (rank["rank"], op, tp[op])
        errs = tp["errors"]
        assert "must be divisible by the group size 2" in errs["indivisible"], errs
        assert "contraction dims differ" in errs["contraction"] and "the contraction dim K" in errs["last_dim"], errs
        assert "disagree on x.shape[0]" in errs["rank_mismatch"], errs  # raised on every rank, none hangs
        assert "applies to nn.Linear modules" in errs["not_linear"], errs
        assert "has no nn.Linear 'w_nope'" in errs["group_missing"], errs
        assert tp["group_missing_left_plain"]  # every name is checked before any parameter is distributed
        # ranks whose own checks would disagree (one rank's x 3-D, indivisible on one rank, another dtype): the ranks
        # are compared first, so both raise, naming the field (before: one rank raised, the other hung or aborted)
        assert "disagree on x.dim()" in errs["ndim_mismatch"], errs
        assert "disagree on x.shape[0] " in errs["rank_indivisible"] + " ", errs
        assert "disagree on x.dtype" in errs["dtype_mismatch"], errs
        # torch.autocast: the matmuls run in bf16 as torch's styles' do, gradients reach the f32 weights
        ac = tp["autocast"]
        assert ac["dtypes"] == ["torch.bfloat16", "torch.bfloat16"], ac
        assert max(ac["out"], ac["dx"], *ac["grads"].values()) < 2e-2 and ac["ref_out"] < 2e-2, ac
    # PyTorch's async-TP ops on our collective matmuls (torch has no cpu kernel for them before the registration),
    # and TorchTitan's fused TP linears (its dist_gemm SwiGLU FFN) running on them: all equal float64
    for rank in group_results:
        at = rank["async_tp"]
        assert at["cpu_kernel_before"] is False and at["registered"] == ["CPU"] and at["registered_again"] == [], at
        assert at["ag_A"] == 0 and at["ag_no_A"] is True, at
        assert max(at[k] for k in ("ag_outs", "ag_last_dim", "rs_sum", "rs_avg", "rs_last_dim")) < 1e-5, at
        assert max(at["titan_ffn"].values()) < 1e-5, at
        # TorchTitan's dist_gemm modules themselves (built from their configs, spmd_types backend)
        mods = at["titan_modules"]
        assert len(mods["ffn"]) == 5 and len(mods["row_parallel"]) == 4, mods
        assert max(*mods["ffn"].values(), *mods["row_parallel"].values()) < 1e-5, mods
        errs = at["errors"]
        assert "reduce_op must be one of ('sum', 'avg'), got 'max'" in errs["reduce_op"], at
        # on every rank, none left blocked in the ring: one rank's bad reduce_op, different ones, different shapes
        assert "disagree on reduce_op" in errs["reduce_op_one_rank"] and "disagree on reduce_op" in \
            errs["reduce_op_differs"], at
        assert "disagree on x.shape[0]" in errs["rank_mismatch"], at
        assert "must share one of bfloat16, float16, float32" in errs["last_dim_dtype"], at
        assert "every B must be [K, N] with K = 12" in errs["last_dim_k"], at


# ------------------------------------------------------------------------------------------ rules (no group)
def _meta(*shape, dtype=torch.float32):
    return TensorMeta(shape, dtype)


def test_rules_from_rows_and_from_the_library_table():
    import tpukernels.library  # noqa: F401
    from tpukernels.dsl.kernel import REGISTRY

    bwd = REGISTRY["tpukernels::rms_norm_bwd"]
    (s,) = splits_for(bwd, {"dy": _meta(16, 256), "x": _meta(16, 256), "rstd": _meta(16, 1),
                            "weight": _meta(1, 256), "dres": None, "offset": 0.0})
    assert dict(s.inputs) == {"dy": 0, "x": 0, "rstd": 0} and tuple(s.outputs) == (0, PARTIAL)  # dweight: a sum
    fa = REGISTRY["tpukernels::flash_attention_fwd"]
    batch, heads = splits_for(fa, {"q": _meta(2, 4, 128, 64), "k": _meta(2, 2, 128, 64), "v": _meta(2, 2, 128, 64),
                                   "q_segment_ids": _meta(2, 1, 128), "kv_segment_ids": _meta(2, 1, 128)})
    assert batch.inputs["q_segment_ids"] == 0 and "q_segment_ids" not in heads.inputs
    mm = REGISTRY["tpukernels::matmul_nt"]
    args = {"a": _meta(1, 64, 128), "bt": _meta(1, 256, 128), "bias": _meta(1, 256), "activation": None,
            "out_dtype": None, "reduce_batch": False}
    got = {tuple(sorted(s.inputs.items())): tuple(s.outputs) for s in splits_for(mm, args)}
    assert got == {(("a", 1),): (1,), (("bias", 1), ("bt", 1)): (2,)}  # M, N (no batch > 1, no K with a bias)
    no_bias = splits_for(mm, {**args, "bias": None})
    assert Split({"a": 2, "bt": 2}, (PARTIAL,)) in no_bias  # K-parallel: partial sums, f32 output only
    assert Split({"a": 2, "bt": 2}, (PARTIAL,)) not in splits_for(mm, {**args, "bias": None, "out_dtype": "bfloat16"})


def test_user_kernel_declares_its_sharding():
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    @tk.tpu_kernel(body, namespace="tktest_dist", sharding=[Split({"x": 1}, (1,))])
    def double_cols(x: torch.Tensor) -> torch.Tensor:
        spec = pl.BlockSpec(x.shape, lambda: (0, 0))
        return tk.Launch(grid=(), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))

    assert splits_for(double_cols, {"x": _meta(8, 128)}) == [Split({"x": 1}, (1,))]


def test_rules_register_when_dtensor_loads_after_tpukernels():
    import subprocess
    import sys

    code = (
        "import sys, torch, tpukernels.library\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'import tpukernels loaded DTensor'\n"
        "from torch.distributed.tensor import DTensor\n"
        "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "ops = torch.ops.tpukernels\n"
        "missing = [n for n in ('rms_norm_fwd', 'rms_norm_bwd', 'layer_norm_bwd', 'flash_attention_fwd',\n"
        "           'flash_attention_bwd_dkv', 'matmul_nn', 'matmul_tn') if getattr(ops, n).default not in funcs]\n"
        "assert not missing, missing\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_library_kernel_has_a_rule_and_new_ops_split_sensibly():
    import tpukernels.library  # noqa: F401
    from tpukernels.distributed.sharding import rule_for
    from tpukernels.dsl.kernel import REGISTRY

    lib = {q: k for q, k in REGISTRY.items() if k.namespace == "tpukernels"}
    assert [q for q, k in lib.items() if rule_for(k) is None] == []
    if "tpukernels::grouped_matmul_fwd" in lib:
        got = splits_for(lib["tpukernels::grouped_matmul_fwd"], {
            "group_sizes": _meta(4, dtype=torch.int32), "group_offset": _meta(dtype=torch.int32),
            "lhs": _meta(256, 128, dtype=torch.bfloat16), "rhs": _meta(4, 128, 256, dtype=torch.bfloat16),
            "transpose_rhs": False, "out_dtype": None})
        assert got == [Split({"rhs": 2}, (1,))]  # never over rows (group sizes index the global rows)
    if "tpukernels::grouped_matmul_quant_fwd" in lib:  # quantized experts: over N with the scales, never K
        got = splits_for(lib["tpukernels::grouped_matmul_quant_fwd"], {
            "group_sizes": _meta(4, dtype=torch.int32), "group_offset": _meta(dtype=torch.int32),
            "lhs": _meta(256, 256, dtype=torch.bfloat16), "rhs": _meta(4, 512, 128, dtype=torch.uint8),
            "rhs_scale": _meta(4, 2, 1, 512), "rhs_zero_point": _meta(4, 2, 1, 512), "transpose_rhs": True,
            "out_dtype": None, "weight_format": "int4"})
        assert got == [Split({"rhs": 1, "rhs_scale": 3, "rhs_zero_point": 3}, (1,))]
    if "tpukernels::ragged_paged_attention_kernel" in lib:
        from tpukernels.distributed.sharding import _MESH_SHAPE

        rpa = lib["tpukernels::ragged_paged_attention_kernel"]
        args = {"kv_lens": _meta(2, dtype=torch.int32), "page_indices": _meta(2, 4, dtype=torch.int32),
                "cu_q_lens": _meta(3, dtype=torch.int32), "num_seqs": _meta(1, dtype=torch.int32),
                "q": _meta(64, 8, 128), "kv_cache": _meta(16, 16, 4, 128)}  # Hkv = 2
        for mesh, want in (((2,), [Split({"q": 1, "kv_cache": 2}, (1,))]), ((4,), [])):  # 4: K/V pairs split
            token = _MESH_SHAPE.set(mesh)
            try:
                assert splits_for(rpa, args) == want, mesh
            finally:
                _MESH_SHAPE.reset(token)
    if "tpukernels::linear_cross_entropy_bwd_dw" in lib:
        (s,) = splits_for(lib["tpukernels::linear_cross_entropy_bwd_dw"], {
            "h": _meta(64, 128), "w": _meta(512, 128), "labels": _meta(64, 1, dtype=torch.int32),
            "lse": _meta(64, 2), "g": _meta(64, 1), "ignore_index": -100, "softcap": None})  # lse: the (hi, lo) pair
        assert s.inputs == {"h": 0, "labels": 0, "lse": 0, "g": 0} and tuple(s.outputs) == (PARTIAL,)


def test_rules_of_masked_attention_blockwise_matmul_and_rope():
    import tpukernels.library  # noqa: F401
    from tpukernels.dsl.kernel import REGISTRY

    masked = REGISTRY["tpukernels::flash_attention_masked_fwd"]
    base = {"q": _meta(2, 8, 256, 128), "k": _meta(2, 8, 256, 128), "v": _meta(2, 8, 256, 128),
            "bwd_table": _meta(3, 1, 2, 2, dtype=torch.int32)}
    one_head = splits_for(masked, {**base, "fwd_table": _meta(3, 1, 2, 2, dtype=torch.int32)})
    assert Split({"q": 1, "k": 1, "v": 1}, (1, 1)) in one_head
    multi = splits_for(masked, {**base, "fwd_table": _meta(3, 8, 2, 2, dtype=torch.int32)})
    assert multi == [Split({"q": 0, "k": 0, "v": 0}, (0, 0))]  # per-head tables index the global head
    bw = splits_for(REGISTRY["tpukernels::quantized_matmul_blockwise_kernel"], {
        "x": _meta(64, 256), "w_q": _meta(512, 128, dtype=torch.uint8), "w_scale": _meta(2, 1, 512),
        "w_zero_point": _meta(2, 1, 512), "block_size": 128})
    assert bw == [Split({"x": 0}, (0,)), Split({"w_q": 0, "w_scale": 2, "w_zero_point": 2}, (1,))]  # never K
    rope = splits_for(REGISTRY["tpukernels::rope_fwd"], {
        "x": _meta(2, 16, 8, 64), "cos": _meta(1, 16, 64), "sin": _meta(1, 16, 64), "seq_dim": 1})
    assert rope == [Split({"x": 2}, (2,)), Split({"x": 1, "cos": 1, "sin": 1}, (1,)), Split({"x": 0}, (0,))]
