"""Our tokenizer against transformers' tokenizer for the same GGUF, and the HF-folder path."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import InvalidRequestError
from conveyor.model.tokenizer import ChatTemplateError, Tokenizer
from tests.helpers import make_tiny_hf_checkpoint

TEXTS = [
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "In 2024, 3.14159 * 42 = 131.946878; call 555-0100 or +1 (800) 123-4567.",
    "1234567890 0 00 007",
    "a  b   c\t\td\n\ne \r\n f   ",
    "   leading and trailing spaces   ",
    "naïve café — déjà vu, Straße, Ωμέγα, Привет мир",
    "日本語のテキストと中文文本, 한국어",
    "emoji 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\tif x>=0: print(f'{x!r}')",
    '{"key": [1, 2, {"nested": null}], "s": "it\'s"}',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<|im_end|>",
    "don't won't I'm we've they'll she'd IT'S",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]
# Digits after 2+ spaces and non-ASCII digits: llama.cpp's 'smollm' pre-tokenizer and SmolLM2's own
# tokenizer.json split every digit off first; transformers' GGUF converter does not (it uses plain ByteLevel).
DIVERGENT = {"  42": [256, 36, 34], "x   7": [104, 333, 39], " ١٢٣ ": [216, 164, 111, 164, 112, 164, 113, 216]}


@pytest.fixture(scope="module")
def tok(default_checkpoint: Any) -> Tokenizer:
    return default_checkpoint.tokenizer


def test_special_token_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.eos_token_ids[0] == 2 and set(tok.eos_token_ids) == {2, 0}  # <|im_end|>, <|endoftext|>
    assert tok.add_bos_token is False
    assert tok.token_to_str(2) == "<|im_end|>"
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_reference_tokenizer: Any, text: str) -> None:
    expected = hf_reference_tokenizer.encode(text, add_special_tokens=True)
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok: Tokenizer, hf_reference_tokenizer: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_reference_tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


@pytest.mark.parametrize("text,ids", DIVERGENT.items())
def test_digits_split_like_llama_cpp(tok: Tokenizer, hf_reference_tokenizer: Any, text: str, ids: list[int]) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    # SmolLM2's tokenizer.json pre-tokenizer, applied to transformers' vocab and merges
    smollm = Backend.from_str(hf_reference_tokenizer.backend_tokenizer.to_str())
    smollm.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert tok.encode(text) == smollm.encode(text).ids == ids
    assert hf_reference_tokenizer.encode(text) != ids  # the documented divergence
    assert tok.decode(ids) == text


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "no-such-pre"])
def test_other_pre_tokenizers_match_transformers(smollm_gguf_path: Path, pre: str) -> None:
    """The same vocab under other `tokenizer.ggml.pre` values splits as transformers' converter does."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    from conveyor.model.gguf_loader import read_gguf

    arch, hf_dict, _ = get_gguf_tokenizer(str(smollm_gguf_path))
    hf, _ = convert_gguf_tokenizer(arch, {**hf_dict, "pre_tokenizer_type": pre})
    ours = Tokenizer.from_gguf({**read_gguf(smollm_gguf_path).metadata, "tokenizer.ggml.pre": pre})
    for text in [*TEXTS, *DIVERGENT, "Hello   world 12345678 ab'S", "x\n\n\ny  \n z", "ﬁ ℌ ²³ ½"]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcödé 😀 and <tags>"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_reference_tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = hf_reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("opening", ["The capital of France is", " spaced out \n", "4"])
def test_continuing_the_final_message_matches_transformers(tok: Tokenizer, hf_reference_tokenizer: Any,
                                                           opening: str) -> None:
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": opening}]
    expected = hf_reference_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert tok.apply_chat_template(messages, continue_final_message=True) == expected
    assert expected.rstrip().endswith(opening.strip()) and not expected.rstrip().endswith("<|im_end|>")


def test_template_variables_are_those_the_template_reads_beyond_the_renderers_own(tok: Tokenizer) -> None:
    assert tok.template_variables() == frozenset()  # SmolLM2's reads only messages and add_generation_prompt
    thinking = _with_template(tok, "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt "
                                   "and not enable_thinking %}<think></think>{% endif %}{{ bos_token }}"
                                   "{{ raise_exception('x') if mode == 'bad' else '' }}")
    assert thinking.template_variables() == {"enable_thinking", "mode"}
    rendered = thinking.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False, mode="ok")
    assert rendered.startswith("Hi<think></think>")
    with pytest.raises(InvalidRequestError):
        thinking.apply_chat_template([{"role": "user", "content": "Hi"}], continue_final_message=True, mode="bad")
    with pytest.raises(InvalidRequestError):  # an empty final message cannot be continued
        thinking.apply_chat_template([{"role": "user", "content": " "}], continue_final_message=True)


