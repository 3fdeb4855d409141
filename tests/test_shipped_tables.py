"""The shipped tuning tables cover the library: every op at its standard shapes has an exact entry on v4, v5e,
v5p, v6e and tpu7x (or a reason in ``tpukernels/data/autotuning/coverage.json``), and every shipped entry's
config passes the kernel's static checks for its chip (constraints, launch, block rules, VMEM)."""

import functools
import json
import os

import pytest

from tpukernels import library
from tpukernels.autotune import db
from tpukernels.autotune.space import Problem, Space
from tpukernels.chips import get_chip
from tpukernels.dsl.spec import Config

COVERAGE = os.path.join(os.path.dirname(os.path.dirname(db.shipped_db_path("x", "v5e"))), "coverage.json")
CHIPS = ("v4", "v5e", "v5p", "v6e", "tpu7x")


@functools.lru_cache(maxsize=1)
def _coverage():
    with open(COVERAGE) as f:
        return json.load(f)


def _cases():
    return [(k, Problem.from_args(k, *a, **kw)) for k, a, kw in library.standard_cases()]


def test_every_library_case_has_a_shipped_entry_on_every_chip_or_a_reason():
    cov = _coverage()
    assert tuple(cov["chips"]) == CHIPS
    reasons = {(m["kernel"], m["chip"], m["problem"]): m["reason"] for m in cov["missing"]}
    assert all(len(r) > 40 for r in reasons.values())  # a reason, not a placeholder
    cases = _cases()
    assert len({k.qualname for k, _ in cases}) >= 15  # the library's ops, not an empty registry
    missing, explained = [], set()
    for kernel, problem in cases:
        key = db.entry_key(kernel, problem.lowered_specs, problem.statics)
        for chip in CHIPS:
            _, how = db.find(db.load(db.shipped_db_path(kernel.qualname, chip)), key)
            case = (kernel.qualname, chip, problem.describe())
            if case in reasons:
                assert how != "exact", f"{case} has an entry and a reason for having none: drop one"
                explained.add(case)
            elif how != "exact":
                missing.append(case)
    assert not missing, f"no shipped entry and no reason in coverage.json: {missing}"
    assert explained == set(reasons), f"reasons for cases that are not standard cases: {set(reasons) - explained}"


@pytest.mark.parametrize("chip", CHIPS)
def test_shipped_configs_pass_the_static_checks_for_their_chip(chip):
    """An entry a call would get on ``chip`` is a config that fits the chip (VMEM, blocks), so dispatch never
    falls back from it. The checks run the launch for ``chip`` (``lowering.launching_for``): 8 grouped-matmul
    entries of v5e / v6e once failed here only because the check planned the kernels' scoped-VMEM request for
    the smallest shipped chip (56 MiB, tpu7x) instead of the 112 MiB v5e / v6e grant."""
    bad = []
    for kernel, problem in _cases():
        key = db.entry_key(kernel, problem.lowered_specs, problem.statics)
        entry, how = db.find(db.load(db.shipped_db_path(kernel.qualname, chip)), key)
        if how != "exact":
            continue
        config = Config({n: tuple(v) if isinstance(v, list) else v for n, v in entry["config"].items()})
        why = Space(problem, get_chip(chip)).check(config)
        if why is not None:
            bad.append((chip, kernel.qualname, problem.describe(), dict(config), why.kind, why.reason[:120]))
    assert not bad, bad
