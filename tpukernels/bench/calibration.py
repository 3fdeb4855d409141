"""Calibration family: the libtpu model against tokamax's **measured** TPU times.

tokamax (0.0.12) ships autotuning caches with TPU timings measured by its autotuner,
``tokamax/data/autotuning/<chip dir>/<op>.json``. Each file is one JSON object (an empty file: no rows)::

    {"<argument key>": {"<config key>": {"evaluation_times_ms": [t, ...], "compile_time_ms": ...,
                                         "lower_time_ms": ..., "metadata": {...}}}}

where ``<argument key>`` is a JSON string of the op's arguments (arrays as ``"bf16[B,S,H,D]"``, the mask as
``{"is_causal": ..., ...}``) and ``<config key>`` a JSON string of the kernel config measured (attention:
``block_q, block_kv, block_kv_compute, q/k/v_layout`` (1 = head dim minor, 2 = sequence minor),
``use_experimental_scheduler, use_base2_exp``). Each argument key holds the one config tokamax's autotuner
kept (some hold none: no row). These fields (and only these) are relied on here; anything else
raises :class:`TokamaxFormatError`. Chip folders: ``tpu7x``, ``tpu_v5_lite`` (v5e); the 0.0.12 wheel
ships no v6e or v5p folder, and on v5e only ragged_dot timings.

For each measured tokamax flash-attention forward row near tpukernels' attention shapes (``D=128``, 16 heads
at S = 1k, 4k, 8k, 16k, causal and not, and the one GQA row ``Hq=32, Hkv=8, S=4096``), the fastest measured
config is modelled exactly like the benchmark rows (:class:`~tpukernels.bench.core.Estimator` +
:func:`tpukernels.perf.model_time`, the same bytes and FLOPs as ``bench/attention.py``), and:

* ``ratio = tokamax model / tokamax measured``; the model is **credible** at that row when the ratio lies in
  :data:`CREDIBLE_RANGE` (0.7-1.3);
* where credible, tpukernels' ``fa_forward`` is modelled at the same shape (its own config) and its
  **implied real time** is ``our model / ratio``; ``measured / implied`` above 1 means tpukernels would be faster.

The same for tokamax's measured **backward** (``pallas_mosaic_tpu_flash_attention_vjp.json``, :data:`VJP_OP`:
dQ, dK, dV from q, k, v, o, dO and the logsumexp, at the same shapes): tokamax's program is what
``PallasMosaicTpuFlashAttentionVjp._fwd`` runs (:func:`tokamax_vjp_fn`: splash's fused backward kernel, the
``rowsum(o * dO)`` and the layout swaps), ours the backward a call runs on the chip
(:func:`tpukernels.bench.attention.bwd_kernels`: the fused kernel or dQ + dK/dV) with its XLA ops (the rowsum;
the fused kernel's f32 dQ sliced and cast). Both get the same bytes and FLOPs (:func:`attention_bytes_flops`).
Without a mask, a program libtpu cannot estimate at the row's length is estimated at half of it, and scaled by
4 (:func:`at_shorter_seq`; ours at tokamax's length or shorter); each such row's ``flags`` says so.

tokamax's kernel is its splash attention (``tokamax/_src/ops/experimental/tpu/splash_attention``), called
here the way ``PallasMosaicTpuFlashAttention._fwd`` calls it (scale q, ``[B,S,H,D] -> [B,H,S,D]``,
``make_splash_mha`` with the measured config, ``vmap`` over the batch). That module is not imported: it and
``tokamax/__init__`` need packages outside the tested set (immutabledict, jaxtyping, qwix), and it registers
only on a TPU backend; the splash modules import jax and numpy only and are loaded without the package
``__init__``. Estimates run at one batch and 2 KV heads (:func:`reduced_problem`), scaled back (linear:
``benchmarks/attention.py --check-scaling``).

One deviation from the measured program: libtpu 0.0.52's static profiler aborts on splash's base-2 exponent
(``use_base2_exp=True``, every shipped config), so tokamax's kernel is modelled with ``use_base2_exp=False``
(:data:`MODEL_OVERRIDES`): ``exp(x)`` instead of ``exp2(x * log2 e)``, the same EUP work per score, one VPU multiply
fewer. With a causal mask it also aborts on the experimental scheduler (``fifo_tracker.cc``), so those rows are
modelled with the default scheduler (:data:`FALLBACK_OVERRIDES`; each row's ``modelled_config`` says what ran). tpukernels' model is only made where the tokamax model is credible (elsewhere nothing is implied).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import re
import statistics
import sys

from ..errors import TpuKernelError

FAMILY = "calibration"
LIBRARY = ("attention",)
#: other families' bench modules its cases are built from (``attention.bwd_kernels``; bench.core.source_digest)
BENCH = ("attention",)
#: model / measured within this range: the model is taken as credible at that row
CREDIBLE_RANGE = (0.7, 1.3)
#: tokamax's chip folder names -> tpukernels chip names (GPU folders are skipped)
CHIP_DIRS = {"tpu7x": "tpu7x", "tpu_v5_lite": "v5e", "tpu_v5": "v5p", "tpu_v6_lite": "v6e", "tpu_v6e": "v6e"}
ATTENTION_OP = "pallas_mosaic_tpu_flash_attention"
#: tokamax's flash attention backward (its op's VJP: dQ, dK, dV from q, k, v, o, dO and the logsumexp)
VJP_OP = "pallas_mosaic_tpu_flash_attention_vjp"
#: (B, S, Hq, Hkv, D) of the attention rows calibrated (all shipped for tpu7x in tokamax 0.0.12)
ATTENTION_SHAPES = ((16, 1024, 16, 16, 128), (4, 4096, 16, 16, 128), (2, 8192, 16, 16, 128),
                    (1, 16384, 16, 16, 128), (32, 4096, 32, 8, 128))
#: libtpu 0.0.52's static profiler aborts (``status_macros.cc:81``, signal 6) on every tokamax config with
#: ``use_base2_exp=True`` (all shipped ones): the model uses the natural exponent instead (see module docstring)
MODEL_OVERRIDES = {"use_base2_exp": False}
#: tried in turn when libtpu aborts on the modelled config: with a causal mask it aborts on splash's
#: experimental scheduler (``fifo_tracker.cc:436``), so such rows are modelled with the default scheduler
FALLBACK_OVERRIDES = ({"use_experimental_scheduler": False},)


class TokamaxFormatError(TpuKernelError):
    """tokamax's shipped autotuning file is not in the format this module reads (names the file and field)."""


