"""Online control of the engine's batch limits against latency SLOs (pure Python, no torch)."""
from conveyor.control.controller import ControllerConfig, SloController, SloState
from conveyor.control.feedback import FeedbackConfig, TpotFeedback
from conveyor.control.step_model import StepFeatures, StepTimeModel, step_features

__all__ = [
    "ControllerConfig", "FeedbackConfig", "SloController", "SloState", "StepFeatures", "StepTimeModel",
    "TpotFeedback", "step_features",
]
