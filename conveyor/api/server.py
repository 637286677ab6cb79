"""`conveyor serve`: load the model, start the engine loop thread, serve HTTP with uvicorn.

SIGTERM (or Ctrl-C) drains: new requests get 503 with Retry-After while those in flight run to
the end, for at most the grace period; whatever is still running then is aborted (its clients get
finish_reason "abort"), and the process exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING, Sequence

import uvicorn

from conveyor.api.app import ServerState, build_app
from conveyor.api.metrics import Metrics
from conveyor.api.openai_responses import ResponseStore
from conveyor.config import (
    DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_STORED_RESPONSES, DEFAULT_MAX_STORED_RESPONSES_BYTES, EngineConfig,
)
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.client import EngineClient
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.params import model_defaults

if TYPE_CHECKING:
    from conveyor.distributed.deploy import DeploymentConfig

log = logging.getLogger("conveyor.server")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._hurried = False  # a second signal: no more grace

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would stop accepting connections at once and re-raise the signal at exit.
        if self._loop is None or self._hurried:
            self.should_exit = self.force_exit = True
            if self._hurried:
                log.warning("third signal: exiting now")
            return
        if self.state.draining:
            # The grace period cut short: in-flight requests are aborted, so each client still gets its
            # end (finish_reason "abort"), where exiting at once would cut streams mid-chunk.
            self._hurried = True
            log.warning("second signal: aborting %d in-flight requests now", self.state.inflight)
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, name: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(name))

    async def _drain(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        log.info("%s: draining %d in-flight requests (grace %.0f s); new requests get 503",
                 name, self.state.inflight, self.grace_s)
        deadline = loop.time() + self.grace_s
        while self.state.inflight and loop.time() < deadline and not self._hurried:
            await asyncio.sleep(0.05)
        if self.state.inflight:
            log.warning("grace period over: aborting %d requests", self.state.inflight)
            self.state.aborting = True  # nor are more prompts of a request in flight taken (embeddings' waves)
            self.state.engine.abort_all()
            deadline = loop.time() + 5.0
            while self.state.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        log.info("drained; shutting down")
        self.should_exit = True


def run_server(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: list[str],
    api_key: str | None = None,
    allowed_origins: Sequence[str] = ("*",),
    max_waiting_requests: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    max_stored_responses_bytes: int = DEFAULT_MAX_STORED_RESPONSES_BYTES,
    shutdown_grace_s: float = 30.0,
    log_level: str = "info",
    access_log: bool = True,
    uvicorn_log_level: str | None = None,
    deployment: "DeploymentConfig | None" = None,
    chat_template: str | None = None,
    log_requests: bool = False,
    max_log_len: int | None = None,
) -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_requests and logging.getLogger("conveyor.server").getEffectiveLevel() > logging.INFO:
        log.warning("--enable-log-requests writes INFO lines, which --log-level %s hides", log_level)
    log.info("loading model %s", config.model or "smollm2-135m")
    engine_client: EngineClient
    if deployment is not None and deployment.distributed:  # workers on Ray (conveyor/distributed)
        from conveyor.distributed.deploy import start_deployment

        engine_client = start_deployment(config, deployment, max_waiting_requests)
        log.info("Ray deployment ready: %s", ", ".join(w.name for w in engine_client.workers))
    else:
        # Built on the thread that will step it: one thread does all the model work (async_engine.py).
        local = AsyncEngine.build(lambda: LLMEngine.from_config(config).warm_up(), max_waiting_requests=max_waiting_requests)
        engine = local.engine
        kv = engine.scheduler.kv
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, serving as %s",
                 kv.num_blocks, kv.block_size, engine.max_model_len, ", ".join(served_model_names))
        engine_client = local
    log.info("/v1/embeddings: %d numbers, %s (--pooling-type)", engine_client.embedding_size or 0,
             engine_client.default_pooling)
    if chat_template is not None:  # --chat-template FILE: chat is rendered here, in the front end
        engine_client.tokenizer.set_chat_template(chat_template)
    state = ServerState(engine_client, served_model_names, Metrics(served_model_names[0]), api_key=api_key,
                        allowed_origins=allowed_origins, max_request_bytes=max_request_bytes,
                        max_num_seqs=config.scheduler.max_num_seqs,
                        priority_scheduling=config.scheduler.scheduling_policy == "priority",
                        sampling_defaults=model_defaults(config.generation_config,
                                                         engine_client.tokenizer.recommended_sampling),
                        log_requests=log_requests, max_log_len=max_log_len,
                        responses=ResponseStore(max_stored_responses, max_stored_responses_bytes))
    app = build_app(state)
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=uvicorn_log_level or log_level, access_log=access_log, timeout_graceful_shutdown=5,
        timeout_keep_alive=5)
    server = _DrainingServer(uv_config, state, shutdown_grace_s)
    server.run()
    return 0
