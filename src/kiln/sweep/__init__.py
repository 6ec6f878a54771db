"""Hyperparameter sweeps: a search space over config keys, run as trials on Ray Tune."""
