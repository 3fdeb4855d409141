"""Beyond one device: DTensor sharding rules for tpukernels' torch ops (:mod:`.sharding`)."""

from .sharding import PARTIAL, Split, TensorMeta, register_all, splits_for  # noqa: F401
