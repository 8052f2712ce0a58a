"""Flax NNX modules: thin owners of parameters around the pure functions."""
