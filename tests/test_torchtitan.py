"""TorchTitan integration: torchtitan 0.3.0's own Trainer on the llama3 debugmodel with tpukernels swapped in.

Everything torchtitan runs in a subprocess (tests/torchtitan_parity_worker.py): its CPU shims
(tpukernels.integrations.torchtitan_compat) install placeholder modules that must not leak into this process.
The trainer runs on CPU with gloo, world size 1, FSDP2 on a size-1 mesh (torchtitan always applies it), selective
activation checkpointing, synthetic documents (positions restart per document, so attention gets document
masks), seed 0. Reference: the same config with torchtitan's own modules (RMSNorm, SwiGLU FeedForward,
ComplexRoPE, chunked cross-entropy) and, for the inner attention, an eager float32 attention with the same
causal x document mask (torchtitan's flex / varlen attention need CUDA or an inductor build here).
The context-parallel test runs three workers at once: ours and torchtitan's own CP = 2, each over a 2-process
gloo group (torchrun), and a one-process reference.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan not installed (make torchtitan)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMON = ["--training.local_batch_size", "2", "--training.seq_len", "64", "--training.steps", "3"]


def start_worker(tmp_path, runs, extra=(), nproc=1):
    """The worker as a subprocess (under ``torch.distributed.run`` with ``nproc`` > 1: one gloo rank each)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                 if nproc > 1 else [])
    out = tmp_path / f"outputs{nproc}"
    out.mkdir()
    cmd = [*launch, str(ROOT / "tests" / "torchtitan_parity_worker.py"), *runs, "--", *COMMON, *extra,
           "--dump_folder", str(out)]
    # output to files, not pipes: two workers run at once and a full pipe would stall the one not being read
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, cwd=tmp_path, env=env,
                                start_new_session=True)
    proc.out = out
    return proc


def stop_worker(proc):
    """Kill a worker still running, with its process group (torchrun's ranks)."""
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


