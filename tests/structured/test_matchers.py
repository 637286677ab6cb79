"""Grammar bookkeeping in the engine with a fake runner and a toy tokenizer: masks reach the
constrained rows only, forks copy their parent's matcher, preemption and handover keep the
accepted tokens, a complete grammar stops its request, bad grammars are refused cleanly."""
from __future__ import annotations

import pickle

import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.runner.stats import StepStats
from conveyor.sampling.outputs import SamplerOutput
from conveyor.errors import InvalidRequestError
from conveyor.sampling import SamplingParams
from conveyor.structured.masking import apply_token_masks
from conveyor.sampling.sampler import Sampler
from conveyor.structured.spec import GrammarSpec, TokenMasks
from conveyor.structured.grammar import GrammarCompiler, GrammarError
from tests.fakes import FakeRunner

# Printable ASCII spells itself in the byte-level alphabet, so these are their own bytes.
VOCAB = ["<eos>", "a", "b", "y", "e", "s", "n", "o", "ye", "no", "{", "}", '"', ":", ",", "0", "1", "2", "x", "xx"]
EOS = 0


class ToyTokenizer:
    vocab_size = len(VOCAB)
    bos_token_id = None
    eos_token_ids = (EOS,)

    def token_to_str(self, token_id: int | None) -> str | None:
        return None if token_id is None else VOCAB[token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):  # longest match
            best = max((t for t in range(1, len(VOCAB)) if text.startswith(VOCAB[t], i)), key=lambda t: len(VOCAB[t]))
            ids.append(best)
            i += len(VOCAB[best])
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


class LogitsRunner:
    """Computes no model: every row's logits prefer "xx", then "x", then the other tokens in id
    order, so a constrained row can only differ by its mask. It applies the masks and samples with
    the real sampler, and records what it was given."""

    supports_token_masks = True

    def __init__(self) -> None:
        self.sampler = Sampler(seed=0)
        self.fake = FakeRunner(len(VOCAB))
        self.masks: list[TokenMasks | None] = []
        self.rows: list[list[str]] = []

    def execute(self, out, stats: StepStats, token_masks: TokenMasks | None = None) -> SamplerOutput:  # noqa: ANN001
        self.fake.execute(out, stats)  # checks the KV slots
        requests = out.sampling_requests()
        logits = np.tile(-np.arange(len(VOCAB), dtype=np.float32), (len(requests), 1))
        logits[:, VOCAB.index("xx")], logits[:, VOCAB.index("x")] = 10.0, 9.0
        self.masks.append(token_masks)
        self.rows.append([r.request_id for r in requests])
        if token_masks is not None:
            apply_token_masks(logits, token_masks)
        return self.sampler(logits, requests, token_masks.rows if token_masks is not None else ())


def text(out) -> str:  # noqa: ANN001 - the engine makes no text (stop strings are the caller's)
    return ToyTokenizer().decode(out.token_ids)


def make_engine(runner=None, **config) -> LLMEngine:  # noqa: ANN001, ANN003
    config = {"num_kv_blocks": 64, "block_size": 4, **config}
    runner = runner or LogitsRunner()
    getattr(runner, "fake", runner).block_size = config["block_size"]  # the FakeRunner that checks the slots
    return LLMEngine(EngineConfig.from_kwargs(**config), runner, num_kv_blocks=config["num_kv_blocks"],
                     max_model_len=64, vocab_size=len(VOCAB), tokenizer=ToyTokenizer(), eos_token_ids=(EOS,))


def run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done.setdefault(out.request_id, []).append(out)
    return done


def choice(*options: str, **kwargs) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 12), temperature=kwargs.pop("temperature", 0.0),
                          structured=GrammarSpec.choice(list(options)), **kwargs)


def test_mask_application_matches_llguidance_reference_and_spares_other_rows():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 70)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31 - 1, (2, 3), dtype=np.int32)
    expected = logits.copy()
    sub = expected[[1, 3]].copy()
    llg_numpy.apply_token_bitmask_inplace(sub, bitmask)  # llguidance's own bit order
    expected[[1, 3]] = sub
    strided = np.ascontiguousarray(logits.T).T  # not contiguous: written through its strides
    apply_token_masks(logits, TokenMasks([1, 3], bitmask))
    apply_token_masks(strided, TokenMasks([1, 3], bitmask))
    assert np.array_equal(logits, expected) and np.array_equal(strided, expected)
    assert np.isinf(logits[[1, 3]]).any() and not np.isinf(logits[[0, 2, 4]]).any()


