"""Subprocess body of tests/test_torchtitan.py (torchtitan stays out of the pytest process: its CPU shims
install placeholder modules).

    python tests/torchtitan_parity_worker.py [checks] [full_init] [torch_cp_cpu] RUN [RUN ...] -- <common args>

``full_init``: redraw the weights as full tensors (:func:`full_tensor_init`), for runs sharded differently.
``torch_cp_cpu``: torch's own SDPA context parallelism on the CPU flash op (:func:`torch_cp_for_cpu_flash`), so
torchtitan's stock model runs with ``--parallelism.context_parallel_degree`` on CPU (the reference CP run).
``checks``: the converter on models it does not know, and the selective-AC save list (kernel launch counts).
RUN is ``<config>[+<extra arg>...]`` with a config of tpukernels.integrations.torchtitan_compat, e.g.
``llama3_debugmodel_cpu`` (reference) or ``llama3_debugmodel_cpu_tpukernels``: torchtitan's own Trainer built
by its ConfigManager (the CLI parser), trained, every step's loss recorded at full precision (the log prints 5
digits). Prints one ``RESULT <json>`` line (rank 0). Under ``torchrun`` (context parallelism) each step's loss is
the sum of the ranks' partial losses, as torchtitan logs it.
"""

import json
import os
import sys
import time

from tpukernels.integrations import torchtitan_compat as compat

compat.main_env()
compat.install()

import torch  # noqa: E402


def checks() -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpukernels.errors import ArgumentError
    from tpukernels.integrations import torchtitan as tt
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3 import model_registry as llama3_registry
    from torchtitan.models.qwen3 import model_registry as qwen3_registry

    out = {}
    # 1. converter: the known model converts with nothing left; unknown models raise, listing both lists
    conv = tt.TPUKernelsConverter.Config().build()
    llama = conv.convert(llama3_registry("debugmodel").model)
    out["llama3_report"] = conv.report
    out["llama3_types"] = sorted({type(n).__name__ for _, n, _, _ in llama.traverse(
        (tt.TPUKernelsAttention.Config, tt.TPUKernelsRMSNorm.Config, tt.TPUKernelsFeedForward.Config,
         tt.TPUKernelsComplexRoPE.Config))})
    for name in ("debugmodel", "debugmodel_moe"):
        model = qwen3_registry(name).model
        before = repr(model)
        try:
            tt.TPUKernelsConverter.Config().build().convert(model)
            out[f"qwen3_{name}"] = "no error"
        except ArgumentError as e:
            out[f"qwen3_{name}"] = str(e)
            out[f"qwen3_{name}_unchanged"] = repr(model) == before
    # 1b. torchtitan's SDPA inner attention -> TPUKernelsCausalAttention (outside CP: flash_attention); bad input
    sdpa = tt.TPUKernelsConverter.Config().build()
    sdpa.convert(compat.llama3_debugmodel_cpu_sdpa().model_spec.model)
    out["sdpa_report"] = sdpa.report
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 32, h, 16, generator=g) for h in (4, 2, 2))  # [B, L, N, H], GQA 2:1
    attn = tt.TPUKernelsCausalAttention.Config().build()
    for causal in (True, False):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=causal, enable_gqa=True).transpose(1, 2)
        got = attn(q, k, v, scale=0.25 if causal else None, enable_gqa=True, is_causal=causal)  # 0.25 = 16**-0.5
        out[f"sdpa_err_causal_{causal}"] = float((got.double() - want).abs().max())
    try:
        attn(q, k, v, attention_masks=object())
        out["sdpa_masks_error"] = "no error"
    except ArgumentError as e:
        out["sdpa_masks_error"] = str(e)
    # 2. the --override.imports path on torchtitan's own llama3_debugmodel Trainer config
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    lines = apply_overrides(OverrideConfig(imports=tt.OVERRIDES.split(",")), llama3_debugmodel())
    out["override_counts"] = {}
    for line in lines:
        new_type = line.rsplit("-> ", 1)[1]
        out["override_counts"][new_type] = out["override_counts"].get(new_type, 0) + 1
    # 3. selective AC: count attention forward kernel launches in one forward + backward of a checkpointed block
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.tpukernels.flash_attention_fwd.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)
            self.attn = tt.TPUKernelsAttention.Config().build()

        def forward(self, x):
            q = self.proj(x).view(1, 16, 4, 16)
            return self.attn(q, q, q).sum()

    for name, cls in (("stock", SelectiveAC), ("tpukernels", tt.TPUKernelsSelectiveAC)):
        torch.manual_seed(0)
        block = cls(cls.Config())._wrap_block(Block())
        Count.n = 0
        with Count():
            block(torch.randn(1, 16, 64)).backward()
        out[f"sac_attention_launches_{name}"] = Count.n
    return out


