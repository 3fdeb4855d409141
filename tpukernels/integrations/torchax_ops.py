"""torchax lowerings for tpukernels' torch ops: PyTorch models run by torchax (as vLLM-TPU runs them) reach
the kernels.

:func:`register` gives every tpukernels torch op a lowering inside ``torchax.default_env()``, by one mechanism:

* **kernel ops** (every :class:`~tpukernels.TpuKernel`'s ``torch.ops.<namespace>.<name>``, the library's and
  the user's): :func:`tpukernels.jax_call` of the kernel on the jax arrays torchax holds (Mosaic for arrays on
  a TPU or a program lowered for TPU, the interpreter on cpu);
* **public ops** (``CompositeImplicitAutograd``: flash_attention, rms_norm, matmul, quantized_matmul, rope,
  gated_activation, ...): their own composite body, run on torchax tensors with torchax's function mode
  re-entered. Without that, torchax 0.0.13 fails them: it intercepts custom ops only through its function
  mode, which torch disables while the mode's handler runs, so the kernel ops a composite body calls reach
  torchax's dispatch mode and tensor dispatch, which reject namespaces other than ``aten``. With it, the
  body's kernel-op calls take the lowerings above and its aten ops torchax's own;
* ``ragged_paged_attention`` (the serving op): straight to
  :func:`~tpukernels.library.paged_attention.ragged_paged_attention_jax`.

torchax 0.0.13 and torch 2.13 (the tested pair): torchax's import-time tables (``torchax/amp.py``,
``torchax/decompositions.py``) name named-tensor overloads torch 2.13 removed (``aten.prod.dim_Dimname``,
``aten.all.dimname``, ``aten.norm.names_ScalarOpt_dim``, ...), so a plain ``import torchax`` raises
``AttributeError``. :func:`import_torchax` imports it (and builds its default environment) with only those
missing *named-tensor* overload lookups answered by an inert placeholder, which no dispatched op can match;
any other missing overload still raises. torch versions that still have the overloads import it plainly.
"""

from __future__ import annotations

import contextlib
import sys

from ..errors import BackendUnavailableError

_STATE: dict = {}