def test_gguf_reader_source_equals_metadata_source(tmp_path: Path) -> None:
    """from_gguf takes a gguf.GGUFReader as well as our parsed metadata (tiny vocab: the reader is slow)."""
    from gguf import GGUFReader, GGUFWriter

    from conveyor.model.gguf_loader import read_gguf
    from conveyor.model.tokenizer import bytes_to_unicode

    path = tmp_path / "tok.gguf"
    chars = sorted(set(bytes_to_unicode().values()))
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "he", "hel", "Ġw"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h e", "he l", "Ġ w"])
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    a, b = Tokenizer.from_gguf(GGUFReader(path)), Tokenizer.from_gguf(read_gguf(path).metadata)
    text = "<|im_start|>hello world 42 😀<|im_end|>"
    assert a.encode(text) == b.encode(text) and a.decode(a.encode(text), skip_special_tokens=False) == text
    assert a.encode("hel w")[:1] == [tokens.index("hel")] and a.encode("<|im_end|>") == [2]
    assert (a.eos_token_ids, a.vocab_size, a.chat_template) == (b.eos_token_ids, b.vocab_size, b.chat_template)


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok._tok, bos_token_id=1, eos_token_id=2, chat_template=template)


def test_template_features(tok: Tokenizer) -> None:
    t = _with_template(
        tok,
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{{ bos_token }}{{ m | tojson }}{{ eos_token }}{% endfor %}",
    )
    rendered = t.apply_chat_template([{"role": "u", "content": "é<>"}])
    assert rendered == '<|im_start|>{"role": "u", "content": "é<>"}<|im_end|>'
    with pytest.raises(InvalidRequestError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": ""}])
    with pytest.raises(ChatTemplateError):
        _with_template(tok, None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        _with_template(tok, "{% for %}").apply_chat_template([])


def test_from_hf_folder(tmp_path: Path, tok: Tokenizer, hf_reference_tokenizer: Any) -> None:
    folder = make_tiny_hf_checkpoint(tmp_path, "llama")
    hf_tok = Tokenizer.from_hf_folder(folder)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.vocab_size) == (1, 2, 49152)
    assert hf_tok.add_bos_token is False and 2 in hf_tok.eos_token_ids
    assert hf_tok.chat_template == tok.chat_template  # read from chat_template.jinja
    for text in TEXTS:  # the saved tokenizer.json carries transformers' pre-tokenizer
        assert hf_tok.encode(text) == hf_reference_tokenizer.encode(text)


def test_from_hf_folder_add_bos(tmp_path: Path) -> None:
    import json

    folder = make_tiny_hf_checkpoint(tmp_path, "llama")
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    t = Tokenizer.from_hf_folder(folder)
    assert t.encode("hi")[0] == 1 and t.encode("hi", add_special_tokens=False)[0] != 1


def test_sentencepiece_gguf_with_a_space_prefix_is_refused() -> None:
    """Llama 2-style SentencePiece (add_space_prefix) is not what the Gemma path builds: a clear error."""
    from conveyor.errors import UnsupportedModelError

    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"], "tokenizer.ggml.add_space_prefix": True}
    with pytest.raises(UnsupportedModelError, match="add_space_prefix"):
        Tokenizer.from_gguf(meta)


def test_sentencepiece_gguf_merges_follow_the_file_order() -> None:
    """A tiny Gemma-style vocabulary: merges ranked by token position, byte fallback for the rest,
    spaces as U+2581, a run of spaces stored as real spaces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *[f"<0x{b:02X}>" for b in range(256)],
              "a", "b", "c", "\u2581", "ab", "bc", "\u2581a", "abc", "  "]
    types = [3, 3, 3, 3, *[6] * 256, *[1] * 8, 4]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3}
    tok = Tokenizer.from_gguf(meta)
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.add_bos_token and tok.encode("abc") == [2, ids["abc"]]
    # "ab" ranks before "bc", so "abcb" is ab + c + b rather than a + bc + b
    assert tok.encode("abcb", add_special_tokens=False) == [ids["abc"], ids["b"]]
    assert tok.encode("bca", add_special_tokens=False) == [ids["bc"], ids["a"]]
    # "▁a" ranks before "▁▁" (the run of two spaces), so " a  a" keeps "▁a" twice; " a  b" takes the run
    assert tok.encode(" a  a", add_special_tokens=False) == [ids["\u2581a"], ids["\u2581"], ids["\u2581a"]]
    assert tok.encode(" a  b", add_special_tokens=False) == [ids["\u2581a"], ids["  "], ids["b"]]
    assert tok.encode("é", add_special_tokens=False) == [ids["<0xC3>"], ids["<0xA9>"]]  # byte fallback
    assert tok.decode(tok.encode("é a  ab")) == "é a  ab"


def _tiny_sentencepiece() -> tuple[Tokenizer, dict[str, int]]:
    """A Gemma-style vocabulary (adds BOS) with a template that writes `{{ bos_token }}` itself."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *[f"<0x{b:02X}>" for b in range(256)], "a", "b", "ab"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3, 3, *[6] * 256, 1, 1, 1],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}
    return Tokenizer.from_gguf(meta), {t: i for i, t in enumerate(tokens)}


def test_a_chat_starts_with_one_bos_whether_or_not_its_template_wrote_it() -> None:
    tok, ids = _tiny_sentencepiece()
    assert tok.add_bos_token
    rendered = tok.apply_chat_template([{"role": "user", "content": "ab"}])
    assert rendered == "<bos>ab"
    assert tok.encode_chat(rendered) == [ids["<bos>"], ids["ab"]]
    assert tok.encode_chat("ab") == [ids["<bos>"], ids["ab"]]  # a template that does not write it
    assert tok.encode_chat(rendered, add_special_tokens=True) == [ids["<bos>"], ids["<bos>"], ids["ab"]]  # as asked
    assert tok.encode_chat(rendered, add_special_tokens=False) == [ids["<bos>"], ids["ab"]]
    assert tok.encode_chat("ab", add_special_tokens=False) == [ids["ab"]]


# --- fill in the middle ---------------------------------------------------------------------------
def _tiny_infill_vocabulary(spelled: bool) -> tuple[Tokenizer, dict[str, int]]:
    """A vocabulary that adds BOS, with infill tokens found by their spelling or (with other
    spellings) named by llama.cpp's GGUF keys."""
    frame = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"] if spelled else ["<P>", "<S>", "<M>", "<E>"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *[f"<0x{b:02X}>" for b in range(256)], "a", "b", "ab", *frame]
    ids = {t: i for i, t in enumerate(tokens)}
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 3, *[6] * 256, 1, 1, 1, 3, 3, 3, 3],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3}
    if not spelled:  # the current keys for two, the older names for the middle
        meta |= {"tokenizer.ggml.fim_pre_token_id": ids["<P>"], "tokenizer.ggml.fim_suf_token_id": ids["<S>"],
                 "tokenizer.ggml.middle_token_id": ids["<M>"], "tokenizer.ggml.fim_pad_token_id": ids["<E>"]}
    return Tokenizer.from_gguf(meta), ids


