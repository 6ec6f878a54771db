"""Evaluation of a model on benchmarks: the lm-evaluation-harness adapter and the tasks it runs."""
