"""``nn.Module`` drop-ins: :class:`TPURMSNorm` (also the fused-add form), :class:`TPULayerNorm` and
:class:`TPUGatedRMSNorm`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...errors import ArgumentError
from .common import CASTINGS, DEFAULT_LAYER_NORM_EPS, DEFAULT_RMS_EPS, check_float
from .fused_add_rms_norm_ops import fused_add_rms_norm
from .gated_rms_norm_ops import ACTIVATIONS, gated_rms_norm
from .layer_norm_ops import layer_norm
from .rms_norm_ops import rms_norm


class TPURMSNorm(torch.nn.Module):
    """Drop-in RMSNorm module (HF ``LlamaRMSNorm`` / ``GemmaRMSNorm``, vLLM ``RMSNorm``).

    ``forward(x)`` returns :func:`rms_norm`; ``forward(x, residual)`` returns ``(y, new_residual)`` of
    :func:`fused_add_rms_norm` (vLLM's convention). The parameter is ``weight`` ``[hidden_size]``, so HF
    state dicts load unchanged; it starts at ``1 - offset`` (scale 1: ones for Llama, zeros for Gemma).

    Args:
        hidden_size: H. eps: default ``1e-6``. offset: ``1.0`` for Gemma checkpoints. casting: ``"llama"``
            (default) or ``"gemma"`` (see :func:`rms_norm`). elementwise_affine: False for no weight.
    """

    def __init__(self, hidden_size: int, eps: float = DEFAULT_RMS_EPS, *, offset: float = 0.0,
                 casting: str = "llama", elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        op = "TPURMSNorm"
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ArgumentError(f"{op}: hidden_size must be an int >= 1, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = check_float(op, "eps", eps, 0.0)
        self.offset = check_float(op, "offset", offset)
        if casting not in CASTINGS:
            raise ArgumentError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")
        if not elementwise_affine and self.offset != 0.0:
            raise ArgumentError(f"{op}: offset={offset} needs a weight; use elementwise_affine=True or offset=0")
        self.casting = casting
        w = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype)) if elementwise_affine else None
        self.register_parameter("weight", w)
        self.reset_parameters()

    @property
    def variance_epsilon(self) -> float:  # HF LlamaRMSNorm's attribute name
        return self.eps

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset, self.casting)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}"


class TPULayerNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dim (same arguments, parameters and init).

    Raises:
        ArgumentError: ``normalized_shape`` names more than the last dim.
    """

    def __init__(self, normalized_shape, eps: float = DEFAULT_LAYER_NORM_EPS, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        op = "TPULayerNorm"
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise ArgumentError(
                f"{op}: normalized_shape must be one int H >= 1 (normalization over the last dim), got {normalized_shape!r}"
            )
        self.normalized_shape = shape
        self.eps = check_float(op, "eps", eps, 0.0)
        self.elementwise_affine = elementwise_affine
        kw = {"device": device, "dtype": dtype}
        # registered even when absent (None), as torch.nn.LayerNorm does
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(shape, **kw)) if elementwise_affine else None)
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(shape, **kw)) if elementwise_affine and bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class TPUGatedRMSNorm(torch.nn.Module):
    """Drop-in gated RMSNorm (HF ``Qwen3NextRMSNormGated`` / ``MambaRMSNormGated``, mamba_ssm ``RMSNormGated``).

    ``forward(x, z)`` returns :func:`gated_rms_norm` with this module's weight, eps, group size and gate order.
    The parameter is ``weight`` ``[hidden_size]``, initialized to ones (both HF classes), so HF state dicts load
    unchanged; ``variance_epsilon`` is an alias of ``eps`` (HF's attribute name).

    Args:
        hidden_size: H. eps: default ``1e-6``. group_size: channels per normalization group (divides H;
            None: H). norm_before_gate: True (default): ``norm(x) * w * silu(z)`` (Qwen3-Next); False:
            ``norm(x * silu(z)) * w`` (Mamba2 / Nemotron-H). activation: ``"silu"`` or ``"sigmoid"`` (Kimi-Linear).
            casting: ``"llama"`` (HF Qwen3-Next / Mamba2 roundings) or ``"gemma"`` (float32 throughout: Falcon-H1,
            Kimi-Linear). See :func:`gated_rms_norm`.

    Raises:
        ArgumentError: hidden_size not an int >= 1, group_size not dividing it, eps < 0.
    """

    def __init__(self, hidden_size: int, eps: float = DEFAULT_RMS_EPS, *, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, activation: str = "silu", casting: str = "llama", device=None,
                 dtype=None):
        super().__init__()
        op = "TPUGatedRMSNorm"
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ArgumentError(f"{op}: hidden_size must be an int >= 1, got {hidden_size!r}")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1 or hidden_size % group_size):
            raise ArgumentError(f"{op}: group_size must be an int >= 1 dividing hidden_size = {hidden_size}, "
                                f"got {group_size!r}")
        if not isinstance(norm_before_gate, bool):
            raise ArgumentError(f"{op}: norm_before_gate must be a bool, got {norm_before_gate!r}")
        self.hidden_size = hidden_size
        self.eps = check_float(op, "eps", eps, 0.0)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        activation = "silu" if activation == "swish" else activation
        if activation not in ACTIVATIONS:
            raise ArgumentError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if casting not in CASTINGS:
            raise ArgumentError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")
        self.activation, self.casting = activation, casting
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    @property
    def variance_epsilon(self) -> float:  # HF's attribute name
        return self.eps

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, eps=self.eps, norm_before_gate=self.norm_before_gate,
                              group_size=self.group_size, activation=self.activation, casting=self.casting)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, activation={self.activation!r}, casting={self.casting!r}")
