"""gdnx: Gated DeltaNet for JAX."""

__version__ = "0.1.0"
