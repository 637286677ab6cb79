"""Where one engine step's time went: the runner fills its part, the engine the rest (pure Python)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Where one step's time went; `model` is the forward pass, the rest is engine overhead."""

    num_requests: int = 0
    num_tokens: int = 0
    num_preempted: int = 0
    # Speculative decoding: proposed tokens this step verified, and how many of them it kept.
    num_drafts: int = 0  # requests that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: requests whose proposal at depth i (0 first) was accepted
    accepted_per_position: list[int] = field(default_factory=list)
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0
    postprocess_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.model_s + self.sample_s + self.postprocess_s
