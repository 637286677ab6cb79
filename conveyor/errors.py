"""Typed exceptions: every error a caller can cause has its own class."""


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class InvalidRequestError(ConveyorError, ValueError):
    """A request (prompt or sampling parameters) that the engine will not accept; `param` names
    the field at fault when one is (the server reports it as the error's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(ConveyorError):
    """A model path or name that cannot be resolved or read."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture or tensor types conveyor does not implement."""


class ConfigError(ConveyorError, ValueError):
    """An engine configuration that cannot work (e.g. a KV budget too small for one block)."""


class RequestFailedError(ConveyorError):
    """The engine could not compute this request: a step raised with it in the batch and ran
    without it, so it alone fails (its KV blocks freed) while the rest of the batch goes on."""
