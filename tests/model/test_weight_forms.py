"""Every form a checkpoint stores a real model's weights in stays that form when served in fp32:
an HF folder in bfloat16 and a GGUF of F16 matrices (SmolLM2-135M, its real weights) hold half
the bytes of fp32, a GGUF with Q2_K and Q3_K matrices a sixth; the products are the fp32 products
of the same values bit for bit, so logprobs and greedy tokens are those of the dense path (and of
transformers on the bf16 folder)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model.linear import Embedding, Linear, PackedWeight, bf16_dot_available
from conveyor.model.llama import model_bytes
from conveyor.model.loader import LoadedCheckpoint
from conveyor.runner.model_runner import LoadedModel, load_model
from conveyor.sampling import SamplingParams
from tests.helpers import load_in_fresh_process, write_gguf_from_hf

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n",
    "Once upon a time",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory, default_checkpoint: LoadedCheckpoint) -> Path:
    from conveyor.model.export import export_hf_folder

    c = default_checkpoint
    dense = {n: w for n, w in c.weights.items() if isinstance(w, np.ndarray)}
    return export_hf_folder(c.config, dense, c.tokenizer, tmp_path_factory.mktemp("bf16") / "smollm2", "bfloat16")


@pytest.fixture(scope="module")
def fp32_folder(tmp_path_factory: pytest.TempPathFactory, default_checkpoint: LoadedCheckpoint) -> Path:
    """SmolLM2's weights (its blocks' values) as an fp32 HF folder."""
    from conveyor.model.export import export_hf_folder

    c = default_checkpoint
    dense = {n: w for n, w in c.weights.items() if isinstance(w, np.ndarray)}
    return export_hf_folder(c.config, dense, c.tokenizer, tmp_path_factory.mktemp("fp32") / "smollm2", "float32")


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory: pytest.TempPathFactory, fp32_folder: Path, smollm_gguf_path: Path) -> Path:
    """SmolLM2's weights (its blocks' values, fp32) written as F16: values that bf16 cannot all hold."""
    path = tmp_path_factory.mktemp("f16") / "smollm2-f16.gguf"
    write_gguf_from_hf(path, "llama", fp32_folder, smollm_gguf_path, matrices="F16")
    return path


@pytest.fixture(scope="module", params=["bf16-folder", "f16-gguf"])
def source(request: pytest.FixtureRequest, bf16_folder: Path, f16_gguf: Path) -> tuple[Path, str]:
    return (bf16_folder, "BF16") if request.param == "bf16-folder" else (f16_gguf, "F16")


def low_bit_type(name: str, shape: tuple[int, ...]) -> str:
    """As llama.cpp's Q2_K / Q3_K_M files do: K-quants where a row is whole superblocks of 256
    (SmolLM2's down projections, 1,536 wide), a fallback type for the 576-wide rest."""
    if shape[-1] % 256:
        return "Q8_0"
    return "Q3_K" if int(name.split(".")[1]) % 2 == 0 else "Q2_K"


@pytest.fixture(scope="module")
def low_bit_gguf(tmp_path_factory: pytest.TempPathFactory, bf16_folder: Path, smollm_gguf_path: Path) -> Path:
    path = tmp_path_factory.mktemp("k") / "smollm2-q2_k-q3_k.gguf"
    write_gguf_from_hf(path, "llama", bf16_folder, smollm_gguf_path, matrices=low_bit_type)
    return path


def test_q2_k_and_q3_k_matrices_stay_in_blocks(low_bit_gguf: Path) -> None:
    """Down projections in Q3_K and Q2_K blocks (their codes as nibbles: 0.57 and 0.64 bytes a weight,
    where fp32 took 4), the rest Q8_0: logprobs of prefill and decode equal to the dense path's."""
    from conveyor.model.gguf_loader import read_gguf

    held = load_model(EngineConfig(model=str(low_bit_gguf), activation_dtype="float32"))  # Q8_0 exact too
    layouts = [layer.down.packed.layout for layer in held.model.layers]
    assert layouts == ["Q3_K", "Q2_K"] * 15
    down_bytes = sum(layer.down.packed.nbytes for layer in held.model.layers)
    file_bytes = sum(t.nbytes for t in read_gguf(low_bit_gguf).tensors.values() if ".ffn_down." in t.name)
    assert down_bytes < 1.7 * file_bytes and down_bytes < 0.17 * 4 * 30 * 576 * 1536
    dense = load_model(EngineConfig(model=str(low_bit_gguf), dequantize_weights=True))
    assert run(held, low_bit_gguf) == run(dense, low_bit_gguf)
    # and with int8 activations (the default), the Q2_K / Q3_K products stay fp32: only Q8_0's change
    fast = load_model(EngineConfig(model=str(low_bit_gguf)))
    assert [layer.down.packed.layout for layer in fast.model.layers] == layouts


def leaves(packed: PackedWeight) -> list[PackedWeight]:
    return list(packed.parts) if packed.parts else [packed]


def test_matrices_are_held_in_their_16_bits(source: tuple[Path, str]) -> None:
    path, qtype = source
    held = load_model(EngineConfig(model=str(path))).model
    linears = [m for m in held.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30
    for m in [*linears, held.embed]:
        assert m.weight is None and m.packed is not None
        assert {leaf.layout for leaf in leaves(m.packed)} == {qtype}
    assert isinstance(held.embed, Embedding) and held.head is held.embed  # tied: the head multiplies by the same panels
    dense = load_model(EngineConfig(model=str(path), dequantize_weights=True)).model
    assert all(m.packed is not None and m.packed.layout == "panels" for m in dense.modules() if isinstance(m, Linear))
    # 134.5M matrix weights at 2 bytes against 4; the norms (fp32 either way) are a few KiB
    assert 0.49 < model_bytes(held) / model_bytes(dense) < 0.51


def run(model: LoadedModel, path: Path) -> list[tuple[list[int], list[Any], list[Any]]]:
    """Greedy tokens, their top-5 logprobs and the prompt's logprobs, all prompts in one batch."""
    config = EngineConfig.from_kwargs(model=str(path), max_num_seqs=len(PROMPTS), num_kv_blocks=64, kv_cache_dtype="float32",
                                      activation_dtype=model.model.activation_dtype)
    engine = LLMEngine.from_config(config, model)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    ids = [engine.add_request(model.tokenizer.encode(p), params) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[Any]] = {i: [] for i in ids}
    prompt_logprobs: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = out.prompt_logprobs
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
    return [(tokens[i], logprobs[i], prompt_logprobs[i]) for i in ids]


def test_logprobs_equal_the_fp32_weights_bit_for_bit(source: tuple[Path, str]) -> None:
    """Prefill (the L2-buffer tiles) and decode (the in-register tiles) on the 16-bit panels against
    fp32 panels of the same values: every logprob equal, not close (exact activations: the fast
    default rounds x to bf16 for 16-bit weights on CPUs with AVX512-BF16, tested below)."""
    path, _ = source
    held = run(load_model(EngineConfig(model=str(path), activation_dtype="float32")), path)
    dense = run(load_model(EngineConfig(model=str(path), dequantize_weights=True)), path)
    assert all(len(tokens) == NEW_TOKENS and len(scored) == NEW_TOKENS for tokens, scored, _ in held)
    assert held == dense


def test_greedy_tokens_equal_transformers_on_the_bf16_folder(bf16_folder: Path) -> None:
    """transformers on the same folder (its bf16 weights computed in fp32) scores each prompt and our
    tokens in one pass: its argmax at every position must be our next token."""
    import torch  # the reference only: transformers runs on torch
    from transformers import AutoModelForCausalLM

    model = load_model(EngineConfig(model=str(bf16_folder), activation_dtype="float32"))
    ours = run(model, bf16_folder)
    hf = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.float32).eval()
    for text, (tokens, _, _) in zip(PROMPTS, ours):
        prompt = model.tokenizer.encode(text)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens[:-1]]),
                        logits_to_keep=torch.arange(len(prompt) - 1, len(prompt) + NEW_TOKENS - 1)).logits[0]
        assert logits.argmax(-1).tolist() == tokens, text


