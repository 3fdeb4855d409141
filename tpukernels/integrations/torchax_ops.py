"""torchax lowerings for tpukernels' torch ops: PyTorch models run by torchax (as vLLM-TPU runs them) reach
the kernels.

:func:`register` lowers ``torch.ops.tpukernels.ragged_paged_attention`` (the serving op) to
:func:`~tpukernels.library.paged_attention.ragged_paged_attention_jax` (built on :func:`tpukernels.jax_call`)
inside ``torchax.default_env()``: Mosaic when lowered for TPU, the interpreter on cpu. Not done yet: other
ops. torchax 0.0.13 intercepts custom ops only through its function mode, and a custom op called from
inside another op's Python body (our composites calling their kernel ops) or directly (tested with
``rms_norm_fwd``) reaches torchax's tensor dispatch, which rejects non-``aten`` namespaces; those need
torchax-side support or per-op JAX lowerings like this one.

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


def register(env=None) -> list[str]:
    """Register the torchax lowering of ``torch.ops.tpukernels.ragged_paged_attention``. Returns the op names
    registered.

    Raises:
        BackendUnavailableError: torchax is not importable.
    """
    torchax, default = import_torchax()
    env = env or default
    from torchax.ops import ops_registry

    done = []
    # composites whose Python body runs outside torchax's function mode: lowered to their JAX entries
    from ..library import paged_attention as pa

    def rpa(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=None, sliding_window=None,
            soft_cap=None, k_scale=None, v_scale=None, sinks=None, k_scales=None, v_scales=None, config=None):
        return pa.ragged_paged_attention_jax(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                                             sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                             k_scale=k_scale, v_scale=v_scale, sinks=sinks, k_scales=k_scales,
                                             v_scales=v_scales, config=config)

    import torch

    op = torch.ops.tpukernels.ragged_paged_attention.default
    ops_registry.register_torch_dispatch_op(op, rpa, is_jax_function=True, is_user_defined=True)
    env._ops[op] = ops_registry.Operator(op, rpa, is_jax_function=True, is_user_defined=True, needs_env=False,
                                         is_view_op=False)
    done.append("tpukernels::ragged_paged_attention")
    return done


__all__ = ["import_torchax", "register"]
