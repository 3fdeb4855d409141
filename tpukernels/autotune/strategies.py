"""Search strategies: which config to evaluate next.

A strategy proposes configs one at a time (:meth:`Strategy.ask`) and learns results (:meth:`Strategy.tell`);
the sweep keeps as many candidates in flight as it has workers and stops at the budget. Every strategy
proposes the kernel's default config first (the baseline every speed-up is reported against) and only
configs that passed the static checks of :class:`~tpukernels.autotune.space.Space`: pruned configs cost
no compile and no budget.

* ``exhaustive``: every valid config, default first, then in declaration order.
* ``random``: valid configs in a seeded random order, without repeats.
* ``coordinate``: pattern search (sample-efficient). Evaluate a centre (first the default) and its
  neighbours along each tunable (the next smaller and larger value; numeric tunables ordered by value)
  as one batch, so workers run them in parallel; move the centre to the best of the batch; when the
  centre stays best, widen the step (2, 4, ... values away); when the widest step finds nothing better,
  restart from a random unexplored config (a new descent) until the budget or the space runs out.
* ``surrogate``: a model of the objective learns from every result (optuna's TPE sampler: a Tree-structured
  Parzen Estimator, Bergstra et al. 2011, "Algorithms for Hyper-Parameter Optimization"). The default first,
  then a few seeded random configs, then the configs the model expects to be fastest. It resumes: results a
  previous sweep of the same kernel source, problem, chip and evaluator stored (``--write-db``, see
  :func:`tpukernels.autotune.db.load_history`) are told to the model and not evaluated again.
"""

from __future__ import annotations

import abc

import random
from collections.abc import Iterator

from ..dsl.spec import Config
from .space import Space


class Strategy(abc.ABC):
    """Base class: :meth:`ask` returns a config, None (nothing to propose until results arrive) or raises
    :class:`StopIteration` when the space is exhausted."""

    name = "strategy"

    def __init__(self, space: Space, seed: int = 0):
        self.space = space
        self.rng = random.Random(seed)
        self.proposed: set[Config] = set()

    def _valid(self, config: Config) -> bool:
        """Not proposed yet and passes the static checks."""
        return config not in self.proposed and self.space.check(config) is None

    @abc.abstractmethod
    def ask(self) -> Config | None:
        raise NotImplementedError

    def tell(self, config: Config, time_us: float | None) -> None:
        """``time_us`` None: the candidate failed."""

    def resume(self, prior) -> list:
        """Learn ``prior`` results (``(config, time_us or None)`` pairs from earlier sweeps) without evaluating
        them again; returns the pairs taken (the sweep reports them as resumed trials). Default: none (the
        strategy starts afresh)."""
        return []


class _IterStrategy(Strategy):
    def __init__(self, space: Space, seed: int = 0):
        super().__init__(space, seed)
        self._it = self._order()

    @abc.abstractmethod
    def _order(self) -> Iterator[Config]:
        raise NotImplementedError

    def ask(self) -> Config | None:
        for c in self._it:
            if self._valid(c):
                self.proposed.add(c)
                return c
        raise StopIteration


class Exhaustive(_IterStrategy):
    name = "exhaustive"

    def _order(self):
        return self.space.all_configs()


class RandomSearch(_IterStrategy):
    name = "random"

    def _order(self):
        yield self.space.default()
        n = self.space.size()
        if n <= 1_000_000:
            idx = list(range(n))
            self.rng.shuffle(idx)
            for i in idx:
                yield self.space.config_at(i)
        else:  # huge spaces: sample with rejection, give up after many repeats in a row
            misses = 0
            while misses < 10_000:
                c = self.space.config_at(self.rng.randrange(n))
                misses = misses + 1 if c in self.proposed else 0
                yield c


def _axis_order(values: tuple) -> list:
    """A tunable's values in search order: sorted by value when all numeric, else as declared."""
    if _numeric(values):
        return sorted(values)
    return list(values)


