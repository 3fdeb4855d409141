"""How often one ``flash_attention`` call derives a plan (issue 41 item 3).

Issue 41 counted nine entries into ``plan.py`` for one call: they are the forward and the two backward kernels
(``flash_attention_fwd``, ``_bwd_dq``, ``_bwd_dkv``), each once through ``check_args`` (the kernel op's own
check, kept for direct calls of the op), ``make_plan`` and ``vmem_limit``. Each kernel derives its plan from its
own tuned blocks (the tuning DB resolves ``block_q`` / ``block_kv`` / ... per kernel), so the three plans differ
and none can be handed to another; the public function builds no plan of its own. This pins that down: one
check, one plan and one VMEM limit per kernel launch, for the dense, masked and RoPE-fused variants, and none on
a repeated call of a lowered signature.
"""

from __future__ import annotations

import collections

import pytest
import torch

from tpukernels.library.attention import (backward, fa_backward_dkv, fa_backward_dq, fa_forward, flash_attention,
                                          forward, masked, plan, rope_fused)
from tpukernels.library.attention.masks import CausalMask

COUNTED = ("check_args", "make_plan", "vmem_limit")


@pytest.fixture
def counts(monkeypatch):
    """Counts calls of :data:`COUNTED` through every attention module that imported them; the kernels' lowering
    caches start empty so that this call lowers (and so launches) each kernel it runs."""
    seen = collections.Counter()
    for name in COUNTED:
        fn = getattr(plan, name)

        def counting(*a, _fn=fn, _name=name, **kw):
            seen[_name] += 1
            return _fn(*a, **kw)

        for mod in (plan, forward, backward, masked, rope_fused):
            if getattr(mod, name, None) is fn:
                monkeypatch.setattr(mod, name, counting)
    for kernel in (fa_forward, fa_backward_dq, fa_backward_dkv, masked.fa_forward_masked, rope_fused.fa_forward_rope):
        monkeypatch.setattr(kernel, "_entries", {})  # the lowering cache
        monkeypatch.setattr(kernel, "_plans", {})  # the torch targets' per-call plans
    return seen


def _qkv(grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 128, 128, generator=g, dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3)]


def test_forward_and_backward_derive_one_plan_per_kernel(counts):
    q, k, v = _qkv(grad=True)
    flash_attention(q, k, v, causal=True).float().sum().backward()
    assert dict(counts) == {"check_args": 3, "make_plan": 3, "vmem_limit": 3}  # fwd, bwd_dq, bwd_dkv
    counts.clear()
    q, k, v = _qkv(grad=True)
    flash_attention(q, k, v, causal=True).float().sum().backward()
    assert not counts  # the lowered signature is reused: no check, plan or limit again


@pytest.mark.parametrize("variant", ["dense", pytest.param("masked", marks=pytest.mark.slow),
                                     pytest.param("rope", marks=pytest.mark.slow)])
def test_a_forward_call_derives_one_plan(counts, variant):
    q, k, v = _qkv()
    kw = {"dense": dict(causal=True), "masked": dict(mask=CausalMask((128, 128))),
          "rope": dict(causal=True, rope_cos=torch.ones(128, 128), rope_sin=torch.zeros(128, 128))}[variant]
    flash_attention(q, k, v, **kw)
    assert dict(counts) == {"check_args": 1, "make_plan": 1, "vmem_limit": 1}
