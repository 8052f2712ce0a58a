"""Flax NNX modules: thin owners of parameters around the pure functions.

``generate`` lives here too: it runs a model of these modules, driving
their caches.
"""
