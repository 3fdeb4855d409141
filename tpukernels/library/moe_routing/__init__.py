"""MoE routing: router top-k (softmax, sigmoid, DeepSeek-V3 grouped), a general top-k, and the permute /
combine pair that sorts token copies into expert order and back."""

from .topk_ops import topk, topk_jax, topk_reference  # noqa: F401
from .router_ops import (grouped_topk, grouped_topk_jax, router_topk_reference, sigmoid_topk,  # noqa: F401
                         sigmoid_topk_jax, softmax_topk, softmax_topk_jax)
from .permute_ops import (MoEPermutation, moe_combine, moe_combine_jax, moe_combine_reference,  # noqa: F401
                          moe_permute, moe_permute_jax, moe_permute_reference)
