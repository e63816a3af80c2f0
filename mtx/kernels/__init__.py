"""Pallas kernels for what XLA's fusions leave on the table: flash attention with mesh-invariant dropout."""