class Coordinate(Strategy):
    name = "coordinate"

    def __init__(self, space: Space, seed: int = 0):
        super().__init__(space, seed)
        self.axes = {n: _axis_order(v) for n, v in space.values.items()}
        self.pending: set[Config] = set()
        self.queue: list[Config] = []
        self.center: Config | None = None
        self.local_best: tuple[float, Config] | None = None  # best of the current descent
        self.step = 1
        self.max_step = max([len(v) for v in self.axes.values()] or [1])
        self._restarts = RandomSearch(space, seed)._order()

    def _neighbours(self, center: Config, step: int) -> list[Config]:
        out = []
        for n, order in self.axes.items():
            i = order.index(center[n])
            for j in (i - step, i + step):
                if 0 <= j < len(order):
                    out.append(center.replace(**{n: order[j]}))
        return out

    def _propose(self, configs) -> None:
        for c in configs:
            if c not in self.queue and self._valid(c):
                self.queue.append(c)

    def _advance(self) -> None:
        """Every result of the current pattern is in: move, widen or restart until something is queued."""
        while not self.queue:
            if self.local_best is not None and self.local_best[1] != self.center:
                self.center, self.step = self.local_best[1], 1
            elif self.center is not None and self.step * 2 <= self.max_step:
                self.step *= 2
            else:  # converged: restart from a random unexplored config
                self.center = next((c for c in self._restarts if self._valid(c)), None)
                self.step, self.local_best = 1, None
                if self.center is not None:
                    self.queue.append(self.center)
                    self._propose(self._neighbours(self.center, 1))
                return
            self._propose(self._neighbours(self.center, self.step))

    def ask(self) -> Config | None:
        if self.center is None and not self.proposed:
            self.center = self.space.default()
            self._propose([self.center] + self._neighbours(self.center, 1))
        if not self.queue and not self.pending:
            self._advance()
        if self.queue:
            c = self.queue.pop(0)
            self.proposed.add(c)
            self.pending.add(c)
            return c
        if self.pending:
            return None
        raise StopIteration

    def tell(self, config: Config, time_us: float | None) -> None:
        self.pending.discard(config)
        t = float("inf") if time_us is None else float(time_us)
        if self.local_best is None or t < self.local_best[0]:
            self.local_best = (t, config)


