"""GPU kernels for what XLA's fusions and collectives leave on the table: flash attention with mesh-invariant dropout
(Pallas), the norms' and activations' backward written out, and sequence parallelism's collective matmuls over peer
memory (`--tp-comm-overlap`)."""
