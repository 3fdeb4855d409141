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
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
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


STRATEGIES = {"exhaustive": Exhaustive, "random": RandomSearch, "coordinate": Coordinate}


def make_strategy(name: str, space: Space, seed: int = 0) -> Strategy:
    try:
        return STRATEGIES[name](space, seed)
    except KeyError:
        from ..errors import ArgumentError

        raise ArgumentError(f"strategy {name!r}: choose one of {', '.join(STRATEGIES)}") from None
