"""Typed exceptions: every error a caller can cause has its own class."""


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request too long for the model


class InvalidRequestError(ConveyorError, ValueError):
    """A request (prompt or sampling parameters) that the engine will not accept; `param` names
    the field at fault when one is (the server reports it as the error's `param`), `code` the
    kind of fault where clients act on it (OpenAI's "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple:
        # Rebuilt from every argument wherever it is unpickled (a Ray worker's error reaches the front end).
        return type(self), (str(self), self.param, self.code)


class NoAllowedTokenError(InvalidRequestError):
    """At some step the request's constraints together (allowed_token_ids, bad words, min_tokens,
    its grammar) left no token to sample: the request ends with this error (finish_reason "error")
    rather than with a token that breaks them. The other requests of the batch go on."""


class ModelLoadError(ConveyorError):
    """A model path or name that cannot be resolved or read."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture or tensor types conveyor does not implement."""


class ConfigError(ConveyorError, ValueError):
    """An engine configuration that cannot work (e.g. a KV budget too small for one block)."""


class QueueFullError(ConveyorError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 503)."""


class EngineStoppedError(ConveyorError):
    """The engine loop is stopped or stopping; no request is accepted."""


class WorkerDiedError(ConveyorError):
    """An engine worker of a Ray deployment is gone (its process, or its loop thread): nothing it
    held will progress. Its methods raise this, and the front end then handles it as dead; a
    request it held fails with it unless it can be retried elsewhere."""


class RequestFailedError(ConveyorError):
    """The engine could not compute this request: a step raised with it in the batch and ran
    without it, so it alone fails (its KV blocks freed) while the rest of the batch goes on."""


class BlockAccountingError(ConveyorError, ValueError):
    """A KV block freed, shared or cached in a state that does not allow it (a double free, say):
    a bug in whoever keeps the block table, never the user's input."""


class OutOfBlocksError(ConveyorError, RuntimeError):
    """Asked for more KV blocks than are free; callers check the free count first, so this is a bug."""
