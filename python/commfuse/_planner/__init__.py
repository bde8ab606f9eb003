"""commfuse.plan: the whole step's spatial and temporal partition, chosen
together under a memory limit (`plan`), and the hooks a model gives it
(`remat_policy`, `constrain`)."""

from .hooks import REMAT_POLICIES, constrain, remat_policy
from .plan import Plan, plan

__all__ = ["REMAT_POLICIES", "Plan", "constrain", "plan", "remat_policy"]