RING_CALLS = {"fwd": 0, "bwd": 0}  # calls of torch's ring attention through torch_cp_for_cpu_flash, this rank


def torch_cp_for_cpu_flash() -> None:
    """torch's own SDPA context parallelism (its ring attention, softmax-statistics merger and "headtail" load
    balancing, ``torch.distributed.tensor.experimental._context_parallel``) extended to the CPU flash op, so that
    torchtitan's stock CP run exists on CPU as a reference. torch registers its ring dispatcher for the CUDA SDPA
    ops only (flash / efficient / cuDNN); here the same templated ring forward and backward get the CPU op
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) as their per-block attention, with
    the same ``Shard(2)`` sharding strategy torch adds for the CUDA flash op while CP is on. Nothing else of
    torch's CP changes; a test-side shim (torch's handler table is module state), installed before the trainer
    enables CP."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.placement_types import Replicate, Shard

    aten = torch.ops.aten
    fwd, bwd = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)

    @register_op_strategy(fwd)
    def _fwd_strategy(op_schema):  # (out, lse) from (q, k, v): all replicated or all sequence-sharded
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                               [[Replicate()] * 5, [Shard(2)] * 5], input_index=2)

    @register_op_strategy(bwd)
    def _bwd_strategy(op_schema):  # (dq, dk, dv) from (dout, q, k, v, out, lse)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                               [[Replicate()] * 9, [Shard(2)] * 9], input_index=3)

    def block_fwd(q, k, v, is_causal=False, dropout_p=0.0, scale=None):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)

    def block_bwd(grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)

    def ring_fwd(mesh, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        assert attn_mask is None
        return cp._templated_ring_attention(mesh.get_group(), 2, block_fwd, query=q, key=k, value=v,
                                            is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def ring_bwd(mesh, grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
        assert attn_mask is None
        return cp._templated_ring_attention_backward(
            mesh.get_group(), 2, block_bwd, grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v,
            out=out, logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def handler(op_call, args, kwargs):  # torch's _sdpa_handler with the CPU ops in its call table
        RING_CALLS["fwd" if op_call is fwd else "bwd"] += 1
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(info)
        sharding = info.output_sharding
        assert sharding is not None and not sharding.needs_redistribute
        ring = ring_fwd if op_call is fwd else ring_bwd
        local = ring(info.compute_mesh, *info.local_args, **info.local_kwargs)
        return DTensor._op_dispatcher.wrap(local, sharding.output_spec)

    cp.custom_ops[fwd] = handler
    cp.custom_ops[bwd] = handler


def full_tensor_init(model_parts, seed: int = 0) -> None:
    """Redraw every matrix parameter as a full tensor (normal, std 0.02, one generator over the parameters in
    name order) and keep this rank's shard: the same weights whatever the sharding. torchtitan's own init
    draws each shard from the rank's generator on CPU (torch's offset-based DTensor RNG is for accelerators),
    so an FSDP-over-cp run would otherwise start from other weights than a one-process run. Vectors (norm
    weights: ones) are deterministic already and stay."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted((n, p) for m in model_parts for n, p in m.named_parameters()):
            if p.dim() < 2:
                continue
            full = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)


argv = sys.argv[1:]
split = argv.index("--")
runs, common = argv[:split], argv[split + 1:]
results = {}
if runs and runs[0] == "checks":
    results["checks"] = checks()
    runs = runs[1:]
full_init = bool(runs) and runs[0] == "full_init"
runs = runs[1:] if full_init else runs
if runs and runs[0] == "torch_cp_cpu":
    torch_cp_for_cpu_flash()
    runs = runs[1:]
from torchtitan.config import ConfigManager  # noqa: E402

for run in runs:
    config_name, *extra = run.split("+")
    t0 = time.perf_counter()
    config = ConfigManager().parse_args(
        ["--module", "tpukernels.integrations." + ("torchtitan" if config_name.endswith("_tpukernels") else "torchtitan_compat"),
         "--config", config_name, *common, *extra])
    trainer = config.build()
    if full_init:
        full_tensor_init(trainer.model_parts)
    losses = []
    step = trainer.forward_backward_step

    def recording_step(*a, **k):
        loss = step(*a, **k)
        losses.append(float(loss.detach().double()))
        return loss

    trainer.forward_backward_step = recording_step
    trainer.train()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # each rank returns its tokens' loss sum / global tokens (torchtitan's convention): the step's loss is
        # their sum over the data + context parallel ranks (this worker runs no tensor / pipeline parallelism)
        total = torch.tensor(losses, dtype=torch.float64)
        torch.distributed.all_reduce(total)
        losses = total.tolist()
    trainer.close()
    results[run] = {"losses": losses, "seconds": round(time.perf_counter() - t0, 1),
                    "torch_ring_calls": dict(RING_CALLS)}
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT " + json.dumps(results), flush=True)