@dataclasses.dataclass(frozen=True)
class MeasuredRow:
    """One measured (arguments, config) entry of a tokamax autotuning file.

    Attributes:
        chip: tpukernels chip name (``"tpu7x"``, ``"v5e"``, ...).
        op: the file's stem, e.g. ``"pallas_mosaic_tpu_flash_attention"``.
        args: the decoded argument key (arrays as ``"bf16[4,4096,16,128]"`` strings).
        config: the decoded config key.
        times_ms: ``evaluation_times_ms``, milliseconds.
    """

    chip: str
    op: str
    args: dict
    config: dict
    times_ms: tuple

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)


def tokamax_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("tokamax")
    except metadata.PackageNotFoundError:
        return None


def autotuning_dir() -> str:
    """The installed tokamax's ``data/autotuning`` folder (found without importing tokamax).

    Raises:
        BackendUnavailableError: tokamax is not installed (``make test`` installs it).
    """
    from ..errors import BackendUnavailableError

    spec = importlib.util.find_spec("tokamax")
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailableError("tokamax is not installed: pip install --no-deps tokamax==0.0.12")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "autotuning")


def parse_file(path: str, chip: str, op: str) -> list[MeasuredRow]:
    """The rows of one autotuning file (an empty file has none).

    Raises:
        TokamaxFormatError: not a JSON object of ``{args key: {config key: {"evaluation_times_ms": [...]}}}``.
    """
    with open(path) as f:
        text = f.read()
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except ValueError as e:
        raise TokamaxFormatError(f"{path}: not JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokamaxFormatError(f"{path}: top level is {type(data).__name__}, expected an object of argument keys")
    rows = []
    for akey, configs in data.items():
        try:
            args = json.loads(akey)
            if not isinstance(configs, dict):
                raise TypeError(f"configs of an argument key are {type(configs).__name__}, not an object")
            for ckey, entry in configs.items():
                times = entry["evaluation_times_ms"]
                if not times or not all(isinstance(t, (int, float)) and t > 0 for t in times):
                    raise ValueError(f"evaluation_times_ms {times!r} is not a list of positive numbers")
                rows.append(MeasuredRow(chip, op, args, json.loads(ckey), tuple(float(t) for t in times)))
        except (ValueError, TypeError, KeyError) as e:
            raise TokamaxFormatError(f"{path}: entry {akey[:80]}...: {type(e).__name__}: {e}") from e
    return rows


def load_rows(root: str | None = None, chips=None, ops=None, skipped: list | None = None) -> list[MeasuredRow]:
    """All measured TPU rows under ``root`` (default :func:`autotuning_dir`), optionally only ``chips`` /
    ``ops`` (file stems). GPU folders are skipped; an unknown TPU folder keeps its name as the chip.

    ``skipped``: a list to append ``(path, message)`` of unreadable files to instead of raising (tokamax
    0.0.12's ``tpu7x/ragged_dot.json`` is not valid JSON: its ``group_sizes`` quotes are not escaped).

    Raises:
        TokamaxFormatError: a file is not in the expected format (``skipped`` not given).
    """
    root = root or autotuning_dir()
    out = []
    for d in sorted(os.listdir(root)):
        if not d.startswith("tpu") or not os.path.isdir(os.path.join(root, d)):
            continue
        chip = CHIP_DIRS.get(d, d)
        if chips is not None and chip not in chips:
            continue
        for name in sorted(os.listdir(os.path.join(root, d))):
            op = name.removesuffix(".json")
            if name.endswith(".json") and (ops is None or op in ops):
                try:
                    out += parse_file(os.path.join(root, d, name), chip, op)
                except TokamaxFormatError as e:
                    if skipped is None:
                        raise
                    skipped.append((os.path.join(d, name), str(e)))
    return out


_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]$")


