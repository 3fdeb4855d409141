"""The DSL's data objects and definition-time errors."""

import pytest
import torch
from jax.experimental import pallas as pl

import tpukernels as tk
from tpukernels.dsl.kernel import TpuKernel, bucket


def _body(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def test_config_is_hashable_printable_and_round_trips_json():
    c = tk.Config(bm=128, bn=256)
    assert c == {"bm": 128, "bn": 256} and hash(c) == hash(tk.Config(bn=256, bm=128))
    assert tk.Config.from_json(c.to_json()) == c
    assert "bm=128" in repr(c) and c.bm == 128
    assert c.replace(bm=64)["bm"] == 64 and c["bm"] == 128


def test_tunable_space_iterates_constrained_product_and_completes_partials():
    space = tk.TunableSpace(
        {"bm": tk.Tunable([128, 256]), "bk": tk.Tunable([128, 256, 512], default=256)},
        constraints=[lambda c: c["bk"] >= c["bm"] or "bk must be >= bm"],
    )
    configs = list(space)
    assert len(configs) == 5 and space.size() == 6
    assert all(c["bk"] >= c["bm"] for c in configs)
    assert space.default() == {"bm": 128, "bk": 256}
    assert space.complete({"bm": 256}) == {"bm": 256, "bk": 256}
    with pytest.raises(tk.ConfigError, match="bk must be >= bm"):
        space.complete({"bm": 256, "bk": 128})
    with pytest.raises(tk.ConfigError, match="unknown tunable 'bq'"):
        space.complete({"bq": 1})


def test_tunable_default_must_be_a_candidate():
    with pytest.raises(tk.KernelDefinitionError, match="default 3"):
        tk.Tunable([1, 2], default=3)


@pytest.mark.parametrize("values", [[8, "a"], [True, 8], [(1, 2), 3]])
def test_tunable_values_of_mixed_kinds_are_rejected(values):
    with pytest.raises(tk.KernelDefinitionError, match="mix kinds"):
        tk.Tunable(values)
    assert tk.Tunable([0.5, 1]).values == (0.5, 1)  # numbers may mix


@pytest.mark.parametrize("n, b", [(1, 8), (8, 8), (9, 16), (100, 112), (1025, 1280), (1280, 1280), (1281, 1536), (5000, 5120)])
def test_bucket_rounds_up_with_at_most_25_percent_waste(n, b):
    assert bucket(n) == b
    assert bucket(n) >= n and (n <= 8 or bucket(n) <= 1.25 * n + 8)


def test_unannotated_parameter_is_a_definition_error():
    with pytest.raises(tk.KernelDefinitionError, match="parameter 'x' needs a type annotation"):
        TpuKernel(_body, lambda x: None, name="t_unannotated", register=False)


def test_tunable_must_be_keyword_only():
    def launch(x: torch.Tensor, block: int) -> torch.Tensor: ...

    with pytest.raises(tk.KernelDefinitionError, match="tunable 'block' must be a keyword-only"):
        TpuKernel(_body, launch, tunables={"block": tk.Tunable([8])}, register=False)


def test_unsupported_annotation_and_missing_return_are_definition_errors():
    def launch(x: torch.Tensor, shape: tuple) -> torch.Tensor: ...

    with pytest.raises(tk.KernelDefinitionError, match="annotation"):
        TpuKernel(_body, launch, register=False)

    def launch2(x: torch.Tensor): ...

    with pytest.raises(tk.KernelDefinitionError, match="annotate the return type"):
        TpuKernel(_body, launch2, register=False)


def test_duplicate_kernel_name_is_rejected():
    def launch(x: torch.Tensor) -> torch.Tensor:
        spec = pl.BlockSpec(tuple(x.shape), lambda: (0,) * x.ndim)
        return tk.Launch(grid=(), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))

    tk.tpu_kernel(_body, name="dup_once", namespace="tktest_dsl")(launch)
    with pytest.raises(tk.KernelDefinitionError, match="already defined"):
        tk.tpu_kernel(_body, name="dup_once", namespace="tktest_dsl")(launch)


def test_bind_reports_missing_and_unexpected_arguments():
    from kernels_for_tests import scale

    assert scale.bind((torch.ones(2, 2),), {}) [1] == 2.0  # default applied
    with pytest.raises(tk.ArgumentError, match=r"missing required argument\(s\) 'x'"):
        scale.bind((), {})
    with pytest.raises(tk.ArgumentError, match="unexpected keyword"):
        scale.bind((torch.ones(2, 2),), {"beta": 1})
    with pytest.raises(tk.ArgumentError, match="takes 2 arguments"):
        scale.bind((1, 2, 3), {})