def test_dtype_bfloat16_holds_fp32_weights_as_the_bf16_folder_does(fp32_folder: Path, bf16_folder: Path) -> None:
    """`--dtype bfloat16` on an fp32 folder rounds each matrix to bf16 (nearest even) into the BF16
    panels, the activations staying fp32: the same panels, logprobs and tokens as the bf16 folder
    (those values, rounded once by export) served in fp32, at half the bytes of fp32 weights."""
    bf16 = load_model(EngineConfig(model=str(fp32_folder), dtype="bfloat16", activation_dtype="float32"))
    stored = load_model(EngineConfig(model=str(bf16_folder), activation_dtype="float32"))
    for ours, theirs in zip(bf16.model.modules(), stored.model.modules()):
        assert ours.packed is not None and theirs.packed is not None and ours.packed.layout == "BF16"
        assert np.array_equal(ours.packed.data, theirs.packed.data)
    assert bf16.model.dtype == "bfloat16" and np.array_equal(bf16.model.norm, stored.model.norm)
    assert run(bf16, fp32_folder) == run(stored, bf16_folder)
    dense = load_model(EngineConfig(model=str(fp32_folder), activation_dtype="float32"))
    assert 0.49 < model_bytes(bf16.model) / model_bytes(dense.model) < 0.51


