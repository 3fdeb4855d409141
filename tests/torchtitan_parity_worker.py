"""Subprocess body of tests/test_torchtitan.py (torchtitan stays out of the pytest process: its CPU shims
install placeholder modules).

    python tests/torchtitan_parity_worker.py [checks] RUN [RUN ...] -- <common torchtitan args>

``checks``: the converter on models it does not know, and the selective-AC save list (kernel launch counts).
RUN is ``<config>[+<extra arg>...]`` with a config of tpukernels.integrations.torchtitan_compat, e.g.
``llama3_debugmodel_cpu`` (reference) or ``llama3_debugmodel_cpu_tpukernels``: torchtitan's own Trainer built
by its ConfigManager (the CLI parser), trained, every step's loss recorded at full precision (the log prints 5
digits). Prints one ``RESULT <json>`` line.
"""

import json
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


argv = sys.argv[1:]
split = argv.index("--")
runs, common = argv[:split], argv[split + 1:]
results = {}
if runs and runs[0] == "checks":
    results["checks"] = checks()
    runs = runs[1:]
from torchtitan.config import ConfigManager  # noqa: E402

for run in runs:
    config_name, *extra = run.split("+")
    t0 = time.perf_counter()
    config = ConfigManager().parse_args(
        ["--module", "tpukernels.integrations." + ("torchtitan" if config_name.endswith("_tpukernels") else "torchtitan_compat"),
         "--config", config_name, *common, *extra])
    trainer = config.build()
    losses = []
    step = trainer.forward_backward_step

    def recording_step(*a, **k):
        loss = step(*a, **k)
        losses.append(float(loss.detach().double()))
        return loss

    trainer.forward_backward_step = recording_step
    trainer.train()
    trainer.close()
    results[run] = {"losses": losses, "seconds": round(time.perf_counter() - t0, 1)}
print("RESULT " + json.dumps(results), flush=True)
