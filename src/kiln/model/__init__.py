"""The native decoder model, its registry of sizes, and sampling."""

from kiln.model.llama import Transformer
from kiln.model.registry import SIZES, flops_per_token, param_count

__all__ = ["SIZES", "Transformer", "flops_per_token", "param_count"]