def array_shape(spec: str) -> tuple[str, tuple[int, ...]]:
    """``"bf16[4,4096,16,128]"`` -> ``("bf16", (4, 4096, 16, 128))``.

    Raises:
        TokamaxFormatError: not an array spec.
    """
    m = _ARRAY.match(spec or "")
    if not m:
        raise TokamaxFormatError(f"{spec!r} is not an array spec like 'bf16[4,4096,16,128]'")
    return m.group(1), tuple(int(x) for x in m.group(2).split(",") if x)


def best_per_args(rows: list[MeasuredRow]) -> list[MeasuredRow]:
    """Per (chip, op, arguments): the row of the fastest measured config (what tokamax's autotuner picks)."""
    best: dict = {}
    for r in rows:
        k = (r.chip, r.op, json.dumps(r.args, sort_keys=True))
        if k not in best or r.median_ms < best[k].median_ms:
            best[k] = r
    return list(best.values())


def calibrate(model_ms: float | None, measured_ms: float, ours_model_ms: float | None = None) -> dict:
    """``ratio`` (model / measured), ``credible`` (ratio in :data:`CREDIBLE_RANGE`), ``implied_ours_ms``
    (``ours_model_ms / ratio``, only where credible) and ``measured_over_implied`` (tokamax measured /
    tpukernels implied: above 1, tpukernels would be faster). None where an input is missing."""
    ratio = model_ms / measured_ms if model_ms else None
    credible = ratio is not None and CREDIBLE_RANGE[0] <= ratio <= CREDIBLE_RANGE[1]
    implied = ours_model_ms / ratio if credible and ours_model_ms else None
    return {"ratio": ratio, "credible": credible if ratio is not None else None, "implied_ours_ms": implied,
            "measured_over_implied": measured_ms / implied if implied else None}