class _RemovedOverload:
    """Stands for a named-tensor overload torch no longer has (a dict key no dispatched op equals)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


@contextlib.contextmanager
def _tolerate_removed_named_overloads():
    import torch

    packet = torch._ops.OpOverloadPacket
    orig = packet.__getattr__

    def getattr_(self, key):
        try:
            return orig(self, key)
        except AttributeError:
            if "dimname" in key.lower() or "names" in key:  # named-tensor overloads only
                return _RemovedOverload(f"{self._qualified_op_name}.{key}")
            raise

    packet.__getattr__ = getattr_
    try:
        yield
    finally:
        packet.__getattr__ = orig


def import_torchax():
    """``(torchax, its default environment)``, importing torchax with the shim of the module docstring when
    its plain import fails on this torch.

    Raises:
        BackendUnavailableError: torchax is not installed (``pip install torchax``) or fails otherwise.
    """
    if "env" in _STATE:
        return _STATE["torchax"], _STATE["env"]
    try:
        import torchax

        env = torchax.default_env()
    except ImportError as e:
        raise BackendUnavailableError(f"torchax is not importable ({e}); pip install torchax") from e
    except AttributeError:
        for k in [k for k in sys.modules if k == "torchax" or k.startswith("torchax.")]:
            del sys.modules[k]
        try:
            with _tolerate_removed_named_overloads():
                import torchax

                env = torchax.default_env()
        except Exception as e:  # noqa: BLE001
            raise BackendUnavailableError(f"torchax does not import with this torch ({type(e).__name__}: {e})") from e
    _STATE.update(torchax=torchax, env=env)
    return torchax, env


def _put(env, op, fn, *, jax_function: bool) -> None:
    """Register ``fn`` as torchax's lowering of ``op`` (an OpOverload), in ``env`` and in torchax's global table
    (environments made later)."""
    from torchax.ops import ops_registry

    ops_registry.register_torch_dispatch_op(op, fn, is_jax_function=jax_function, is_user_defined=True)
    env._ops[op] = ops_registry.Operator(op, fn, is_jax_function=jax_function, is_user_defined=True,
                                         needs_env=False, is_view_op=False)


def _kernel_lowering(kernel):
    """A kernel op's lowering: its arguments as jax arrays (and Python statics) through
    :func:`tpukernels.jax_call` (Mosaic for arrays on a TPU or a program lowered for TPU, else the interpreter)."""
    from ..targets.jax_entry import jax_call

    def lowering(*args, config=None, **kwargs):
        return jax_call(kernel, *args, config=config, **kwargs)

    lowering.__name__ = kernel.name
    return lowering


def _composite_lowering(env, op):
    """A public op's lowering: its own ``CompositeImplicitAutograd`` body run on torchax tensors with torchax's
    function mode re-entered, so that the kernel ops and aten ops the body calls reach their lowerings (inside
    a mode's handler torch disables the mode, and the body's ops would otherwise reach torchax's tensor
    dispatch, which rejects other namespaces than ``aten``)."""

    import torch

    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # where the composite kernel is registered (alias)

    def lowering(*args, **kwargs):
        # redispatch: the composite kernel itself, without a second torch-function round for this op
        with env._function_mode:
            return op.redispatch(cpu, *args, **kwargs)

    lowering.__name__ = op.name()
    return lowering


def register(env=None) -> list[str]:
    """Register torchax lowerings for tpukernels' torch ops; returns the op names registered (sorted).

    * every kernel op (a :class:`~tpukernels.TpuKernel` registered as ``torch.ops.<namespace>.<name>``: the
      library's and the user's ``@tpu_kernel`` s defined so far) -> :func:`tpukernels.jax_call` of its kernel;
    * every public op of the ``tpukernels`` namespace defined as ``CompositeImplicitAutograd`` (flash_attention,
      rms_norm, layer_norm, fused_add_rms_norm, matmul, quantized_matmul, rope, gated_activation,
      linear_cross_entropy, ...) -> its own body on torchax tensors, whose kernel-op calls take the lowerings
      above (one mechanism: no per-op code);
    * ``ragged_paged_attention`` -> :func:`~tpukernels.library.paged_attention.ragged_paged_attention_jax`;
      ``mla_ragged_paged_attention`` -> :func:`~tpukernels.library.mla_attention.mla_ragged_paged_attention_jax`.

    Call it again after defining new ``@tpu_kernel`` s. Forward only: these lowerings do not differentiate
    through torchax (torch autograd of the composites is not involved).

    Raises:
        BackendUnavailableError: torchax is not importable.
    """
    torchax, default = import_torchax()
    env = env or default
    import importlib

    import torch

    from ..dsl.kernel import REGISTRY

    importlib.import_module("tpukernels.library")
    done = []
    for qualname, kernel in list(REGISTRY.items()):
        if kernel.op is None:
            continue
        ns, name = qualname.split("::")
        _put(env, getattr(getattr(torch.ops, ns), name).default, _kernel_lowering(kernel), jax_function=True)
        done.append(qualname)

    # the serving op: lowered straight to its JAX entry (one kernel call, no torch-side checks per step)
    from ..library import paged_attention as pa

    def rpa(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=None, sliding_window=None,
            soft_cap=None, k_scale=None, v_scale=None, sinks=None, k_scales=None, v_scales=None, config=None):
        return pa.ragged_paged_attention_jax(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                                             sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                             k_scale=k_scale, v_scale=v_scale, sinks=sinks, k_scales=k_scales,
                                             v_scales=v_scales, config=config)

    _put(env, torch.ops.tpukernels.ragged_paged_attention.default, rpa, jax_function=True)
    done.append("tpukernels::ragged_paged_attention")

    # MLA likewise: its JAX entry writes the latents with a jnp scatter (the torch body's byte-view index_copy_
    # and metadata ops stay out of torchax)
    from ..library import mla_attention as mla

    def mla_rpa(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                sm_scale=1.0, k_scale=None, v_scale=None, q_scale=None, config=None):
        return mla.mla_ragged_paged_attention_jax(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices,
                                                  cu_q_lens, num_seqs, sm_scale=sm_scale, k_scale=k_scale,
                                                  v_scale=v_scale, q_scale=q_scale, config=config)

    _put(env, torch.ops.tpukernels.mla_ragged_paged_attention.default, mla_rpa, jax_function=True)
    done.append("tpukernels::mla_ragged_paged_attention")

    for qualname in torch._C._dispatch_get_all_op_names():
        if not qualname.startswith("tpukernels::") or qualname in done or qualname in REGISTRY:
            continue
        name, _, overload = qualname.partition("::")[2].partition(".")
        op = getattr(getattr(torch.ops.tpukernels, name), overload or "default")
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            _put(env, op, _composite_lowering(env, op), jax_function=False)
            done.append(qualname)
    return sorted(done)


__all__ = ["import_torchax", "register"]
