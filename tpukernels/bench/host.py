"""Host-side costs on this CPU: wall-clock **measurements** (not models), cpu target, fast interpret mode.

1. Dispatch overhead per op: a library kernel called as a torch op (``kernel(...)``: argument binding,
   the torch dispatcher, tpukernels' cached plan, DLPack in and out) vs the same jitted JAX function
   called directly on JAX arrays (overhead = the difference), and vs its compiled executable (the floor). Best of 7 means over ``n`` calls (min: least disturbed by other
   processes). ``benchmarks/dispatch_overhead.py`` breaks the vector-add case down further.
2. Compile latency per library kernel, first call in a fresh process: **cold** (empty JAX persistent
   compilation cache) and **warm** (a new process reusing the cache the cold run wrote,
   ``JAX_COMPILATION_CACHE_DIR``). Tracing the Pallas kernel still happens warm; only XLA's compile is
   cached.
3. Recompiles under ``torch.compile(dynamic=True)`` over 8 sequence lengths: dynamo frames and tpukernels
   lowerings (``rms_norm`` buckets rows, ``flash_attention`` its sequence lengths: 4 buckets per power of
   two, one lowering per bucket).
4. Autotune executors: candidates per second of inline, process and Ray sweeps
   (:mod:`tpukernels.bench.executors`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

KIND = "wall-clock measurement on this machine's CPU (cpu target, fast interpret mode); not a TPU figure"

_FIRST_CALL = {
    "rms_norm": "L.rms_norm(torch.randn(256, 1024), torch.randn(1024))",
    "layer_norm": "L.layer_norm(torch.randn(256, 1024), torch.randn(1024), torch.randn(1024))",
    "matmul": "L.matmul(torch.randn(256, 512), torch.randn(512, 256))",
    "flash_attention": "L.flash_attention(torch.randn(1, 4, 256, 64), torch.randn(1, 2, 256, 64), "
                       "torch.randn(1, 2, 256, 64), causal=True)",
}

_CHILD = """
import time
t0 = time.perf_counter()
import torch, tpukernels.library as L
t1 = time.perf_counter()
out = {expr}
t2 = time.perf_counter()
out = {expr}
t3 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{t2 - t1:.3f}} {{t3 - t2:.4f}}", flush=True)
import os
os._exit(0)  # skip interpreter teardown (an XLA thread can abort it after the figures are out)
"""


def best_mean_us(fn, n: int, repeats: int = 7) -> float:
    """Best (min) over ``repeats`` of the mean µs per call over ``n`` calls, after a warm-up (min: least
    disturbed by other processes on a shared machine)."""
    for _ in range(min(n, 200)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return min(samples)


def dispatch(n: int = 1000) -> list[dict]:
    """Per op: µs/call of the torch op, the jitted JAX function and its compiled executable (JAX arrays in);
    ``overhead_us`` = torch op - jitted JAX."""
    import jax
    import torch

    import tpukernels as tk
    import tpukernels.library  # noqa: F401
    from tpukernels.library import attention as A
    from tpukernels.library import norms as N
    from tpukernels.lowering import lower, specs_from_values

    mm = sys.modules["tpukernels.library.matmul_ops"]
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cases = [
        ("rms_norm", N.rms_norm_fwd, (r(256, 1024), r(1, 1024)),
         {"eps": 1e-6, "offset": 0.0, "casting": "llama", "round_f16": False}),
        ("matmul", mm.matmul_nn, (r(1, 256, 256), r(1, 256, 256)), {}),
        ("flash_attention", A.fa_forward, (r(1, 2, 256, 64), r(1, 2, 256, 64), r(1, 2, 256, 64)), dict(A.CAUSAL)),
    ]
    rows = []
    with tk.interpret_mode("fast"):
        for name, kernel, args, kwargs in cases:
            kernel(*args, **kwargs)  # build and cache the plan
            specs, statics = specs_from_values(kernel, kernel.bind(list(args), kwargs))
            low = lower(kernel, specs, statics, None, mode="fast")
            compiled = low.compiled()
            jargs = [jax.dlpack.from_dlpack(a) for a in args]
            t_compiled = best_mean_us(lambda: jax.block_until_ready(compiled(*jargs)), n)
            t_jit = best_mean_us(lambda: jax.block_until_ready(low.fn(*jargs)), n)
            t_op = best_mean_us(lambda: kernel(*args, **kwargs), n)
            rows.append({"kernel": name, "shapes": [list(a.shape) for a in args], "torch_op_us": t_op,
                         "jax_jit_us": t_jit, "jax_compiled_us": t_compiled, "overhead_us": t_op - t_jit})
    return rows


class _NoOpJaxCallable:
    """A stand-in for torch_tpu's ``JaxCallable`` (same constructor) whose call returns preallocated outputs:
    what remains of a tpu-path call is tpukernels' own work plus the torch dispatcher."""

    def __init__(self, name, jit_fn, trace_key, donate_argnums=None, **_):
        self.jit_fn, self.outs = jit_fn, None

    def __call__(self, *tensors):
        if self.outs is None:
            import jax
            import torch

            from ..dsl.dtypes import to_jax_dtype, to_torch_dtype

            structs = [jax.ShapeDtypeStruct(tuple(t.shape), to_jax_dtype(t.dtype)) for t in tensors]
            self.outs = tuple(torch.zeros(o.shape, dtype=to_torch_dtype(o.dtype))
                              for o in jax.eval_shape(self.jit_fn, *structs))
        return self.outs


