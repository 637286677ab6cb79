"""`conveyor export-hf`: the exported folder is the GGUF model, for conveyor and for transformers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conveyor.model.export import EXPORTED_FILES, export_hf_folder
from conveyor.model.loader import LoadedCheckpoint, load_checkpoint

TEXTS = [
    "Hello, world!",
    "  42 apples and 3.14159 pies\n\nnew paragraph\tTab",
    "Ünïcödé ✓ 日本語 🙂",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, default_checkpoint: LoadedCheckpoint) -> Path:
    c = default_checkpoint
    return export_hf_folder(c.config, c.weights, c.tokenizer, tmp_path_factory.mktemp("export") / "smollm2")


def test_files_and_config(exported: Path, default_checkpoint: LoadedCheckpoint) -> None:
    assert sorted(p.name for p in exported.iterdir()) == sorted(EXPORTED_FILES)
    cfg = json.loads((exported / "config.json").read_text())
    c = default_checkpoint.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == c.rope_theta
    assert cfg["rms_norm_eps"] == c.rms_norm_eps and cfg["max_position_embeddings"] == c.max_position_embeddings
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == list(c.eos_token_ids)
    tok_cfg = json.loads((exported / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == default_checkpoint.tokenizer.chat_template
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_conveyor_loads_it_back(exported: Path, default_checkpoint: LoadedCheckpoint) -> None:
    back = load_checkpoint(str(exported), "float32")
    assert back.config == default_checkpoint.config
    assert set(back.weights) == set(default_checkpoint.weights)
    for name, t in default_checkpoint.weights.items():
        assert np.array_equal(back.weights[name], t), name
    ours, theirs = default_checkpoint.tokenizer, back.tokenizer
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.eos_token_ids, theirs.add_bos_token, theirs.vocab_size) \
        == (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids, ours.add_bos_token, ours.vocab_size)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids) == ours.decode(ids)
        assert theirs.decode(ids, skip_special_tokens=False) == ours.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "Hi there"}]
    assert theirs.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_transformers_matches_gguf_reference(
    exported: Path, default_checkpoint: LoadedCheckpoint, hf_reference_model: Any
) -> None:
    import torch  # the reference only: transformers runs on torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == (
        model.model.embed_tokens.weight.data_ptr())
    tok = AutoTokenizer.from_pretrained(exported)
    ours = default_checkpoint.tokenizer
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = ours.apply_chat_template(messages)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    for text in [*TEXTS, prompt]:
        assert tok(text)["input_ids"] == ours.encode(text), text
    ids = torch.tensor([ours.encode(prompt)])
    with torch.no_grad():
        got = model(ids).logits
        want = hf_reference_model(ids).logits
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_tokenizer_that_appends_eos_is_exported_so(tmp_path: Path, smollm_gguf_path: Path) -> None:
    """An embedding model's GGUF asks for EOS after every text (add_eos_token): the exported folder's
    tokenizer appends it too, for conveyor and for transformers, and a chat prompt still ends where
    the template does."""
    from transformers import AutoTokenizer

    from conveyor.model.loader import load_checkpoint
    from tests.helpers import make_tiny_hf_checkpoint, write_gguf_from_hf

    path = tmp_path / "tiny-embedding.gguf"
    write_gguf_from_hf(path, "qwen3", make_tiny_hf_checkpoint(tmp_path, "qwen3"), smollm_gguf_path, add_eos_token=True)
    c = load_checkpoint(str(path))
    assert c.tokenizer.eos_appended_id == 2 and c.tokenizer.encode("hello")[-1] == 2
    folder = export_hf_folder(c.config, c.weights, c.tokenizer, tmp_path / "exported")
    ours = load_checkpoint(str(folder)).tokenizer
    assert ours.eos_appended_id == 2 and ours.encode("hello") == c.tokenizer.encode("hello")
    assert AutoTokenizer.from_pretrained(folder)("hello")["input_ids"] == c.tokenizer.encode("hello")
    assert ours.encode_chat("hello") == ours.encode("hello")[:-1]
