"""Kernel front-ends other than Pallas-style bodies (Helion tile programs)."""
