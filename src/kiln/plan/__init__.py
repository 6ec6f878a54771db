"""The memory and time planner of `kiln plan` (no torch needed): memory.py (bytes per device),
gpus.py (the cards and Kiln's measured MFU), estimate.py (the plan), report.py (its tables)."""

from kiln.plan.estimate import Plan, make_plan

__all__ = ["Plan", "make_plan"]
