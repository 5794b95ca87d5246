"""The layers of the GDN hybrids as Flax NNX modules."""