def test_infill_tokens_spelled_as_plain_vocabulary_entries_are_found() -> None:
    """DeepSeek-Coder's are not special, and CodeGemma ends a middle with <|file_separator|>."""
    frame = ["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>",
             "<|file_separator|>"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *[f"<0x{b:02X}>" for b in range(256)], "a", "b", "ab", *frame]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3, 3, *[6] * 256, 1, 1, 1, 4, 4, 4, 3],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    tok = Tokenizer.from_gguf(meta)
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.infill is not None and (tok.infill.prefix, tok.infill.suffix, tok.infill.middle, tok.infill.ends) == (
        ids[frame[0]], ids[frame[1]], ids[frame[2]], (ids["<|file_separator|>"],))


def test_special_token_spellings_in_the_code_are_text() -> None:
    """A file may spell the model's own tokens (this repository's tokenizer does): the frame is
    the model's three tokens only, as llama.cpp tokenizes /infill's parts."""
    tok, ids = _tiny_infill_vocabulary(True)
    prompt = tok.encode_infill("a<|fim_middle|>", "<eos>b")
    frame = {ids["<|fim_prefix|>"], ids["<|fim_suffix|>"], ids["<|fim_middle|>"], ids["<eos>"]}
    assert [t for t in prompt if t in frame] == [ids["<|fim_prefix|>"], ids["<|fim_suffix|>"], ids["<|fim_middle|>"]]
    assert tok.decode(prompt, skip_special_tokens=False) == "<bos><|fim_prefix|>a<|fim_middle|><|fim_suffix|><eos>b" \
        "<|fim_middle|>"
    # The plain encode still reads them as the tokens, on other threads at the same time too (with
    # threads switching every microsecond, 25 of 300 went wrong in one run when the switch was not held).
    import sys
    from concurrent.futures import ThreadPoolExecutor

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(4) as pool:
            jobs = [(pool.submit(tok.encode, "a<|fim_middle|>" * 50, False),
                     pool.submit(tok.encode_infill, "a<|fim_middle|>", "<eos>b")) for _ in range(300)]
    finally:
        sys.setswitchinterval(interval)
    assert all(plain.result() == [ids["a"], ids["<|fim_middle|>"]] * 50 and infill.result() == prompt
               for plain, infill in jobs)


