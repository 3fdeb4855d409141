"""Autotuner: tunable-space search, evaluators and the tuning database.

Importing this package registers the tuning-database config resolver, so calls dispatch
explicit config -> user DB -> shipped DB -> nearest bucket -> heuristic -> defaults.

* :func:`tune` searches a kernel's tunable space for one call signature (:mod:`.tuner`), with a
  strategy (:mod:`.strategies`), an evaluator (:mod:`.evaluators`: ``tpu-model`` = compile-only libtpu +
  :mod:`.model`, a model; ``measure`` = wall-clock on the tensors' device) and an executor
  (:mod:`.executors`: in-process, a pool of processes, or Ray tasks), and can store the winner (:mod:`.db`).
* ``tpukernels autotune`` is the command line (:mod:`.cli`).
"""

from ..dsl.kernel import CONFIG_RESOLVERS
from . import db
from .db import lookup, record

if db.resolver not in CONFIG_RESOLVERS:
    CONFIG_RESOLVERS.append(db.resolver)


def tune(kernel, *args, **kwargs):
    """Search ``kernel``'s tunable space; see :func:`tpukernels.autotune.tuner.tune`."""
    from .tuner import tune as _tune

    return _tune(kernel, *args, **kwargs)


__all__ = ["db", "lookup", "record", "tune"]