def test_constrained_rows_are_masked_unconstrained_pay_nothing_and_grammar_end_stops():
    runner = LogitsRunner()
    engine = make_engine(runner)
    free = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    assert engine.step() and runner.masks[-1] is None  # nothing constrained: no masks at all
    yes_no = engine.add_request([1, 2], choice("yes", "no"))
    done = run(engine)
    assert VOCAB[done[free][0].token_ids[0]] == "xx"
    out = done[yes_no][0]
    assert text(out) in ("yes", "no") and out.finish_reason == "stop"
    assert EOS not in out.token_ids  # ended by the grammar, not by sampling EOS
    masked = [m for m in runner.masks if m is not None]
    assert masked and all(len(m.rows) == 1 for m in masked)
    assert len(engine.grammars) == 0 or all(not r.is_finished for r in engine.scheduler.requests.values())


def test_every_format_compiles_and_bad_ones_name_the_problem():
    compiler = GrammarCompiler(ToyTokenizer())
    for spec in (GrammarSpec.choice(["yes", "no"]), GrammarSpec.regex("(ye|no)s?"), GrammarSpec.json_object(),
                 GrammarSpec.grammar('root ::= "ye" "s" | "no"'), GrammarSpec.json_schema({"enum": ["a", "b"]})):
        compiled = compiler.compile(spec)
        assert compiled.compile_s >= 0 and not compiled.new_matcher().is_error()
    assert compiler.compile(GrammarSpec.choice(["yes", "no"])) is compiler.compile(GrammarSpec.choice(["yes", "no"]))
    assert compiler.hits >= 1
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(GrammarSpec.regex("[a-"))
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec.json_schema({"type": "frobnicate"}))
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec.grammar("root ::= undefined_rule"))


def test_invalid_grammar_or_unsupported_runner_is_refused_and_leaves_no_state():
    engine = make_engine()
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2], SamplingParams(structured=GrammarSpec.regex("(unclosed")))
    assert not engine.has_unfinished_requests and engine.scheduler.kv.usage().used_blocks == 0
    plain = make_engine(FakeRunner(len(VOCAB)))
    with pytest.raises(InvalidRequestError, match="cannot constrain"):
        plain.add_request([1, 2], choice("yes", "no"))
    assert not plain.has_unfinished_requests


def test_forks_copy_the_matcher_and_each_sample_follows_the_grammar():
    runner = LogitsRunner()
    engine = make_engine(runner)
    rid = engine.add_request([1, 2], choice("yes", "no", "ab", temperature=5.0, seed=3, n=6))
    samples = run(engine)[rid]
    assert len(samples) == 6
    assert all(text(s) in ("yes", "no", "ab") and s.finish_reason == "stop" for s in samples)
    assert len({text(s) for s in samples}) > 1  # independent matchers: the samples diverge
    first_masked = next(m for m in runner.masks if m is not None)
    assert len(first_masked.rows) == 6  # the parent and its five forks, in their first step


def test_preemption_keeps_the_accepted_tokens():
    runner = LogitsRunner()
    # Too few blocks for all of them: some are preempted and recomputed mid-output.
    engine = make_engine(runner, num_kv_blocks=12, block_size=2, max_num_seqs=8)
    grammar = GrammarSpec.regex("(ab){5}")
    ids = [engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=12, temperature=0.0, structured=grammar))
           for _ in range(4)]
    done = run(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid in ids:
        assert text(done[rid][0]) == "ababababab" and done[rid][0].finish_reason == "stop"


def test_handover_replays_the_output_on_the_new_engine():
    source, target = make_engine(), make_engine()
    grammar = GrammarSpec.regex("(ab){4}")
    rid = source.add_request([1, 2, 3], SamplingParams(max_tokens=16, temperature=0.0, structured=grammar))
    for _ in range(3):
        source.step()
    request = source.detach_request(rid)
    assert request is not None and len(request.output_token_ids) == 3
    params = pickle.loads(pickle.dumps(request.sampling_params))  # what crosses to a Ray worker
    assert params.structured == grammar and params.structured.compiled is None
    moved = type(request)(rid, request.prompt_token_ids, params, 0.0)
    moved.output_token_ids = list(request.output_token_ids)
    target.scheduler.kv.allocate(rid, 0)
    target.add_prefilled_request(moved)
    out = run(target)[rid][0]
    assert text(out) == "abababab" and out.finish_reason == "stop"


def test_max_tokens_before_the_grammar_ends_is_length():
    engine = make_engine()
    rid = engine.add_request([1], SamplingParams(max_tokens=3, temperature=0.0, structured=GrammarSpec.regex("(ab){5}")))
    out = run(engine)[rid][0]
    assert out.finish_reason == "length" and text(out) == "aba"
    assert np.all(np.asarray(out.token_ids) > 0)