@pytest.mark.parametrize("spelled", [True, False])
def test_infill_tokens_come_from_the_file_or_their_spelling(spelled: bool) -> None:
    tok, ids = _tiny_infill_vocabulary(spelled)
    names = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"] if spelled else ["<P>", "<S>", "<M>", "<E>"]
    assert tok.infill is not None
    assert (tok.infill.prefix, tok.infill.suffix, tok.infill.middle, tok.infill.ends) == (*[ids[n] for n in names[:3]],
                                                                                         (ids[names[3]],))
    pre, suf, mid = (ids[n] for n in names[:3])
    assert tok.encode_infill("ab", "b") == [ids["<bos>"], pre, ids["ab"], suf, ids["b"], mid]
    assert tok.encode_infill("ab", "b", add_special_tokens=False) == [pre, ids["ab"], suf, ids["b"], mid]


def test_infill_tokens_of_the_real_models() -> None:
    from conveyor.errors import ModelLoadError
    from conveyor.model.loader import load_tokenizer

    try:
        qwen, smollm = load_tokenizer("qwen2.5-coder-0.5b"), load_tokenizer(None)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    fim = qwen.infill
    assert fim is not None and [qwen.token_to_str(t) for t in (fim.prefix, fim.suffix, fim.middle, *fim.ends)] == [
        "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    # Qwen adds no BOS; each part is tokenized alone, as llama.cpp's /infill does.
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    assert qwen.encode_infill(prefix, suffix) == [fim.prefix, *qwen.encode(prefix), fim.suffix, *qwen.encode(suffix),
                                                  fim.middle]
    # SmolLM2 has <repo_name> and <file_sep> but was not trained to infill.
    assert smollm.infill is None
    with pytest.raises(InvalidRequestError, match="fill-in-the-middle"):
        smollm.encode_infill(prefix, suffix)


@settings(max_examples=200, deadline=None)
@given(before=st.integers(0, 40), after=st.integers(0, 40), budget=st.integers(4, 90))
def test_an_infill_prompt_cut_to_size_keeps_the_code_nearest_the_middle(before: int, after: int, budget: int) -> None:
    """The prefix loses its start, the suffix its end; the suffix keeps a quarter of the room
    unless the prefix leaves it more; nothing is cut that fits."""
    tok, ids = _tiny_infill_vocabulary(True)
    prefix, suffix = "ab" * before, "b" * after
    whole = tok.encode_infill(prefix, suffix)
    cut = tok.encode_infill(prefix, suffix, max_tokens=budget)
    assert len(cut) == min(len(whole), budget)
    room = budget - 4  # BOS and the three frame tokens
    kept_before, kept_after = cut[2:cut.index(ids["<|fim_suffix|>"])], cut[cut.index(ids["<|fim_suffix|>"]) + 1:-1]
    assert kept_before == tok.encode(prefix, False)[before - len(kept_before):]
    assert kept_after == tok.encode(suffix, False)[:len(kept_after)]
    assert min(after, room // 4) <= len(kept_after) <= max(room // 4, room - before)
    assert len(kept_before) == min(before, room - len(kept_after))
    with pytest.raises(InvalidRequestError, match="at least 4 tokens"):
        tok.encode_infill(prefix, suffix, max_tokens=3)


def test_an_hf_post_processor_that_ends_texts_with_eos_is_followed(tmp_path: Path) -> None:
    """Qwen3-Embedding's tokenizer.json appends <|endoftext|> to every text (its embedding is that
    token's hidden state), which transformers does on encode; tokenizer_config's add_eos_token, where
    given, decides instead."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    folder = make_tiny_hf_checkpoint(tmp_path)
    plain = Tokenizer.from_hf_folder(folder)
    assert plain.eos_appended_id is None
    end = plain.backend.token_to_id("<|endoftext|>")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", end)])
    backend.save(str(folder / "tokenizer.json"))
    ending = Tokenizer.from_hf_folder(folder)
    assert ending.eos_appended_id == end
    assert ending.encode("hello") == plain.encode("hello") + [end]
    assert ending.encode("hello", add_special_tokens=False) == plain.encode("hello", add_special_tokens=False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": False}))
    assert Tokenizer.from_hf_folder(folder).eos_appended_id is None
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", end)])
    backend.save(str(folder / "tokenizer.json"))
    assert Tokenizer.from_hf_folder(folder).eos_appended_id is None  # put before the text: not appended
