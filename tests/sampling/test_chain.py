"""llama.cpp's sampler chain (conveyor/sampling/chain.py): its steps in the order named, the infill
step as llama.cpp's infill sampler decides, and the Sampler routing such rows to it."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from conveyor.errors import InvalidRequestError
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.sampling.chain import FIRST_CANDIDATE_WIDTH, InfillVocabulary, _chain_on_window, draw_by_chain, infill_step
from conveyor.sampling.sampler import Sampler

LLAMA_DEFAULT = ("top_k", "top_p", "min_p", "temperature")  # llama.cpp's default order, less its no-op samplers


def f32(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def randn(*shape: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def seeded_uniform(seed: int) -> float:
    """A seeded request's first uniform number: numpy's PCG64 seeded by its seed."""
    return float(np.random.Generator(np.random.PCG64(seed)).random())


def support(row: np.ndarray, chain: tuple[str, ...], **settings: float) -> set[int]:
    """Every token a draw can give, over uniforms spanning [0, 1)."""
    defaults = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
    s = {**defaults, **settings}
    return {draw_by_chain(row, chain, int(s["top_k"]), s["top_p"], s["min_p"], s["temperature"], u / 400, None)
            for u in range(400)}


def test_truncations_cut_the_models_distribution_and_temperature_comes_last() -> None:
    # probs at temperature 1 ~ [.61, .23, .08, .07, ...]: top_p 0.7 keeps the first two. At
    # temperature 3 first (vLLM's order) the distribution flattens and top_p keeps more.
    row = f32([3.0, 2.0, 1.0, 0.9, -2.0, -3.0])
    assert support(row, LLAMA_DEFAULT, top_p=0.7, temperature=3.0) == {0, 1}
    assert support(row, ("temperature", "top_p"), top_p=0.7, temperature=3.0) == {0, 1, 2}
    # min_p 0.3 of the model's distribution: p >= 0.3 * 0.61 keeps tokens 0 and 1
    assert support(row, LLAMA_DEFAULT, min_p=0.3, temperature=2.0) == {0, 1}
    assert support(row, LLAMA_DEFAULT, top_k=3) == {0, 1, 2}
    assert support(row, LLAMA_DEFAULT, temperature=0.0) == {0}


def test_top_p_before_top_k_reads_the_whole_distribution() -> None:
    # Two near-equal tokens over a long tail: over the whole vocabulary top_p 0.5 keeps hundreds (then
    # top-k 2 keeps both); over the two best alone the first would reach 0.5 by itself.
    row = np.concatenate([f32([0.0, -0.1]), np.full(998, -2.0, dtype=np.float32)])
    assert support(row, ("top_p", "top_k"), top_p=0.5, top_k=2) == {0, 1}
    assert support(row, ("top_k", "top_p"), top_p=0.5, top_k=2) == {0}


def test_a_step_not_named_is_not_applied() -> None:
    row = f32([3.0, 2.0, 1.0, 1.0])
    assert support(row, ("top_k",), top_k=2, temperature=0.0) == {0, 1}  # no temperature step: sampled at 1
    assert support(row, (), top_p=0.1, top_k=1) == {0, 1, 2, 3}


def test_the_draw_follows_the_softmax_of_what_is_left() -> None:
    row = f32([2.0, 1.0, 0.0, -5.0])
    draws = [draw_by_chain(row, LLAMA_DEFAULT, 3, 1.0, 0.0, 0.5, (u + 0.5) / 20000, None) for u in range(20000)]
    freq = np.bincount(np.array(draws), minlength=4) / len(draws)
    exps = np.exp(row[:3].astype(np.float64) / 0.5)
    assert np.allclose(freq[:3], exps / exps.sum(), atol=1e-3) and freq[3] == 0


CHAINS = [
    ("top_p", "min_p", "temperature"),  # llama.cpp's defaults with top_k 0
    ("top_k", "top_p", "min_p", "temperature"),
    ("min_p", "top_p", "temperature"),
    ("temperature", "top_p"),
    ("temperature",),
    ("top_p", "top_k", "temperature"),
]


@pytest.mark.parametrize("chain", CHAINS)
def test_the_window_draws_what_a_float64_sort_of_the_whole_row_draws(chain: tuple[str, ...]) -> None:
    # Rows as models give them (a few likely tokens over a long tail) and flat ones (whose nuclei run
    # past several widenings), a vocabulary of Qwen2.5's size; the reference sorts the whole row in
    # float64.
    rng = np.random.default_rng(len(chain))
    vocab = 151_936
    for spread in (8.0, 2.0, 0.3):
        row = randn(vocab, rng=rng, scale=spread)
        for top_k, top_p, min_p, temperature in ((0, 0.9, 0.05, 0.8), (0, 0.95, 0.0, 1.2), (50, 0.8, 0.1, 0.7)):
            for u in (0.0, 0.13, 0.5, 0.87, 0.999):
                fast = draw_by_chain(row, chain, top_k, top_p, min_p, temperature, u, None)
                exact = draw_by_chain(row.astype(np.float64), chain, top_k, top_p, min_p, temperature, u, None, width=vocab)
                assert fast == exact, (spread, top_k, top_p, min_p, temperature, u)


def test_a_peaked_row_is_drawn_on_its_first_window_and_a_flat_one_widens() -> None:
    rng = np.random.default_rng(0)
    peaked = randn(151_936, rng=rng, scale=8.0)
    flat = randn(151_936, rng=rng, scale=0.3)
    chain = ("top_p", "min_p", "temperature")  # no top-k: the cut is the nucleus's
    token, _ = _chain_on_window(peaked, chain, 151_936, 0.95, 0.05, 0.8, 0.5, None, FIRST_CANDIDATE_WIDTH)
    assert token is not None
    assert _chain_on_window(flat, chain, 151_936, 0.95, 0.0, 0.8, 0.5, None, FIRST_CANDIDATE_WIDTH) == (None, 0)
    # min_p alone cuts where the row says: the window must then reach every token above its floor
    row = np.concatenate([np.zeros(300, dtype=np.float32), np.full(151_636, -50.0, dtype=np.float32)])
    assert _chain_on_window(row, ("min_p", "infill"), 151_936, 1.0, 0.5, 1.0, 0.5,
                            vocabulary({}, set(), 0), FIRST_CANDIDATE_WIDTH) == (None, 300)


def vocabulary(pieces: dict[int, bytes], ends: set[int], end_id: int) -> InfillVocabulary:
    return InfillVocabulary(frozenset(ends), end_id, lambda t: pieces[t])


def sorted_candidates(probs: list[float]) -> tuple[np.ndarray, np.ndarray]:
    values = np.log(np.array(probs, dtype=np.float64))
    order = np.argsort(-values, kind="stable")
    return values[order].astype(np.float32), order


def test_infill_keeps_only_the_ends_when_ending_is_likely_enough() -> None:
    # 3 * p_end * n > p_text: 3 * 0.1 * 4 = 1.2 > 0.9
    pieces = {0: b"x = 1", 1: b"y", 2: b"<eos>", 3: b"z"}
    values, ids = sorted_candidates([0.5, 0.2, 0.1, 0.2])
    kept_values, kept_ids = infill_step(values, ids, vocabulary(pieces, {2}, 2))
    assert kept_ids.tolist() == [2] and kept_values.tolist() == [values[ids.tolist().index(2)].item()]


def test_infill_adds_a_tokens_probability_to_the_likelier_one_its_text_begins_or_extends() -> None:
    # "ret" begins "return": 0.3 + 0.25 on "ret" (the likelier); "x" 0.2, "(" 0.2 stay apart.
    # After the 0.2 threshold: "ret" 0.55, "x" 0.2, "(" 0.2 (and the end token); then 1 / (3 + 1):
    # "ret" alone stands out among the text.
    pieces = {0: b"ret", 1: b"return", 2: b"x", 3: b"(", 4: b"<eos>"}
    probs = [0.3, 0.25, 0.2, 0.2, 0.05]  # 3 * 0.05 * 5 = 0.75 < 0.95: no early end
    values, ids = sorted_candidates(probs)
    kept_values, kept_ids = infill_step(values, ids, vocabulary(pieces, {4}, 4))
    assert sorted(kept_ids.tolist()) == [0, 4]
    # The kept keep their own logits: the draw is over those (llama.cpp's dist recomputes them).
    assert np.allclose(kept_values, [math.log(0.3), math.log(0.05)])


def test_infill_never_merges_an_end_token_into_text() -> None:
    # "<" begins the spelling "<|endoftext|>", but a special token is no text (llama.cpp's
    # token_to_piece without specials): the end token keeps its own probability.
    from conveyor.model.loader import load_tokenizer
    from conveyor.model.tokenizer import token_piece

    tokenizer = load_tokenizer("smollm2-135m")
    eos = tokenizer.eos_token_id
    assert eos is not None and token_piece(tokenizer, eos) == b""
    lt = tokenizer.encode("<", add_special_tokens=False)[0]
    assert token_piece(tokenizer, lt) == b"<"
    words = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" x", " y", " z")]
    ids = np.array([lt, eos, *words])
    values = np.log(f32([0.5, 0.02, 0.16, 0.16, 0.16]))
    vocab = InfillVocabulary(frozenset({eos}), eos, lambda t: token_piece(tokenizer, t))
    _, kept = infill_step(values, ids, vocab)
    assert eos in kept.tolist() and lt in kept.tolist()


def test_infill_ends_where_no_text_stands_out() -> None:
    pieces = {i: bytes([65 + i]) for i in range(8)}
    pieces[8] = b"<eos>"
    probs = [0.12] * 8 + [0.0025]  # no text token reaches 0.2; ending is unlikely (3 * .0025 * 9 < .96)
    values, ids = sorted_candidates([p / sum(probs) for p in probs])
    kept_values, kept_ids = infill_step(values, ids, vocabulary(pieces, {8}, 8))
    assert kept_ids.tolist() == [8] and kept_values.size == 1


def requests(*params: SamplingParams) -> list[Request]:
    return [Request(str(i), [1], p, 0.0) for i, p in enumerate(params)]


def test_the_sampler_draws_chain_rows_by_their_chain_and_greedy_means_the_argmax() -> None:
    logits = np.tile(f32([3.0, 2.0, 1.0, 1.0, -2.0, -3.0]), (400, 1))
    params = SamplingParams(temperature=3.0, top_p=0.7, sampler_chain=LLAMA_DEFAULT)
    out = Sampler(seed=1)(logits, requests(*[params] * 400)).tokens
    assert set(out) == {0, 1}
    assert SamplingParams(temperature=0.0, sampler_chain=LLAMA_DEFAULT).greedy
    assert not SamplingParams(temperature=0.0, sampler_chain=("top_k",)).greedy  # no temperature step
    assert not SamplingParams(temperature=0.0, sampler_chain=("top_k", "infill", "temperature")).greedy
    seeded = SamplingParams(temperature=1.0, seed=7, sampler_chain=LLAMA_DEFAULT)
    rows = randn(3, 50, rng=np.random.default_rng(1))
    first = Sampler(seed=2)(rows, requests(seeded, SamplingParams(temperature=1.0), seeded)).tokens
    again = Sampler(seed=9)(rows[[0]], requests(seeded)).tokens
    assert first[0] == again[0]  # a seeded chain row draws the same whatever its batch


def test_a_batch_of_chain_rows_draws_what_each_row_sorted_whole_in_float64_draws() -> None:
    # The batch's first windows are found together (Sampler: first_windows); rows whose top-k cuts
    # first, rows without top-k and rows tempered before their nucleus, at several spreads.
    vocab = 151_936
    logits = randn(6, vocab, rng=np.random.default_rng(3)) * f32([8.0, 2.0, 8.0, 0.5, 4.0, 8.0])[:, None]
    settings = [dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, sampler_chain=LLAMA_DEFAULT),
                dict(top_k=0, top_p=0.95, min_p=0.05, temperature=0.8, sampler_chain=LLAMA_DEFAULT),
                dict(top_k=0, top_p=0.9, temperature=1.5, sampler_chain=("temperature", "top_p")),
                dict(top_k=0, top_p=0.95, temperature=1.0, sampler_chain=LLAMA_DEFAULT),
                dict(top_k=1000, top_p=0.99, temperature=1.0, sampler_chain=("top_p", "top_k", "temperature")),
                dict(top_k=0, min_p=0.2, temperature=0.7, sampler_chain=("min_p", "temperature"))]
    params = [SamplingParams(seed=11 + i, **setting) for i, setting in enumerate(settings)]  # type: ignore[arg-type]
    drawn = Sampler(seed=0)(logits, requests(*params)).tokens
    for i, p in enumerate(params):
        uniform = seeded_uniform(11 + i)
        assert drawn[i] == draw_by_chain(logits[i].astype(np.float64), p.sampler_chain or (), p.top_k, p.top_p, p.min_p,
                                         p.temperature, uniform, None, width=vocab), i


def softmax64(values: np.ndarray) -> np.ndarray:
    exps = np.exp(values - values.max())
    return exps / exps.sum()


def reference_draw(row: np.ndarray, chain: tuple[str, ...], top_k: int, top_p: float, min_p: float,
                   temperature: float, uniform: float, vocabulary: InfillVocabulary | None) -> int:
    """llama.cpp's chain read literally, in float64 on the whole row sorted (ties by token id): the
    specification the window is held to (the infill step is infill_step's, tested above)."""
    ids = np.argsort(-row.astype(np.float64), kind="stable")
    values = row.astype(np.float64)[ids]
    for step in chain:
        if step == "top_k" and 0 < top_k < values.size:
            values, ids = values[:top_k], ids[:top_k]
        elif step == "top_p" and top_p < 1.0:
            probs = softmax64(values)
            before = np.concatenate([np.zeros(1), np.cumsum(probs)[:-1]])
            keep = max(1, int((before < top_p).sum()))
            values, ids = values[:keep], ids[:keep]
        elif step == "min_p" and min_p > 0.0:
            keep = max(1, int((values >= values[0] + math.log(min_p)).sum()))
            values, ids = values[:keep], ids[:keep]
        elif step == "temperature":
            values, ids = (values[:1], ids[:1]) if temperature < 1e-5 else (values / temperature, ids)
        elif step == "infill":
            assert vocabulary is not None
            values, ids = infill_step(values, ids, vocabulary)
    cdf = np.cumsum(softmax64(values))
    return int(ids[min(int((cdf <= uniform * float(cdf[-1])).sum()), values.size - 1)])


def test_random_chains_on_rows_with_banned_tokens_draw_what_the_literal_chain_draws() -> None:
    # Any order of the five steps, some twice, on rows mostly banned (-inf: a logit bias, a grammar),
    # peaked or flat, top-k past the window or the row, greedy temperatures; the infill step judges
    # the ends against the texts (token 0 ends; each token's text is distinct).
    rng = np.random.default_rng(5)
    pick = random.Random(5)
    vocab = 3000
    infill = vocabulary({t: f"t{t}".encode() for t in range(vocab)}, {0}, 0)
    for case in range(400):
        row = randn(vocab, rng=rng, scale=pick.choice([0.5, 3.0, 10.0]))
        if case % 3 == 0:
            banned = rng.random(vocab) < pick.choice([0.9, 0.995])
            banned[int(row.argmax())] = False
            row = np.where(banned, np.float32(-np.inf), row)
        chain = tuple(pick.choice(["top_k", "top_p", "min_p", "temperature", "infill"])
                      for _ in range(pick.randint(0, 4)))
        settings = (pick.choice([0, -1, 5, 40, 300, 2999, 3000, 5000]), pick.choice([1.0, 0.95, 0.5, 0.1]),
                    pick.choice([0.0, 0.05, 0.3]), pick.choice([0.0, 0.7, 1.0, 2.0]), pick.random())
        drawn = draw_by_chain(row, chain, *settings, infill)
        assert drawn == reference_draw(row, chain, *settings, infill), (case, chain, settings)


def test_a_seeded_chain_row_draws_the_same_beside_any_batch_mate() -> None:
    # Logits rounded as bf16 weights give them, so ties are common: a row's window must not depend on
    # how wide its batch-mates' windows are.
    # bf16 keeps a float32's top 16 bits (rounded here by truncation).
    row = (randn(151_936, rng=np.random.default_rng(2), scale=4).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    mate = SamplingParams(seed=999, top_k=5000, top_p=0.95, temperature=0.8, sampler_chain=LLAMA_DEFAULT)
    for seed in range(40):
        mine = SamplingParams(seed=seed, top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, sampler_chain=LLAMA_DEFAULT)
        alone = Sampler()(row[None], requests(mine)).tokens[0]
        again = SamplingParams(seed=seed, top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, sampler_chain=LLAMA_DEFAULT)
        assert Sampler()(np.stack([row, row]), requests(again, mate)).tokens[0] == alone, seed


def test_an_unknown_step_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="sampler_chain"):
        SamplingParams(sampler_chain=("top_k", "mirostat"))
