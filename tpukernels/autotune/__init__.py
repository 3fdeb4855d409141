"""Autotuner: tunable-space search, evaluators and the tuning database."""