def worker_result(proc, timeout=900):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_worker(proc)
    stdout, stderr = (proc.out / "stdout").read_text(), (proc.out / "stderr").read_text()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed (rc {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def run_worker(tmp_path, runs, extra=()):
    return worker_result(start_worker(tmp_path, runs, extra))


def assert_losses_close(ref, ours, rtol):
    assert len(ref) == len(ours) == 3, (ref, ours)
    for step, (a, b) in enumerate(zip(ref, ours), 1):
        assert abs(a - b) <= rtol * abs(a), f"step {step}: reference {a!r} vs tpukernels {b!r} (rtol {rtol})"


def test_trainer_parity_fp32_converter_errors_and_selective_ac(tmp_path):
    """fp32 (FSDP param dtype float32), eager. Tolerance 2e-6 relative per step: both runs are float32; the
    kernels sum in another order (blocked softmax and logsumexp, row sums) and round once where torch rounds
    per op, ~1e-7 relative per op; over 6 layers and two AdamW updates (lr 8e-4) we observe <= 1.2e-7. A
    wrong mask, RoPE layout or loss scaling moves the loss by > 1e-3."""
    r = run_worker(tmp_path, ["checks", "llama3_debugmodel_cpu", "llama3_debugmodel_cpu_tpukernels"],
                   ["--training.mixed_precision_param", "float32"])
    ref = r["llama3_debugmodel_cpu"]["losses"]
    ours = r["llama3_debugmodel_cpu_tpukernels"]["losses"]
    assert_losses_close(ref, ours, 2e-6)
    assert ref[0] != ref[1]  # the optimizer really stepped

    c = r["checks"]
    swapped = c["llama3_report"]["swapped"]
    assert c["llama3_report"]["left"] == []
    for kind, n in (("TPUKernelsAttention", 6), ("TPUKernelsRMSNorm", 13), ("TPUKernelsFeedForward", 6),
                    ("TPUKernelsComplexRoPE", 6)):
        assert sum(s.endswith(f"-> {kind}.Config") for s in swapped) == n, (kind, swapped)
    # a model it does not know: typed error listing both what it would swap and what it leaves; nothing changed
    for name, left in (("qwen3_debugmodel", "leave 0"), ("qwen3_debugmodel_moe", "leave 8: layers.0.moe: MoE.Config")):
        msg = c[name]
        assert "Qwen3Model.Config is not one it knows" in msg and "would swap" in msg and left in msg, msg
        assert "RMSNorm.Config -> TPUKernelsRMSNorm.Config" in msg
        assert c[f"{name}_unchanged"] is True
    # torchtitan's SDPA inner attention (the context-parallel path's module) outside CP, against float64 SDPA
    sdpa_swapped = c["sdpa_report"]["swapped"]
    assert c["sdpa_report"]["left"] == [] and sum(
        s.endswith("ScaledDotProductAttention.Config -> TPUKernelsCausalAttention.Config") for s in sdpa_swapped) == 6
    assert c["sdpa_err_causal_True"] < 1e-5 and c["sdpa_err_causal_False"] < 1e-5, c
    assert "attention_masks are not supported" in c["sdpa_masks_error"], c["sdpa_masks_error"]
    # --override.imports with every factory (tpukernels.integrations.torchtitan.OVERRIDES) on llama3_debugmodel
    assert c["override_counts"] == {
        "TPUKernelsAttention.Config": 6, "TPUKernelsRMSNorm.Config": 13, "TPUKernelsFeedForward.Config": 6,
        "TPUKernelsComplexRoPE.Config": 6, "TPUKernelsLinearCrossEntropy.Config": 1,
        "TPUKernelsSelectiveAC.Config": 1}, c["override_counts"]
    # selective AC: the stock save list recomputes the attention forward in backward; ours saves it
    assert c["sac_attention_launches_stock"] == 2
    assert c["sac_attention_launches_tpukernels"] == 1


@pytest.mark.slow
def test_trainer_parity_bf16_mixed_precision_and_compile(tmp_path):
    """bf16 mixed precision (FSDP param dtype bfloat16, reduce float32), eager and under ``--compile.enable``
    (backend aot_eager: inductor's CPU C++ build is too slow for a test; the kernels are custom ops either way).
    Tolerance 5e-4 relative: both runs compute in bfloat16 (unit roundoff 2**-8), rounding in different places
    (the kernels round once from float32, torch per op); averaged over 128 tokens we observe <= 5e-5."""
    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    r = run_worker(tmp_path, ["llama3_debugmodel_cpu", "llama3_debugmodel_cpu_tpukernels",
                              "llama3_debugmodel_cpu_tpukernels+--compile.enable"],
                   [*bf16, "--compile.backend", "aot_eager"])
    ref = r["llama3_debugmodel_cpu"]["losses"]
    assert_losses_close(ref, r["llama3_debugmodel_cpu_tpukernels"]["losses"], 5e-4)
    assert_losses_close(ref, r["llama3_debugmodel_cpu_tpukernels+--compile.enable"]["losses"], 5e-4)


def test_context_parallel_ring_attention_parity(tmp_path):
    """``--parallelism.context_parallel_degree 2`` on a 2-process gloo group (torchrun), the tpukernels swaps
    with :class:`TPUKernelsCausalAttention` (torchtitan's CP wrapping hands it q / k / v as ``Shard(1)`` DTensors
    over the cp mesh; it runs ``ring_attention_torch`` on the "headtail" shards, which are its zigzag order),
    against

    * **torchtitan's own CP run**: its stock model (``ScaledDotProductAttention``, its own modules and loss) with
      the same CP degree, i.e. torch's SDPA ring attention (``torch.distributed.tensor.experimental``'s templated
      ring forward / backward, merger and headtail load balancing). torch registers that ring for the CUDA SDPA
      ops only; the worker's ``torch_cp_cpu`` (:func:`torchtitan_parity_worker.torch_cp_for_cpu_flash`) gives
      the same ring the CPU flash op as its per-block attention, with the ``Shard(2)`` strategy torch adds for
      the CUDA op (without it the run fails: the CPU op has no sharding strategy). The run reports how often
      torch's ring ran (its forward and backward must both have);
    * torchtitan's stock model in one process without CP,

    all on the same data (plain causal, one document per row) and weights. Same weights: the worker's
    ``full_init`` draws them as full tensors (torchtitan's CPU init draws each FSDP shard from the rank's
    generator). ``spmd_backend partial_dtensor``: torchtitan's default (spmd_types) refuses CP with SDPA.
    FlexAttention CP needs inductor; CP with varlen attention is refused by torchtitan.

    Tolerance 2e-6 relative per step (float32; each ring merges two blocks' softmax statistics per step, one
    more rounding than one fused kernel; we observe <= 1e-7 against both). Feeding the headtail shards to the
    ring as contiguous (``load_balance=False``) moves step 1 by 8e-5."""
    cp = ["--parallelism.spmd_backend", "partial_dtensor", "--training.mixed_precision_param", "float32"]
    cp2 = "+--parallelism.context_parallel_degree+2"
    runs = {"ours": (["full_init", "llama3_debugmodel_cpu_sdpa_tpukernels" + cp2], 2),
            "torch_cp": (["full_init", "torch_cp_cpu", "llama3_debugmodel_cpu_sdpa" + cp2], 2),
            "stock": (["full_init", "llama3_debugmodel_cpu_sdpa"], 1)}
    procs = {}
    try:
        for name, (args, nproc) in runs.items():
            (tmp_path / name).mkdir()
            procs[name] = start_worker(tmp_path / name, args, cp, nproc=nproc)
        got = {name: next(iter(worker_result(p, timeout=600).values())) for name, p in procs.items()}
    finally:
        for p in procs.values():
            stop_worker(p)
    ref = got["stock"]["losses"]
    assert got["torch_cp"]["torch_ring_calls"]["fwd"] > 0 and got["torch_cp"]["torch_ring_calls"]["bwd"] > 0
    assert_losses_close(got["torch_cp"]["losses"], got["ours"]["losses"], 2e-6)
    assert_losses_close(ref, got["ours"]["losses"], 2e-6)
    assert_losses_close(ref, got["torch_cp"]["losses"], 2e-6)
    assert ref[0] != ref[1]
