"""tpukernels' expert-parallel dispatch / combine as a TorchTitan token dispatcher.

TorchTitan 0.3.0's MoE (``torchtitan/models/common/moe.py``) routes tokens through a configurable token
dispatcher (``RoutedExperts.Config.token_dispatcher``: ``LocalTokenDispatcher`` for EP = 1,
``AllToAllTokenDispatcher`` for EP > 1, ``torchtitan/models/common/token_dispatcher.py``). This module's
``TpuKernelsTokenDispatcher`` is a drop-in ``BaseEPTokenDispatcher`` with the same ``dispatch`` / ``combine``
contract, built on :mod:`tpukernels.distributed.expert_parallel` (``moe_permute`` / ``moe_combine`` kernels and
one ``all_to_all_single`` of the rows each way; EP = 1: the two kernels alone)::

    from tpukernels.integrations.torchtitan_ep import token_dispatcher_class
    Dispatcher = token_dispatcher_class()
    moe_config.experts.token_dispatcher = Dispatcher.Config(num_experts=E, top_k=k)

Same results as TorchTitan's dispatchers, up to rounding: rows reach the experts grouped by local expert (within
an expert: by source rank, then token order, as TorchTitan's), and ``combine`` weights each expert output by its
router score and sums a token's ``k`` outputs in float32, rounded once (TorchTitan rounds each weighted row to
the expert dtype and sums in that dtype). Checked against ``AllToAllTokenDispatcher`` on a 2-process gloo group
(tests/test_distributed.py, check ``expert_parallel``): outputs and the gradients of the tokens, the scores and
the expert weights.

Scope: EP over one mesh dimension, TorchTitan's ``dtensor`` SPMD backend (its ``spmd_types`` backend, which
routes through a registered sparse mesh, raises ``ArgumentError``); tested with a 1-D EP mesh only (not with
TorchTitan's sequence-parallel or expert-TP layouts around the dispatcher).
"""

from __future__ import annotations

from ..errors import ArgumentError

_CLASSES: dict = {}


def _make_class():
    from . import torchtitan_compat

    torchtitan_compat.install()  # CPU hosts: placeholders for triton / CUDA-only imports of torchtitan.models
    from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher

    from ..distributed.expert_parallel import ep_combine, ep_dispatch
    from ..library.moe_routing import moe_combine, moe_permute

    class TpuKernelsTokenDispatcher(BaseEPTokenDispatcher):
        """TorchTitan token dispatcher on tpukernels' MoE permute / combine kernels and EP all-to-all."""

        def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
            """``(routed_input_RD, num_tokens_per_local_expert, metadata)``: TorchTitan's dispatch contract.
            ``num_local_tokens_per_expert_E`` is recomputed by the kernels (it is what they count)."""
            del num_local_tokens_per_expert_E
            if self.ep_mesh is None:
                xs, sizes, meta = moe_permute(x_TD, topk_expert_ids_TK, self.num_experts)
                return xs, sizes, ("local", meta, topk_scores_TK)
            from torchtitan.distributed.utils import get_spmd_backend

            if get_spmd_backend() == "spmd_types":
                raise ArgumentError("TpuKernelsTokenDispatcher: TorchTitan's spmd_types backend is not supported; "
                                    "run with parallelism.spmd_backend = 'dtensor'")
            xs, sizes, handle = ep_dispatch(x_TD, topk_expert_ids_TK, self.num_experts, self.ep_mesh)
            return xs, sizes, ("ep", handle, topk_scores_TK)

        def combine(self, routed_output_RD, metadata, x_TD):
            """``[T, D]``: each token's expert outputs weighted by its scores and summed (float32, rounded once)."""
            kind, meta, scores = metadata
            if kind == "local":
                return moe_combine(routed_output_RD, scores, meta)
            return ep_combine(routed_output_RD, scores, meta)

    return TpuKernelsTokenDispatcher


def token_dispatcher_class():
    """The ``TpuKernelsTokenDispatcher`` class (a subclass of TorchTitan's ``BaseEPTokenDispatcher``; built on
    first use, since it needs torchtitan importable)."""
    if "cls" not in _CLASSES:
        _CLASSES["cls"] = _make_class()
    return _CLASSES["cls"]


__all__ = ["token_dispatcher_class"]
