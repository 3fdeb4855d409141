"""Autotuner: tunable-space search, evaluators and the tuning database.

Importing this package registers the tuning-database config resolver, so calls dispatch
explicit config -> user DB -> shipped DB -> nearest bucket -> heuristic -> defaults.
"""

from ..dsl.kernel import CONFIG_RESOLVERS
from . import db
from .db import lookup, record

if db.resolver not in CONFIG_RESOLVERS:
    CONFIG_RESOLVERS.append(db.resolver)

__all__ = ["db", "lookup", "record"]