def tpu_dispatch(n: int = 2000) -> list[dict]:
    """tpukernels' own cost per call on the tpu path, with a no-op runner (µs; measured on this CPU).

    The torch op of a kernel goes through binding, the plan lookup, row padding and output slicing into
    torch_tpu's ``JaxCallable``, replaced here by :class:`_NoOpJaxCallable`. Baseline: an empty
    ``torch.library.custom_op`` with the same tensor arguments returning a preallocated tensor (the torch
    dispatcher alone, with the same schema less tpukernels' ``config`` argument). ``added_us`` = op -
    baseline; target 10 µs (issue 13).
    """
    import types

    import torch

    from ..library import norms as N
    from ..targets import cpu as cpu_target
    from ..targets import tpu as tpu_target

    from ._host_kernels import add, empty1, empty2, empty_rms, scale_rows

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x8, w = r(8, 128), r(1, 128)
    cases = [
        ("2 inputs (no padding)", lambda: add(x8, x8), lambda: empty2(x8, x8)),
        ("rows 100 -> bucket 104 (pad + slice)", (lambda x: lambda: scale_rows(x))(r(100, 128)), lambda: empty1(x8)),
        ("library op rms_norm_fwd (5 statics)",
         lambda: N.rms_norm_fwd(x8, w, 1e-6, 0.0, "llama", False), lambda: empty_rms(x8, w, 1e-6, 0.0, "llama", False)),
    ]
    fake = types.ModuleType("torch_tpu._internal.pallas.pallas")
    fake.JaxCallable = _NoOpJaxCallable
    mods = {m: types.ModuleType(m) for m in ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.pallas")}
    mods["torch_tpu._internal.pallas.pallas"] = fake
    saved = {m: sys.modules.get(m) for m in mods}
    real_cpu = cpu_target.run_torch_cpu
    rows = []
    try:
        sys.modules.update(mods)
        cpu_target.run_torch_cpu = tpu_target.run_torch_tpu  # route cpu tensors through the tpu path
        for label, call, base in cases:
            t_op = best_mean_us(call, n)
            t_base = best_mean_us(base, n)
            rows.append({"case": label, "torch_op_us": t_op, "empty_custom_op_us": t_base,
                         "added_us": t_op - t_base, "target_us": 10.0})
    finally:
        cpu_target.run_torch_cpu = real_cpu
        for m, v in saved.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v
        for k in (add, scale_rows, N.rms_norm_fwd):
            for key in [key for key in k._plans if key[0] == "mosaic"]:
                del k._plans[key]
    return rows


def compile_latency() -> list[dict]:
    """Per kernel: import, cold first call, warm first call (persistent cache), second call; seconds."""
    rows = []
    for name, expr in _FIRST_CALL.items():
        with tempfile.TemporaryDirectory(prefix="tpk_jaxcache_") as cache:
            env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            times, entries = [], 0
            for run in ("cold", "warm"):
                proc = subprocess.run([sys.executable, "-c", _CHILD.format(expr=expr)], env=env, capture_output=True,
                                      text=True, timeout=900)
                if proc.returncode != 0:
                    raise RuntimeError(f"{name}: {proc.stderr[-2000:]}")
                times.append([float(t) for t in proc.stdout.split()[-3:]])
                if run == "cold":  # what the warm run can reuse
                    entries = sum(len(files) for _, _, files in os.walk(cache))
        (imp, cold, again), (_, warm, _) = times
        rows.append({"kernel": name, "call": expr, "import_s": imp, "first_call_cold_s": cold,
                     "first_call_warm_s": warm, "cache_entries": entries, "second_call_s": again})
    return rows


def recompiles() -> list[dict]:
    """Per kernel: dynamo frames and tpukernels lowerings over 8 lengths under ``torch.compile(dynamic=True)``."""
    import torch
    import torch._dynamo.testing

    import tpukernels.library as L
    from tpukernels.library import attention as A
    from tpukernels.library import norms as N

    lengths = [100, 117, 128, 150, 200, 233, 256, 300]
    w = torch.randn(256)
    cases = [
        ("rms_norm", "rows", N.rms_norm_fwd, lambda x: L.rms_norm(x, w), lambda s: (torch.randn(s, 256),)),
        ("flash_attention", "Sq = Skv", A.fa_forward, lambda q, k, v: L.flash_attention(q, k, v, causal=True),
         lambda s: tuple(torch.randn(1, 2, s, 64) for _ in range(3))),
    ]
    rows = []
    for name, axis, kernel, fn, make in cases:
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        op = torch.compile(fn, dynamic=True, backend=counter)
        before = len(kernel._entries)
        t0 = time.perf_counter()
        for s in lengths:
            op(*make(s))
        rows.append({"kernel": name, "varying": axis, "lengths": lengths, "dynamo_frames": counter.frame_count,
                     "kernel_lowerings": len(kernel._entries) - before, "seconds": time.perf_counter() - t0})
    return rows


def run(log=print) -> dict:
    """All host figures; ``{"rows": [...], "dispatch": [...], "compile": [...], "recompiles": [...]}``."""
    log("== host: recompiles under torch.compile(dynamic=True)")
    r = recompiles()  # first: nothing lowered in this process yet
    log("== host: dispatch overhead")
    d = dispatch()
    log("== host: tpu-path dispatch with a no-op runner")
    t = tpu_dispatch()
    log("== host: cold / warm compile latency (fresh processes)")
    c = compile_latency()
    log("== host: autotune executors, candidates per second (inline, process, ray)")
    from .executors import run as executors_run

    e = executors_run(log=log)
    rows = [dict(r_, what="dispatch") for r_ in d] + [dict(r_, what="tpu_dispatch") for r_ in t] + \
        [dict(r_, what="compile") for r_ in c] + [dict(r_, what="recompiles") for r_ in r] + \
        [dict(r_, what="executors") for r_ in e]
    return {"rows": rows}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
