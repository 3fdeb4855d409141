"""Tuned kernel library (attention, matmul, normalization), all written with the tpukernels DSL.

Each kernel family is one module, or a package once it grows (``norms/``: one file per kernel), with its kernel
bodies, launch, tunable space, defaults, float64 reference and registration, and may define ``STANDARD_CASES``:
``[(kernel, args, kwargs), ...]`` at the shapes its defaults are tuned for, used by ``tpukernels demo``,
``tpukernels autotune --library`` and benchmarks.
"""

import sys as _sys

# Library modules (one import line each). A module is never named after a function it exports (``matmul_ops``
# holds ``matmul``): a package attribute that shadows a submodule breaks ``import a.b.c as m`` (tests/
# test_no_shadowed_submodules.py).
from .norms import (TPUGatedRMSNorm, TPULayerNorm, TPURMSNorm, fused_add_rms_norm, gated_rms_norm, layer_norm,  # noqa: E402,F401
                    rms_norm)
from .attention import attention_reference, flash_attention, topk_sparse_attention  # noqa: E402,F401
from .matmul_ops import matmul, matmul_nn, matmul_nt, matmul_tn  # noqa: E402,F401
from .quantized_matmul_ops import (TPUBlockQuantLinear, TPUQuantLinear, pack_int4, quantize_weight,  # noqa: E402,F401
                                   quantize_weight_blockwise, quantized_matmul, quantized_matmul_blockwise)
from .grouped_matmul_ops import grouped_matmul, grouped_matmul_fwd, grouped_matmul_tgmm  # noqa: E402,F401
from .grouped_matmul_ops.quant import grouped_matmul_quantized  # noqa: E402,F401
from .linear_cross_entropy_ops import linear_cross_entropy  # noqa: E402,F401
from .rope import apply_rope, apply_rotary_pos_emb  # noqa: E402,F401
from .gated_mlp import TPUGatedMLP, gated_activation, geglu, swiglu  # noqa: E402,F401
from .causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa: E402,F401
from .linear_attention import (chunk_gated_delta_rule, chunk_kda,  # noqa: E402,F401
                               fused_recurrent_gated_delta_rule, fused_recurrent_kda, gated_delta_rule_reference,
                               kda_reference)
from .linear_attention import mamba_chunk_scan_combined, selective_state_step, selective_state_update  # noqa: E402,F401
from .paged_attention import (paged_attention_reference, ragged_paged_attention, ragged_paged_attention_jax,  # noqa: E402,F401
                              update_kv_cache)
from .mla_attention import (mla_attention_reference, mla_ragged_paged_attention,  # noqa: E402,F401
                            mla_ragged_paged_attention_jax)
from .moe_routing import (MoEPermutation, grouped_topk, grouped_topk_jax, moe_combine, moe_combine_jax,  # noqa: E402,F401
                          moe_permute, moe_permute_jax, sigmoid_topk, sigmoid_topk_jax, softmax_topk,
                          softmax_topk_jax, topk, topk_jax)
from .fused_moe_ops import fused_moe, fused_moe_jax, fused_moe_reference  # noqa: E402,F401
from .dsa_attention import (indexer_topk, lightning_indexer, lightning_indexer_reference,  # noqa: E402,F401
                            sparse_mla_attention, sparse_mla_attention_reference)
from .moba_ops import moba_attention, moba_attention_reference, moba_block_indices  # noqa: E402,F401
from .nsa_ops import nsa_attention, nsa_attention_reference  # noqa: E402,F401


def standard_cases():
    """Every library module's ``STANDARD_CASES`` (kernel, example args, kwargs)."""
    out = []
    for name, mod in sorted(_sys.modules.items()):
        if name.startswith(__name__ + ".") and hasattr(mod, "STANDARD_CASES"):
            out.extend(mod.STANDARD_CASES)
    return out
