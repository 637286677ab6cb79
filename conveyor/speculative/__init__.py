"""Speculative decoding: propose tokens after a request's last sampled one, cheaply; the engine
step computes them with it and keeps the run the model agrees with (conveyor/sampling's
verify_rows), so outputs are those of decoding one token a step. Pure Python: proposals are
token ids, decisions are token counts.
"""
from conveyor.speculative.ngram import NgramProposer
from conveyor.speculative.policy import Proposer, Speculator, StepCostModel, can_speculate

__all__ = ["NgramProposer", "Proposer", "Speculator", "StepCostModel", "can_speculate"]
