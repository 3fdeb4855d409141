"""Tuned kernel library (attention, matmul, normalization)."""
