"""The surrogate strategy (optuna TPE): finds a synthetic optimum within a small budget, is seeded, respects
its budget, never proposes a pruned or repeated config, resumes from the results earlier sweeps stored."""

import dataclasses
import json
import os

import pytest

from test_autotune_helpers import SyntheticEvaluator, key, tiles
from tpukernels.autotune import db
from tpukernels.autotune.space import Problem, Space
from tpukernels.autotune.strategies import Surrogate
from tpukernels.autotune.tuner import tune
from tpukernels.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(HERE, "test_autotune_helpers.py")
OPT = {"a": 32, "b": 512, "c": 4}  # tiles' space: 5 x 5 x 5 = 125 configs (a few pruned by a * b <= 65536)


@dataclasses.dataclass
class Counting(SyntheticEvaluator):
    """SyntheticEvaluator that records which configs it evaluated (inline executor: same process)."""

    def __post_init__(self):
        self.seen = []  # not a field: the evaluator's identity (what its times are comparable with) is unchanged

    def evaluate(self, problem, config):
        self.seen.append(key(**config))
        return super().evaluate(problem, config)


def _sweep(budget, seed=0, ev=None, **kw):
    ev = ev or SyntheticEvaluator(optimum=OPT)
    return tune(tiles, "256x128:f32", evaluator=ev, strategy="surrogate", budget=budget, seed=seed,
                executor="inline", **kw)


def _seq(r):
    return [key(**t.config) for t in r.trials]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_surrogate_finds_the_optimum_within_a_quarter_of_the_space(seed):
    r = _sweep(budget=31, seed=seed)  # 31 = 25% of the 125-point space
    assert r.best.config == OPT and r.stopped == "evaluation budget"
    assert r.trials[0].details.get("is_default")  # the baseline first, like every strategy


def test_surrogate_is_seeded_respects_the_budget_and_proposes_only_valid_new_configs():
    r1, r2, r3 = _sweep(12, seed=5), _sweep(12, seed=5), _sweep(12, seed=6)
    assert _seq(r1) == _seq(r2) != _seq(r3)
    assert len(r1.trials) == 12 and len(set(_seq(r1))) == 12
    space = Space(Problem.from_args(tiles, "256x128:f32"), None)
    assert all(space.check(t.config) is None for t in r1.trials)  # pruned configs were never evaluated
    assert all(t.config["a"] * t.config["b"] <= 64 * 1024 for t in r1.trials)


def test_surrogate_exhausts_a_small_space_without_repeats():
    r = _sweep(None, values={"a": [8, 32], "b": [512], "c": [4]})
    assert len(r.trials) == len(set(_seq(r))) == 2 * 3 * 2 and r.stopped == "space exhausted"


def test_surrogate_resumes_from_the_stored_results(tmp_cache, tmp_path):
    where = str(tmp_path / "db.json")
    first = _sweep(8, write_db=where)
    path = db.history_path(tiles.qualname, "v6e")
    stored = json.load(open(path))["runs"][0]["trials"]
    assert sorted(key(**t["config"]) for t in stored) == sorted(_seq(first))

    ev = Counting(optimum=OPT)
    second = _sweep(8, seed=1, ev=ev, write_db=where)
    resumed = [t for t in second.trials if t.details.get("resumed")]
    assert sorted(_seq(first)) == sorted(key(**t.config) for t in resumed)
    assert {key(**t.config): t.time_us for t in resumed} == {key(**t.config): t.time_us for t in first.trials}
    assert len(ev.seen) == 8 and not set(ev.seen) & set(_seq(first))  # none of them evaluated again
    assert len(second.trials) == 16 and second.stopped == "evaluation budget"  # the budget counts new ones
    assert second.best.time_us <= first.best.time_us
    assert len(json.load(open(path))["runs"][0]["trials"]) == 16  # the history grew

    other = Counting(optimum=OPT, sleep_s=0.001)  # another evaluator setting: its times are not comparable
    third = _sweep(3, ev=other)
    assert not any(t.details.get("resumed") for t in third.trials) and len(other.seen) == 3
    fresh = Counting(optimum=OPT)
    _sweep(3, ev=fresh, resume=False)
    assert len(fresh.seen) == 3 and fresh.seen[0] == _seq(first)[0]  # resume=False: the baseline again


def test_surrogate_resume_skips_configs_outside_the_space():
    space = Space(Problem.from_args(tiles, "256x128:f32"), None, {"a": [8, 32], "b": [512], "c": [4]})
    s = Surrogate(space, seed=0)
    prior = [({"a": 32, "b": 512, "c": 4}, 12.0), ({"a": 64, "b": 512, "c": 4}, 9.0),  # a=64: not searched
             ({"a": 128, "b": 1024, "c": 4}, 1.0), ({"a": 8, "b": 512, "c": 4}, None)]  # None: it failed
    taken = s.resume(prior)
    assert [(dict(c), t) for c, t in taken] == [({"a": 32, "b": 512, "c": 4}, 12.0), ({"a": 8, "b": 512, "c": 4}, None)]
    asked = set()
    while True:
        try:
            c = s.ask()
        except StopIteration:
            break
        asked.add(key(**c))
        s.tell(c, 1.0)
    assert asked.isdisjoint({key(a=32, b=512, c=4), key(a=8, b=512, c=4)}) and len(asked) == 2 * 3 * 2 - 2


def test_cli_selects_the_surrogate(capsys):
    assert main(["--import", HELPERS, "autotune", "twice", "--shape", "32x128:f32", "--evaluator", "measure",
                 "--strategy", "surrogate", "--repeats", "1", "--no-progress", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert res["strategy"] == "surrogate" and res["stopped"] == "space exhausted"
    assert sorted(t["config"]["br"] for t in res["trials"]) == [8, 16, 32] and res["failures"] == {"mismatch": 1}
