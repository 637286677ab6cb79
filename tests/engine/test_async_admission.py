"""The waiting bound counts requests waiting for a running slot (issue 18, case 8): a burst that
arrives before the engine has taken a step fills the free seats and then the waiting queue."""
from __future__ import annotations

import asyncio
import threading

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.errors import QueueFullError
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams
from tests.fakes import FakeRunner


class GatedRunner(FakeRunner):
    """Steps wait for the gate: the whole burst arrives while the first step is still running."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def execute(self, out, stats):
        self.gate.wait(10)
        return super().execute(out, stats)


def test_a_burst_gets_max_num_seqs_plus_max_waiting_requests_accepted():
    config = EngineConfig.from_kwargs(max_num_seqs=16)
    runner = GatedRunner()
    engine = AsyncEngine(LLMEngine(config, runner, num_kv_blocks=1024, max_model_len=128, vocab_size=1000),
                         max_waiting_requests=32)

    async def main() -> tuple[int, int, int]:
        engine.start()
        sinks = [asyncio.Queue() for _ in range(200)]
        try:
            adds = asyncio.gather(
                *(engine.add_request(f"r{i}", [1 + i % 50, 2, 3], SamplingParams(max_tokens=4), sinks[i])
                  for i in range(200)), return_exceptions=True)
            await asyncio.sleep(0.1)  # every add has been counted (or refused) by now
            runner.gate.set()
            results = await adds
            accepted = [i for i, r in enumerate(results) if r is None]
            refused = sum(isinstance(r, QueueFullError) for r in results)
            finished = 0
            for i in accepted:
                while not (event := await asyncio.wait_for(sinks[i].get(), 10)).finished:
                    assert isinstance(event, RequestOutput)
                finished += 1
            return len(accepted), refused, finished
        finally:
            engine.stop()

    accepted, refused, finished = asyncio.run(main())
    assert (accepted, refused, finished) == (16 + 32, 200 - 48, 48)