def test_an_untied_16_bit_embedding_stays_in_the_file_s_mapping(tmp_path: Path) -> None:
    """An embedding no head multiplies by is read by rows only: its bf16 rows are read from the
    safetensors file's mapping (as a GGUF's blocks are), and the results are the dense path's
    (exact activations)."""
    import torch  # to write the bf16 checkpoint, as transformers would
    from safetensors.torch import load_file, save_file

    from tests.helpers import make_tiny_hf_checkpoint

    folder = make_tiny_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=False)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in weights.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    model = load_model(EngineConfig(model=str(folder), activation_dtype="float32"))
    embed = model.model.embed
    assert embed.blocks is not None and embed.blocks.qtype == "BF16" and embed.packed is None
    address = embed.blocks.blocks.ctypes.data
    mapped = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    assert any(int(m[0].split("-")[0], 16) <= address < int(m[0].split("-")[1], 16)
               and m[-1] == str(folder / "model.safetensors") for m in mapped if len(m) == 6)
    assert model.model.head.packed is not None and model.model.head.packed.layout == "BF16"
    dense = load_model(EngineConfig(model=str(folder), dequantize_weights=True))
    assert run(model, folder) == run(dense, folder)


def test_a_bf16_folder_loads_without_a_second_copy(bf16_folder: Path) -> None:
    """In a fresh process, the load's peak (file pages dropped tensor by tensor, each matrix packed
    from the mapping) within 10% of what the process holds once loaded, and the weights half of fp32's."""
    status = load_in_fresh_process(str(bf16_folder), hold="loaded.model", prelude="from conveyor.model.llama import model_bytes",
                                   then="s['weights'] = model_bytes(held)")
    assert status["VmHWM"] <= 1.10 * status["VmRSS"], status
    stored = (bf16_folder / "model.safetensors").stat().st_size
    assert 0.99 * stored <= status["weights"] <= 1.01 * stored, status


@pytest.mark.skipif(not bf16_dot_available(), reason="no AVX512-BF16 on this CPU")
def test_the_fast_default_on_16_bit_weights_stays_within_the_quality_bounds(source: tuple[Path, str]) -> None:
    """On a CPU with AVX512-BF16 the default activations multiply BF16 and F16 weights by x rounded
    to bf16 (F16 weights rounded so too); scored against the exact path on SmolLM2's bf16 folder and
    F16 GGUF, teacher-forced on the fixed texts, it keeps the bounds the int8 path keeps
    (tests/bench/test_quality.py), on the first 512 positions (its top-1 agreement, ~99.7%, is
    far above the bound at that many)."""
    from conveyor.bench.quality import half_weights_in_bf16, run_quality
    from tests.bench.test_quality import TOKENS, TOP1_BOUND

    path, qtype = source
    loaded = load_model(EngineConfig(model=str(path)))
    assert half_weights_in_bf16(loaded.model, "int8") and not half_weights_in_bf16(loaded.model, "float32")
    if qtype == "F16":  # the product rounds these weights too: some must move
        from conveyor.model.quantized import bf16_bits, bf16_to_float32

        packed = loaded.model.layers[0].down.packed  # type: ignore[union-attr, index]
        weights = packed.rows(np.arange(packed.out_features))
        assert not np.array_equal(weights, bf16_to_float32(bf16_bits(weights)))
    tokens = TOKENS // 2  # the suite is kept short
    for r in run_quality(loaded.model, loaded.tokenizer, "int8", tokens, 512, np.dtype(np.float16)):
        assert r.tokens == tokens - 1
        assert abs(r.ppl_ratio - 1.0) <= 0.005, r
        assert r.top1_agreement >= TOP1_BOUND, r
        assert abs(r.sampled_ppl_ratio - 1.0) <= 0.005, r
