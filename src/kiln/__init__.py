"""Kiln: raw text to a trained causal language model."""

__version__ = "0.1.0"
