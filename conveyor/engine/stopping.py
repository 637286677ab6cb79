"""When a request is done: EOS, stop token ids, stop strings, max_tokens, the model's length."""
from __future__ import annotations

from typing import Sequence

from conveyor.engine.codec import TextCodec
from conveyor.errors import InvalidRequestError
from conveyor.request import Request, RequestStatus


class StopChecker:
    def __init__(self, tokenizer: TextCodec | None, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # Output text of requests that stopped on a stop string, cut at the string.
        self._stopped_text: dict[str, str] = {}

    def start(self, request: Request) -> None:
        if request.sampling_params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer")

    def check(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in self.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.stop and self._hit_stop_string(request):
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _hit_stop_string(self, request: Request) -> bool:
        assert self.tokenizer is not None
        # Whole-text search: a token can complete a multi-byte character that an earlier decode
        # showed as U+FFFD, so "only look at the new tail" is not safe. Outputs are short.
        text = self.tokenizer.decode(request.output_token_ids)
        params = request.sampling_params
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if params.include_stop_str_in_output else at
                self._stopped_text[request.request_id] = text[:end]
                request.stop_reason = stop
                return True
        return False

    def final_text(self, request: Request) -> str | None:
        text = self._stopped_text.pop(request.request_id, None)
        if text is not None:
            return text
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(request.output_token_ids)

    def forget(self, request: Request) -> None:
        self._stopped_text.pop(request.request_id, None)