# --------------------------------------------------------------------------------------- tokamax's kernel
def splash_module():
    """tokamax's ``splash_attention_kernel`` and ``splash_attention_mask`` modules, loaded without running
    ``tokamax/__init__`` (see module docstring): the parent packages are registered as empty packages when
    ``import tokamax`` itself fails."""
    name = "tokamax._src.ops.experimental.tpu.splash_attention"
    try:
        kern = importlib.import_module(f"{name}.splash_attention_kernel")
    except ImportError:
        path = os.path.dirname(autotuning_dir())  # .../tokamax/data
        path = os.path.dirname(path)
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            pkg = ".".join(parts[:i])
            if pkg not in sys.modules:  # with a spec: find_spec("tokamax") (autotuning_dir) still works after
                spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
                spec.submodule_search_locations = [os.path.join(path, *parts[1:i])]
                sys.modules[pkg] = importlib.util.module_from_spec(spec)
        kern = importlib.import_module(f"{name}.splash_attention_kernel")
    return kern, importlib.import_module(f"{name}.splash_attention_mask")


def tokamax_attention_fn(S: int, causal: bool, config: dict, scale: float):
    """A jitted ``fn(q, k, v)`` (``[B, S, H, D]`` bf16) running tokamax's TPU flash attention forward with
    ``config`` (a measured config key), the way ``PallasMosaicTpuFlashAttention._fwd`` does."""
    import jax
    import jax.numpy as jnp

    sk, sm = splash_module()
    fields = {f.name for f in dataclasses.fields(sk.SplashConfig)}
    known = {"block_q", "block_kv", "block_kv_compute", "q_layout", "k_layout", "v_layout",
             "use_experimental_scheduler", "use_base2_exp"}
    if set(config) - known:
        raise TokamaxFormatError(f"attention config has fields {sorted(set(config) - known)} not modelled here")
    cfg = {k: (sk.QKVLayout(v) if k.endswith("_layout") else v) for k, v in config.items() if k in fields}
    splash_config = dataclasses.replace(sk.SplashConfig.get_default(), **cfg)
    mask = sm.CausalMask(shape=(S, S), shard_count=1) if causal else sm.FullMask((S, S))
    kern = sk.make_splash_mha(mask=mask, config=splash_config, save_residuals=False,
                              mask_value=float(jnp.finfo(jnp.float32).min), downcast_smem_data=False, q_seq_shards=1)

    def fwd(q, k, v):
        q = q * jnp.asarray(scale, q.dtype)
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        return jnp.swapaxes(jax.vmap(kern)(q, k, v), 1, 2)

    return jax.jit(fwd)


