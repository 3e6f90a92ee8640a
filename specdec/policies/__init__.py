"""Policies: how far to draft each step (budgets, stop rules) and what is worth verifying (planners).

Drafters never import this package: they receive a :class:`~specdec.contracts.Budget` (per-row
depth, the measured :class:`StepCost`, an optional :class:`~specdec.contracts.StopRule`) and may
hold an acceptance table that the method's declaration builds for them.
"""
from specdec.contracts import Budget, LengthPolicy, StopRule
from specdec.policies.acceptance import AcceptanceModel, NodeAcceptance, ProbabilityCalibration
from specdec.policies.cost import StepCost
from specdec.policies.governor import EXPLORE, DraftGovernor
from specdec.policies.length import ConfidenceStop, HeuristicLength, StaticLength
from specdec.policies.planner import batch_width, best_length, best_sizes, cap_nodes, prune

__all__ = ["Budget", "StopRule", "StepCost", "DraftGovernor", "EXPLORE", "AcceptanceModel", "NodeAcceptance", "ProbabilityCalibration", "StaticLength", "HeuristicLength",
           "ConfidenceStop", "batch_width", "best_length", "best_sizes", "cap_nodes", "prune"]
