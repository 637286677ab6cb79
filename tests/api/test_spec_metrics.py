"""/metrics counts speculative decoding as vLLM names it, from the engine's step stats."""
from __future__ import annotations

from conveyor.api.metrics import Metrics
from conveyor.config import EngineConfig
from conveyor.engine.async_engine import StepReport
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling.params import SamplingParams
from conveyor.sim.runner import SimProposer, SimRunner, VirtualClock
from tests.api.test_slo_metrics import samples


class OneMillisecond:
    name = "constant"

    def step_time(self, shape: object) -> float:
        return 0.001

    def describe(self) -> str:
        return self.name


def test_spec_decode_counters_add_up_to_the_engines_totals() -> None:
    clock = VirtualClock()
    config = EngineConfig.from_kwargs(speculative_config={"num_speculative_tokens": 3, "adaptive": False})
    engine = LLMEngine(config, SimRunner(OneMillisecond(), clock, spec_acceptance=0.6), num_kv_blocks=256,
                       max_model_len=1024, vocab_size=1000, clock=clock, proposer=SimProposer())
    for i in range(4):
        engine.add_request([11 + i] * 20, SamplingParams(max_tokens=40, ignore_eos=True))
    metrics = Metrics("m")
    generated = 0
    while engine.has_unfinished_requests:
        outputs = engine.step()
        generated += sum(len(o.new_token_ids) for o in outputs)
        metrics.on_report(StepReport(num_running=1, num_waiting=0, kv_usage=0.0, num_preemptions=0,
                                     stats=engine.last_step, outputs=outputs))
    got, speculator = samples(metrics), engine.speculator
    assert speculator is not None and 0 < speculator.num_accepted_tokens < speculator.num_draft_tokens
    assert got["conveyor:spec_decode_num_drafts_total"] == speculator.num_drafts
    assert got["conveyor:spec_decode_num_draft_tokens_total"] == speculator.num_draft_tokens
    assert got["conveyor:spec_decode_num_accepted_tokens_total"] == speculator.num_accepted_tokens
    text = metrics.render()[0].decode()
    by_position = {int(line.split('position="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines()
                   if line.startswith("conveyor:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert [by_position[p] for p in sorted(by_position)] == speculator.accepted_per_position[: len(by_position)]
    assert sum(by_position.values()) == speculator.num_accepted_tokens
    assert generated == got["conveyor:generation_tokens_total"] == 4 * 40