class Surrogate(Strategy):
    """optuna's TPE sampler over the space (module docstring). Deterministic for a seed when results arrive
    in the same order (one worker; with several, the order results finish in steers the model).

    Each tunable is one optuna parameter: an ordinal ``IntDistribution`` over the index of its sorted values
    when they are all numbers (so the model sees that 256 lies between 128 and 512), else a categorical one.
    A config the space prunes, a failed candidate and one ranked only by a bound are told as a penalty value
    (worse than any time), so the model learns to avoid them; a proposal already evaluated is discarded
    (optuna ``FAIL``: no new information) and after ``max_misses`` such proposals in a row the next
    unexplored config of a seeded random order is evaluated instead, so the sweep never stalls.

    Args:
        space: the :class:`~tpukernels.autotune.space.Space`.
        seed: the sampler's and the fallback order's seed.
        n_startup_trials: random configs (after the baseline) before the model steers; default
            ``clip(size // 16, 3, 10)``.
        max_misses: proposals in a row that may be pruned or repeats before the random fallback.

    Raises:
        ImportError: optuna is not installed (``pip install 'tpukernels[tune]'``).
    """

    name = "surrogate"
    PENALTY = 1e30

    def __init__(self, space: Space, seed: int = 0, n_startup_trials: int | None = None, max_misses: int = 16):
        super().__init__(space, seed)
        try:
            import optuna
        except ImportError as e:
            raise ImportError("the surrogate strategy needs optuna: pip install 'tpukernels[tune]'") from e
        from optuna.distributions import CategoricalDistribution, IntDistribution

        self._optuna = optuna
        self.axes = {n: _axis_order(v) for n, v in space.values.items()}
        self.dists = {
            n: IntDistribution(0, len(order) - 1) if _numeric(order)
            else CategoricalDistribution(tuple(range(len(order))))
            for n, order in self.axes.items()
        }
        startup = n_startup_trials if n_startup_trials is not None else min(10, max(3, space.size() // 16))
        # 64 candidates per proposal (optuna's default: 24): fewer evaluations to the best on the library's
        # spaces (tpukernels.bench.strategy_study: worst case 43 instead of 130 of 320 on grouped_matmul_fwd v6e)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, n_ei_candidates=64,
                                             multivariate=True, constant_liar=True)
        with _quiet(optuna):
            self.study = optuna.create_study(direction="minimize", sampler=sampler)
        self.max_misses = max_misses
        self.pending: dict = {}  # Config -> optuna trial
        self.known: dict = {}  # Config -> time_us or None (failed / pruned / bound only)
        self._fallback = RandomSearch(space, seed)._order()
        self._baseline_asked = False

    def _params(self, config: Config) -> dict | None:
        try:
            return {n: self.axes[n].index(config[n]) for n in self.axes}
        except (KeyError, ValueError):  # a value outside this space (e.g. another --values)
            return None

    def _config(self, params: dict) -> Config:
        return Config({n: self.axes[n][params[n]] for n in self.axes})

    def _tell(self, trial, time_us: float | None) -> None:
        with _quiet(self._optuna):
            self.study.tell(trial, self.PENALTY if time_us is None else float(time_us))

    def resume(self, prior) -> list:
        from optuna.trial import create_trial

        taken = []
        for config, time_us in prior:
            config = Config(config)
            params = self._params(config)
            if params is None or config in self.proposed or self.space.check(config) is not None:
                continue
            value = self.PENALTY if time_us is None else float(time_us)
            self.study.add_trial(create_trial(params=params, distributions=self.dists, value=value))
            self.proposed.add(config)
            self.known[config] = time_us
            taken.append((config, time_us))
        return taken

    def _next(self):
        """An optuna trial for a config to evaluate (already checked), or None."""
        if not self._baseline_asked:  # the baseline first (unless an earlier sweep evaluated it)
            self._baseline_asked = True
            if self._valid(self.space.default()):
                self.study.enqueue_trial(self._params(self.space.default()))
        for _ in range(self.max_misses):
            trial = self.study.ask(self.dists)
            config = self._config(trial.params)
            if config in self.proposed:  # a repeat: nothing to learn, nothing to run
                with _quiet(self._optuna):
                    self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
                continue
            if self.space.check(config) is not None:  # pruned: free, and the model learns to avoid it
                self.proposed.add(config)
                self.known[config] = None
                self._tell(trial, None)
                continue
            return config, trial
        config = next((c for c in self._fallback if self._valid(c)), None)
        if config is None:
            return None
        self.study.enqueue_trial(self._params(config))
        return config, self.study.ask(self.dists)

    def ask(self) -> Config | None:
        got = self._next()
        if got is None:
            if self.pending:
                return None
            raise StopIteration
        config, trial = got
        self.proposed.add(config)
        self.pending[config] = trial
        return config

    def tell(self, config: Config, time_us: float | None) -> None:
        trial = self.pending.pop(config, None)
        self.known[config] = time_us
        if trial is not None:
            self._tell(trial, time_us)


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


class _quiet:
    """optuna logs every trial at INFO; silence it for the strategy's calls only."""

    def __init__(self, optuna):
        self.logging = optuna.logging

    def __enter__(self):
        self.level = self.logging.get_verbosity()
        self.logging.set_verbosity(self.logging.WARNING)

    def __exit__(self, *exc):
        self.logging.set_verbosity(self.level)


STRATEGIES = {"exhaustive": Exhaustive, "random": RandomSearch, "coordinate": Coordinate, "surrogate": Surrogate}


def make_strategy(name: str, space: Space, seed: int = 0) -> Strategy:
    try:
        return STRATEGIES[name](space, seed)
    except KeyError:
        from ..errors import ArgumentError

        raise ArgumentError(f"strategy {name!r}: choose one of {', '.join(STRATEGIES)}") from None
