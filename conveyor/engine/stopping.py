"""When a request is done, by token ids only: EOS, stop token ids, max_tokens, the model's length.

Stop strings are text: they are found where the text is made (conveyor.engine.detokenizer, used
by LLM.generate and the server), which then ends the request with LLMEngine.stop_sample.
"""
from __future__ import annotations

from typing import Sequence

from conveyor.request import Request, RequestStatus


class StopChecker:
    def __init__(self, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:  # before min_tokens only the length can end it (vLLM)
            if token in self.eos_token_ids and not params.ignore_eos:
                request.ended_on_stop_token = True
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason, request.ended_on_stop_token = token, True
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