def tokamax_vjp_fn(S: int, causal: bool, config: dict, scale: float):
    """A jitted ``fn(q, k, v, o, do, lse)`` (``[B, S, H, D]`` bf16, ``lse [B, H, S]`` f32, natural base) running
    tokamax's TPU flash attention backward with ``config`` (a measured VJP config key: ``block_q_dkv,
    block_kv_dkv, block_kv_dkv_compute, use_base2_exp``) the way ``PallasMosaicTpuFlashAttentionVjp._fwd`` does:
    splash's fused backward (``_splash_attention_bwd``: ``di = rowsum(o * do)`` and one dQ / dK / dV kernel),
    ``vmap`` over the batch, dQ scaled."""
    import functools

    import jax
    import jax.numpy as jnp

    sk, sm = splash_module()
    known = {"block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute", "use_base2_exp"}
    if set(config) - known:
        raise TokamaxFormatError(f"attention VJP config has fields {sorted(set(config) - known)} not modelled here")
    splash_config = dataclasses.replace(sk.SplashConfig.get_default(), **config)
    mask = sm.CausalMask(shape=(S, S), shard_count=1) if causal else sm.FullMask((S, S))
    kern = sk.make_splash_mha(mask=mask, config=splash_config, save_residuals=True,
                              mask_value=float(jnp.finfo(jnp.float32).min), downcast_smem_data=False, q_seq_shards=1)
    kw = kern.kwargs
    bwd = functools.partial(sk._splash_attention_bwd, True, kw["mask_value"], False, kw["config"],  # noqa: SLF001
                            kw["mask_function"], kw["fwd_mask_sparsity"], kw["dkv_mask_sparsity"])
    base2 = bool(config.get("use_base2_exp"))

    def vjp(q, k, v, o, do, lse):
        q = q * jnp.asarray(scale, q.dtype)
        q, k, v, o, do = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, o, do))
        lse = lse * sk.LOG2E if base2 else lse
        dstats = {"logsumexp": None, "max_logits": None}
        res = (q, k, v, None, None, o, lse, kern.dkv_mask_info)
        _, _, dq, dk, dv, _, _, _ = jax.vmap(bwd, in_axes=((0, 0, 0, None, None, 0, 0, None), (0, dstats)))(
            res, (do, dstats))
        return jnp.swapaxes(dq, 1, 2) * scale, jnp.swapaxes(dk, 1, 2), jnp.swapaxes(dv, 1, 2)

    return jax.jit(vjp)


def attention_rows(rows: list[MeasuredRow], op: str = ATTENTION_OP) -> list[MeasuredRow]:
    """The fastest measured ``op`` row (:data:`ATTENTION_OP`: the forward, :data:`VJP_OP`: the backward) at each
    of :data:`ATTENTION_SHAPES` (bf16, causal or not; the plain forward: tokamax also times it with
    ``return_residuals=True``, the forward of its VJP)."""
    out = []
    for r in best_per_args([r for r in rows if r.op == op]):
        (_, q), (_, k) = array_shape(r.args["q"]), array_shape(r.args["k"])
        if len(q) != 4 or len(k) != 4:
            continue
        if ((q[0], q[1], q[2], k[2], q[3]) in ATTENTION_SHAPES and r.args.get("bias") is None
                and not r.args.get("return_residuals")):
            out.append(r)
    return sorted(out, key=lambda r: (r.chip, array_shape(r.args["q"])[1][1], not r.args["mask"]["is_causal"],
                                      array_shape(r.args["q"])[1][2]))


def reduced_problem(B: int, hq: int, hkv: int) -> tuple[int, int, int, int]:
    """``(1, hq', hkv', scale)``: the problem estimated, one batch and the fewest heads that keep the group size
    with at least 2 KV heads (one KV head is tokamax's MQA kernel, a different program), and the factor that
    scales its cycles back to ``B x hq`` heads (the estimate is linear in heads:
    ``benchmarks/attention.py --check-scaling``)."""
    kv = min(hkv, 2)
    h = kv * (hq // hkv)
    return 1, h, kv, (B * hq) // h


def not_credible_note(ratio: float, causal: bool, fallback: bool) -> str:
    """Why no implied time is given for a row whose model is ``ratio`` x its measured time."""
    text = (f"the model is {ratio:.2f}x the measured time (outside {CREDIBLE_RANGE[0]}-{CREDIBLE_RANGE[1]}), so "
            "nothing is implied and tpukernels is not modelled here")
    if fallback:
        text += ("; modelled with splash's default scheduler because libtpu aborts on the experimental one that "
                 "was measured")
    if causal:
        text += ("; libtpu's static profile does not see data, and splash's causal grid is driven by "
                 "scalar-prefetched mask tables (the attention family's credibility probe shows the same kernel "
                 "family mis-modelled; not isolated further)")
    return text


def attention_dims(r: MeasuredRow) -> tuple[int, int, int, int, int, bool]:
    """``(B, S, Hq, Hkv, D, causal)`` of a measured attention row."""
    (_, q), (_, k) = array_shape(r.args["q"]), array_shape(r.args["k"])
    return q[0], q[1], q[2], k[2], q[3], bool(r.args["mask"]["is_causal"])


def shape_text(r: MeasuredRow) -> str:
    """The ``shape`` of a calibration row (``"B=4 S=4096 Hq=16 Hkv=16 D=128 causal"``)."""
    B, S, hq, hkv, D, causal = attention_dims(r)
    return f"B={B} S={S} Hq={hq} Hkv={hkv} D={D} {'causal' if causal else 'full'}"


class _NotCredible(Exception):
    """The tokamax model is off at this row: tpukernels' model would imply nothing (not estimated)."""


def attention_case(r: MeasuredRow, est, log=lambda m: None) -> dict:
    """One calibration row (dict) for a measured tokamax attention forward or VJP row (see module docstring)."""
    import jax
    import jax.numpy as jnp

    from ..library.attention import CAUSAL
    from ..perf import model_time
    from .core import EstimateError

    backward = r.op == VJP_OP
    B, S, hq, hkv, D, causal = attention_dims(r)
    modelled = {**r.config, **{k_: v for k_, v in MODEL_OVERRIDES.items() if k_ in r.config}}
    b, h, kv, scale = reduced_problem(B, hq, hkv)
    byts, flops = attention_bytes_flops(B, S, hq, hkv, D, causal, backward)
    row = {"family": "attention", "op": f"flash_attention {'bwd' if backward else 'fwd'}", "chip": r.chip,
           "kind": "calibration", "shape": shape_text(r),
           "tokamax_op": r.op, "tokamax_config": r.config, "modelled_config": modelled, "measured_ms": r.median_ms,
           "times_ms": list(r.times_ms),
           "estimated_at": f"B={b} Hq={h} Hkv={kv} x{scale}", "hbm_bytes": byts, "flops": flops,
           "model_ms": None, "ours_model_ms": None, "ours_config": None, "error": None, "note": None, "flags": []}
    make = tokamax_vjp_fn if backward else tokamax_attention_fn
    sm_scale = float(r.args.get("logits_scale") or D ** -0.5)

    def tokamax_cycles(s):
        nonlocal modelled
        bf = lambda n: jax.ShapeDtypeStruct((b, s, n, D), jnp.bfloat16)  # noqa: E731
        structs = [bf(h), bf(kv), bf(kv)]
        if backward:  # o, dO, and the natural-base logsumexp [B, H, S]
            structs += [bf(h), bf(h), jax.ShapeDtypeStruct((b, h, s), jnp.float32)]
        tries = [{}] + [x for x in FALLBACK_OVERRIDES if x.keys() <= modelled.keys()]  # the VJP has no scheduler
        for i, extra in enumerate(tries):
            modelled = {**modelled, **extra}
            try:
                return est.cycles(make(s, causal, modelled, sm_scale), structs, r.chip)
            except EstimateError as e:
                if i == len(tries) - 1:
                    raise
                row["flags"].append(f"libtpu aborted on {modelled}: {str(e).splitlines()[0][:120]}")

    try:
        cyc, s_est = at_shorter_seq(tokamax_cycles, S, S, causal, row["flags"], "tokamax")
        row["modelled_config"] = modelled
        row["model_ms"] = model_time(r.chip, cyc * scale, byts, flops).time_us / 1e3
        if not calibrate(row["model_ms"], r.median_ms)["credible"]:
            raise _NotCredible
        kw = dict(CAUSAL, causal=causal)
        ours = (ours_backward_cycles if backward else ours_forward_cycles)(est, r.chip, (B, S, hq, hkv, D),
                                                                            (b, h, kv), kw)
        ours_cyc, _ = at_shorter_seq(ours, S, s_est, causal, row["flags"], "tpukernels")
        row["ours_config"] = ours.config
        row["ours_model_ms"] = model_time(r.chip, ours_cyc * scale, byts, flops).time_us / 1e3
    except _NotCredible:
        pass
    except (EstimateError, TpuKernelError, NotImplementedError, ValueError) as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
    row.update(calibrate(row["model_ms"], r.median_ms, row["ours_model_ms"]))
    if row["ratio"] is not None and not row["credible"]:
        row["note"] = not_credible_note(row["ratio"], causal, bool(row["flags"]))
    log(f"  {r.chip:6} {row['op']} {row['shape']:40} model {row['model_ms'] or float('nan'):8.3f} ms  measured "
        f"{r.median_ms:8.3f} ms  ours model {row['ours_model_ms'] or float('nan'):8.3f} ms")
    return row


def attention_bytes_flops(B: int, S: int, hq: int, hkv: int, D: int, causal: bool, backward: bool) -> tuple[int, int]:
    """The HBM bytes and FLOPs of one attention call, the same for tokamax's kernel and ours: the forward reads
    q, k, v and writes o (bf16); the backward reads q, k, v, o, dO (bf16) and the logsumexp (f32) and writes dQ,
    dK, dV (bf16). FLOPs: ``4 B Hq S^2 D`` forward (half with the causal mask), 2.5x that backward (five
    ``S x S x D`` matmuls to the forward's two)."""
    fwd = 4 * B * hq * S * S * D // (2 if causal else 1)
    if not backward:
        return B * ((2 * hq * S * D + 2 * hkv * S * D) * 2), fwd
    return B * ((4 * hq + 4 * hkv) * S * D * 2 + hq * S * 4), int(fwd * 2.5)


#: without a mask, a program libtpu 0.0.52 cannot estimate at the row's S (its profiler aborts on tokamax's
#: backward at S >= 8k, ``llo_execution_graph.cc``; its *profiling* compile runs out of tpu7x's VMEM on our kernels'
#: large blocks at S >= 8k, which the ordinary compile fits) is estimated at S/2, S/4, ... down to this length and
#: scaled by ``(S / s)^2``: the work per score is the same (``benchmarks/attention_fused_bwd.py --est-seq``). The
#: XLA ops around the kernels (rowsum, layout swaps, casts: linear in S) are scaled the same way, an overestimate
#: of each side's time by about their share at the shorter length (~1-2% here)
MIN_EST_SEQ = 2048


def at_shorter_seq(estimate, S: int, start: int, causal: bool, flags: list, who: str) -> tuple[int, int]:
    """``(cycles at S, s)``: ``estimate(s)`` at ``s = start``, then halved while libtpu cannot estimate it (see
    :data:`MIN_EST_SEQ`; non-causal only: with the causal mask the work does not scale by ``(S / s)^2``), scaled
    to ``S``; each halving is noted in ``flags``.

    Raises:
        EstimateError: the last error, where no length could be estimated."""
    from .core import EstimateError

    s = start
    while True:
        try:
            return estimate(s) * (S // s) ** 2, s
        except EstimateError as e:
            if causal or s // 2 < MIN_EST_SEQ or (s // 2) % 128:
                raise
            flags.append(f"{who} estimated at S={s // 2} x {(S // (s // 2)) ** 2}: libtpu could not estimate "
                         f"S={s} ({str(e).splitlines()[0][:100]})")
            s //= 2


class _OursAt:
    """``self(s)``: cycles of tpukernels' ``kernels`` at the reduced problem with sequence length ``s``, at the
    config a call at the full problem gets, plus ``extra(s)`` (XLA ops): :func:`tpukernels.bench.core.ours_impl`'s
    model at that length. ``self.config``: the config (with its source) of the last estimate."""

    def __init__(self, est, chip, kernels, specs, full, kw, extra=None):
        self.est, self.chip, self.kernels, self.specs, self.full, self.kw, self.extra = \
            est, chip, kernels, specs, full, kw, extra
        self.config = None

    def __call__(self, s: int) -> int:
        from .core import ours_impl

        extra = None if self.extra is None else (lambda _est, _chip: self.extra(s))
        impl = ours_impl([(k_, self.specs(s), self.kw, self.full) for k_ in self.kernels], extra=extra)
        cycles, self.config = impl.cycles(self.est, self.chip)
        return cycles


def ours_forward_cycles(est, chip: str, dims: tuple, reduced: tuple, kw: dict) -> _OursAt:
    """tpukernels' ``fa_forward`` at the reduced problem, at the config a call at the full problem gets."""
    from ..library.attention import fa_forward

    B, S, hq, hkv, D = dims
    b, h, kv = reduced

    def specs(bb, n, m, s):
        return (f"{bb}x{n}x{s}x{D}:bf16", f"{bb}x{m}x{s}x{D}:bf16", f"{bb}x{m}x{s}x{D}:bf16")

    return _OursAt(est, chip, (fa_forward,), lambda s: specs(b, h, kv, s), specs(B, hq, hkv, S), kw)


def ours_backward_cycles(est, chip: str, dims: tuple, reduced: tuple, kw: dict) -> _OursAt:
    """The backward a tpukernels call runs on ``chip`` (:func:`tpukernels.bench.attention.bwd_kernels`: the fused
    kernel or dQ + dK/dV) plus the XLA ops around it (``di = rowsum(dO * O)``; the fused kernel's f32 dQ sliced
    and cast), at the reduced problem and the full problem's config."""
    import jax
    import jax.numpy as jnp

    from ..library.attention.backward_fused import fa_backward_fused
    from .attention import bwd_kernels

    B, S, hq, hkv, D = dims
    b, h, kv = reduced

    def specs(bb, n, m, s):
        q, k_ = f"{bb}x{n}x{s}x{D}:bf16", f"{bb}x{m}x{s}x{D}:bf16"
        rows = f"{bb}x{n}x1x{s}:f32"
        return (q, k_, k_, q, rows, rows)

    kernels = bwd_kernels(chip, specs(B, hq, hkv, S), kw)

    def extra(s):
        o = jax.ShapeDtypeStruct((b, h, s, D), jnp.bfloat16)
        total = est.cycles(jax.jit(lambda do, o: jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)),
                           [o, o], chip)
        if fa_backward_fused in kernels:
            dq = jax.ShapeDtypeStruct((b, h, -(-s // 8) * 8, D), jnp.float32)
            total += est.cycles(jax.jit(lambda x: x[:, :, :s].astype(jnp.bfloat16)), [dq], chip)
        return total

    return _OursAt(est, chip, kernels, lambda s: specs(b, h, kv, s), specs(B, hq, hkv, S), kw, extra)


def run(chips, est, log=lambda m: None) -> dict:
    """Every calibration row on ``chips`` (tokamax's shipped chips only); ``{"rows": [...], "tokamax": version}``."""
    loaded = load_rows(chips=set(chips), ops={ATTENTION_OP, VJP_OP})
    measured = attention_rows(loaded) + attention_rows(loaded, VJP_OP)
    log(f"== calibration: {len(measured)} measured tokamax attention rows on {', '.join(sorted({r.chip for r in measured})) or 'none of ' + ', '.join(chips)}")
    return {"rows": [attention_case(r, est, log) for r in measured], "tokamax": tokamax_version()}


def reason(row: dict) -> str | None:
    return row.get("note")
