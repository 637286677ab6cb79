"""Text <-> token ids and chat rendering, from an HF tokenizer.json or from GGUF metadata."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from conveyor.errors import ConveyorError, InvalidRequestError, ModelLoadError, UnsupportedModelError
from conveyor.model import generation_defaults

# Chat models end a turn with one of these rather than with the checkpoint's eos; stop on them too.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

# llama.cpp's split regexes (llama-vocab.cpp), keyed by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"}
_QWEN2_PRES = {"qwen2", "deepseek-r1-qwen", "megrez"}
# StarCoder-style vocabularies (SmolLM's included) were trained with every digit split off first.
_DIGIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_CONTROL, _USER_DEFINED = 3, 4

# Fill-in-the-middle. llama.cpp's GGUF keys (tokenizer.ggml.<key>_token_id; the older names second),
# then, in a vocabulary without them, the spellings code models use (prefix, suffix, middle).
_INFILL_KEYS = (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
_INFILL_END_KEYS = ("fim_pad", "fim_rep", "fim_sep")
_INFILL_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek-Coder
)
# A middle ends at the model's EOS or at one of these (padding, or the next file of a repository),
# which llama.cpp counts as end-of-generation tokens too.
_INFILL_END_SPELLINGS = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<|repo_name|>", "<|fim_repo|>", "<repo_name>",
                         "<fim-repo>", "<|file_sep|>", "<file_sep>", "<fim-sep>", "<|file_separator|>")
# The repository-level pattern's tokens (a repository's name, then each file after a separator),
# spelled as llama.cpp finds them (llama-vocab.cpp).
_INFILL_REPO_SPELLINGS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_INFILL_FILE_SEPARATOR_SPELLINGS = ("<|file_sep|>",)


class _SharedBackend:
    """Encodes share one backend, whose switch for reading special-token spellings in a text as
    those tokens is its own state: an encode that turns it off holds the backend alone, the others
    run side by side (the backend lets go of the GIL while it encodes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._alone = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._sharing += 1
        try:
            yield
        finally:
            with self._cond:
                self._sharing -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._sharing)
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


@dataclass(frozen=True)
class InfillTokens:
    """A code model's fill-in-the-middle tokens: the three that frame a prompt, and those besides
    EOS that end the middle it writes."""

    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]
    # llama.cpp's repository-level pattern (its /infill's input_extra): a repository's name after
    # `repo`, then each file's name and text after `file_separator`; None where the model has none.
    repo: int | None = None
    file_separator: int | None = None

    @classmethod
    def find(cls, backend: _HFTokenizer, from_metadata: Mapping[str, int] | None = None) -> InfillTokens | None:
        """From ids the file names (`from_metadata`: "fim_pre", "fim_suf", "fim_mid" and any of
        "fim_pad", "fim_rep", "fim_sep"), else by their spellings anywhere in the vocabulary (some
        models mark them special, others not); None without them."""
        known = dict(from_metadata or {})
        frame: tuple[int, ...] = tuple(known[k] for k, _ in _INFILL_KEYS if k in known)
        for spelled in _INFILL_SPELLINGS if len(frame) < 3 else ():
            found = [i for i in map(backend.token_to_id, spelled) if i is not None]
            if len(found) == 3:
                frame = tuple(found)
                break
        if len(frame) < 3:
            return None
        ends = [known[k] for k in _INFILL_END_KEYS if k in known]
        ends += [i for i in map(backend.token_to_id, _INFILL_END_SPELLINGS) if i is not None]

        def first(key: str, spellings: tuple[str, ...]) -> int | None:
            return known.get(key, next((i for i in map(backend.token_to_id, spellings) if i is not None), None))

        return cls(frame[0], frame[1], frame[2], tuple(dict.fromkeys(ends)), first("fim_rep", _INFILL_REPO_SPELLINGS),
                   first("fim_sep", _INFILL_FILE_SEPARATOR_SPELLINGS))


class ChatTemplateError(ConveyorError, ValueError):
    """The checkpoint has no chat template, the one it has does not compile, or it failed on the
    messages (a value of a shape it does not expect: the caller's to fix)."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes one token stands for: a byte-level vocabulary's spelling read back into bytes,
    else the token decoded (special tokens as spelled)."""
    spelled = getattr(tokenizer, "token_to_str", lambda _: None)(token_id)
    table = _byte_decoder()
    if spelled and all(c in table for c in spelled):
        return bytes(table[c] for c in spelled)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_piece(tokenizer: Any, token_id: int) -> bytes:
    """A token's text as llama.cpp's token_to_piece gives it without special tokens: a special
    token is no text at all (b""), any other its bytes."""
    return b"" if token_id in getattr(tokenizer, "special_ids", ()) else token_bytes(tokenizer, token_id)


def _gguf_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) reproducing llama.cpp's split for this `tokenizer.ggml.pre`."""
    if pre in _DIGIT_PRES:
        # Same as SmolLM2's tokenizer.json. transformers' GGUF converter omits Digits here, which
        # differs on e.g. "  42" (two spaces before a number) and non-ASCII digits.
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)]), False
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT if pre in _QWEN2_PRES else None
    if split is None:  # "gpt-2" and anything unknown: GPT-2's own regex, as transformers falls back to
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    isolated = pre_tokenizers.Split(Regex(split), behavior="isolated")
    seq = pre_tokenizers.Sequence([isolated, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # llama.cpp looks a whole llama3 word up in the vocab before merging (ignore_merges).
    return seq, pre in _LLAMA3_PRES


def _gguf_metadata(source: Any) -> Mapping[str, Any]:
    """Accept our parsed metadata dict or a `gguf.GGUFReader`."""
    if isinstance(source, Mapping):
        return source
    fields = getattr(source, "fields", None)
    if fields is None:
        raise TypeError(f"expected GGUF metadata mapping or gguf.GGUFReader, got {type(source).__name__}")
    return {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


def _appended_by_post_processor(backend: _HFTokenizer) -> int | None:
    """The one special token tokenizer.json's post-processor puts after every text (Qwen3-Embedding's
    <|endoftext|>), found by encoding a text with and without it; None if it appends none, or more."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start: start + len(plain)] == plain:
            after = full[start + len(plain):]
            return after[0] if len(after) == 1 else None
    return None


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts and chat template of one checkpoint."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        eos_appended_id: int | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        recommended_sampling: Mapping[str, float | int] | None = None,
        infill_ids: Mapping[str, int] | None = None,
    ) -> None:
        self._tok = backend
        # None: the model was not trained to fill in the middle (no prefix / suffix / middle tokens).
        self.infill: InfillTokens | None = InfillTokens.find(backend, infill_ids)
        # What the model's files recommend for sampling (conveyor.model.generation_defaults): read
        # here because the files are, and every front end (a Ray one too) holds the tokenizer.
        self.recommended_sampling: dict[str, float | int] = dict(recommended_sampling or {})
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        # The token a text ends with when special tokens are added (None: none): a GGUF's
        # add_eos_token, or what an HF folder's post-processor appends. Embedding models ask for it
        # (Qwen3-Embedding pools the hidden state of a final <|endoftext|>), as llama.cpp appends it.
        self.eos_appended_id = eos_appended_id
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(special)
        self._sharing = _SharedBackend()
        turn_ends = [i for i in map(backend.token_to_id, _END_OF_TURN) if i is not None and i in special]
        eos = [eos_token_id] if eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_ids, *turn_ends]))
        self._template_vars = {
            "bos_token": self.token_to_str(bos_token_id),
            "eos_token": self.token_to_str(eos_token_id),
            **{k: v for k, v in (special_tokens or {}).items() if v is not None},
        }
        self._compiled: jinja2.Template | None = None
        self._variables: frozenset[str] | None = None  # template_variables(), once asked

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped `tokenizers.Tokenizer` (its post-processor is bypassed by `encode`)."""
        return self._tok

    @property
    def end_of_generation_ids(self) -> tuple[int, ...]:
        """llama.cpp's end-of-generation set: EOS and the ends of a turn (eos_token_ids), and a code
        model's ends of a middle (padding, the next file)."""
        middle_ends = self.infill.ends if self.infill is not None else ()
        return tuple(dict.fromkeys([*self.eos_token_ids, *middle_ends]))

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad token strings known for this checkpoint (the chat template's variables)."""
        return {k: v for k, v in self._template_vars.items() if isinstance(v, str)}

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """`parse_special` False: a special token's spelling in `text` is text, not that token
        (llama.cpp's parse_special; a file a code model reads may spell them)."""
        tail = [self.eos_appended_id] if add_special_tokens and self.eos_appended_id is not None else []
        return self._bos(add_special_tokens) + self._text_ids(text, parse_special) + tail

    def _bos(self, add_special_tokens: bool) -> list[int]:
        """BOS where special tokens are added and the model asks for it (add_bos_token)."""
        return [self.bos_token_id] if add_special_tokens and self.add_bos_token and self.bos_token_id is not None else []

    def _text_ids(self, text: str, parse_special: bool = True) -> list[int]:
        # The backend's own post-processor is bypassed so that BOS and EOS follow the flags alone.
        with self._sharing.shared():
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if not parse_special and not self._special_ids.isdisjoint(ids):
            with self._sharing.alone():
                self._tok.encode_special_tokens = True
                try:
                    ids = self._tok.encode(text, add_special_tokens=False).ids
                finally:
                    self._tok.encode_special_tokens = False
        return ids

    def encode_infill(self, prefix: str, suffix: str, max_tokens: int | None = None,
                      add_special_tokens: bool = True) -> list[int]:
        """The prompt asking a code model for the text between `prefix` and `suffix`: its prefix,
        suffix and middle tokens around them, in the prefix-suffix-middle order of llama.cpp's
        /infill without its repository header; each part is tokenized alone, special-token
        spellings in it as text. `max_tokens`: at most that many, the prefix losing its start and
        the suffix its end, the suffix keeping a quarter of the room (llama.cpp's 3:1) and more
        where the prefix leaves it unused. Raises InvalidRequestError naming `suffix` for a model
        without infill tokens, `truncate_prompt_tokens` for a `max_tokens` below the frame."""
        fim = self.infill
        if fim is None:
            raise InvalidRequestError("this model has no fill-in-the-middle tokens: a suffix needs a code model "
                                      "trained to infill (e.g. Qwen2.5-Coder, StarCoder2, CodeGemma)", param="suffix")
        head = self._bos(add_special_tokens)
        before = self.encode(prefix, False, parse_special=False)
        after = self.encode(suffix, False, parse_special=False)
        if max_tokens is not None:
            room = max_tokens - len(head) - 3
            if room < 0:
                raise InvalidRequestError(f"a fill-in-the-middle prompt takes at least {len(head) + 3} tokens, "
                                          f"not {max_tokens}", param="truncate_prompt_tokens")
            keep_after = min(len(after), max(room // 4, room - len(before)))
            keep_before = min(len(before), room - keep_after)
            before, after = before[len(before) - keep_before:], after[:keep_after]
        return [*head, fim.prefix, *before, fim.suffix, *after, fim.middle]

    def encode_chat(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """A rendered chat's ids. By default (None) the model's BOS is added unless the template
        already wrote it (Gemma's and Llama 3's templates begin with `{{ bos_token }}`), so the
        prompt starts with exactly one, as llama.cpp's server renders it; True or False as asked.
        Never an appended EOS (eos_appended_id): the reply follows the rendered chat."""
        if add_special_tokens is None:
            bos = self.token_to_str(self.bos_token_id)
            add_special_tokens = not (bos and text.startswith(bos))
        return self._bos(add_special_tokens) + self._text_ids(text)

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """A conversation's prompt ids: rendered for the assistant's reply, then `encode_chat`."""
        return self.encode_chat(self.apply_chat_template(messages, add_generation_prompt=True))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the vocabulary's special (control) tokens."""
        return self._special_ids

    def token_to_str(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.token_to_str(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if not self.chat_template:
                raise ChatTemplateError("this checkpoint has no chat template; send a plain prompt instead")
            try:
                self._compiled = _compile_template(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the checkpoint's chat template does not compile: {e}") from e
        return self._compiled

    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from whoever renders it, beyond those this renderer
        sets (messages, add_generation_prompt, tools, documents, the special tokens): what a caller's
        extra variables (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking) may name."""
        if self._variables is None:
            self._template()
            assert self.chat_template is not None
            self._variables = _variables_read(self.chat_template, self._template_vars)
        return self._variables

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, chat_template: str | None = None, tokenize: bool = False,
        **kwargs: Any
    ) -> str:
        """Render like transformers' `apply_chat_template(..., tokenize=False)`, with the model's
        template or `chat_template` for this call. With `continue_final_message` the text ends where
        the last message's content does (no end of turn after it), so the model goes on with that
        message: a reply's opening given by the caller. Extra keyword arguments become template
        variables (tools=[...] for tool calls); one the template never reads is refused, not
        ignored. A message's content may be OpenAI's text parts, or None beside tool calls.
        `tokenize` is transformers' (and vLLM's tokenizer's): only False, the text, is offered here."""
        if tokenize:
            raise InvalidRequestError("apply_chat_template returns the text; encode_messages(messages) gives its "
                                      "token ids", param="tokenize")
        if chat_template is None:
            template, reads = self._template(), self.template_variables()
        else:
            template, reads = _compiled_with_reads(chat_template, tuple(self._template_vars))
        unknown = sorted(set(kwargs) - reads - {"tools", "documents"} - set(self._template_vars))
        if unknown:
            raise InvalidRequestError(f"the chat template does not read {unknown[:5]}", param="chat_template_kwargs")
        messages = [_template_message(m) for m in messages]
        variables = {"tools": None, "documents": None, **self._template_vars, **kwargs}
        if continue_final_message:
            add_generation_prompt = False
        try:
            text: str = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # e.g. raise_exception("roles must alternate")
            raise InvalidRequestError(f"chat template rejected the messages: {e}") from e
        except Exception as e:  # noqa: BLE001 - the template runs on the caller's values (tojson of Undefined: a TypeError)
            raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from e
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            # The template may strip the content: look for it as given, then stripped.
            for content in (final, final.strip()) if isinstance(final, str) and final.strip() else ():
                if content in text:
                    return text[: text.rindex(content) + len(content)]
            raise InvalidRequestError("continue_final_message: the final message's content does not appear in the "
                                      "rendered chat (it must be non-empty text the chat template keeps)",
                                      param="continue_final_message")
        return text

    def set_chat_template(self, template: str) -> None:
        """Replace the checkpoint's chat template (`conveyor serve --chat-template FILE`)."""
        self.chat_template, self._compiled, self._variables = template, compile_chat_template(template), None

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """From `tokenizer.ggml.*` metadata (a dict or a `gguf.GGUFReader`): byte-level BPE ("gpt2")
        or a SentencePiece BPE vocabulary with byte fallback ("llama", as Gemma's)."""
        meta = _gguf_metadata(source)
        model = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        pre = meta.get("tokenizer.ggml.pre")
        if model == "gpt2":
            backend = _byte_level_backend(meta, tokens, types, pre)
        elif model == "llama":
            backend = _sentencepiece_backend(meta, tokens, types)
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' or SentencePiece 'llama')"
            )

        def tid(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None else None

        infill_ids: dict[str, int] = {}
        for key, older in (*_INFILL_KEYS, *((k, k) for k in _INFILL_END_KEYS)):
            found = tid(f"{key}_token_id")
            found = tid(f"{older}_token_id") if found is None else found
            if found is not None:
                infill_ids[key] = found
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos = True if model == "llama" else pre in _LLAMA3_PRES
        return cls(
            backend,
            bos_token_id=tid("bos_token_id"),
            eos_token_id=tid("eos_token_id"),
            extra_eos_ids=[i for i in [tid("eot_token_id"), tid("eom_token_id")] if i is not None],
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(add_bos),
            eos_appended_id=tid("eos_token_id") if meta.get("tokenizer.ggml.add_eos_token") else None,
            special_tokens={
                "unk_token": tokens[u] if (u := tid("unknown_token_id")) is not None else None,
                "pad_token": tokens[p] if (p := tid("padding_token_id")) is not None else None,
            },
            recommended_sampling=generation_defaults.from_gguf_metadata(meta),
            infill_ids=infill_ids,
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json, config.json)."""
        folder = Path(path)
        tj = folder / "tokenizer.json"
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on missing/corrupt files
            raise ModelLoadError(f"cannot read tokenizer {tj}: {e}") from e
        cfg = _read_json(folder / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        bos_str, eos_str = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        bos = backend.token_to_id(bos_str) if bos_str else None
        eos = backend.token_to_id(eos_str) if eos_str else None
        extra: list[int] = []
        generation = _read_json(folder / generation_defaults.GENERATION_CONFIG)
        for data in (generation, _read_json(folder / "config.json")):
            ids = data.get("eos_token_id")
            extra += ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []
        if eos is None and extra:
            eos = extra[0]
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # then it is whatever tokenizer.json's post-processor does
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        add_eos = cfg.get("add_eos_token")
        appended = (eos if add_eos else None) if add_eos is not None else _appended_by_post_processor(backend)
        specials = {k: _token_content(cfg.get(k)) for k in ("unk_token", "pad_token")}
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_ids=extra,
            chat_template=template,
            add_bos_token=bool(add_bos),
            eos_appended_id=appended,
            special_tokens=specials,
            recommended_sampling=generation_defaults.from_generation_config(generation),
        )


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int], pre: str | None) -> _HFTokenizer:
    spell, alphabet = bytes_to_unicode(), set(bytes_to_unicode().values())
    # Tokens llama.cpp stored as raw text rather than in the byte alphabet get respelled, as transformers does.
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre_tok, ignore_merges = _gguf_pre_tokenizer(pre)
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocab.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend


_SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_merges(tokens: list[str], rank: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a BPE vocabulary implies, best first: every split of a token into two tokens,
    ranked by the token's position in the file, then longer left halves first. The file has no
    merges, and Gemma's scores do not follow its merge order: its token order does (transformers
    rebuilds its GGUF tokenizer this way, and llama.cpp's merge of the best-scoring pair agrees)."""
    pairs: list[tuple[int, str, str]] = []
    append = pairs.append
    for token, position in rank.items():  # in file order unless a respelled token repeats one
        for cut in range(len(token) - 1, 0, -1):
            left = token[:cut]
            if left in rank:
                right = token[cut:]
                if right in rank:
                    append((position, left, right))
    if any(a[0] > b[0] for a, b in zip(pairs, pairs[1:])):
        pairs.sort(key=lambda pair: pair[0])  # stable: longer left halves stay first
    return [(left, right) for _, left, right in pairs]


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> _HFTokenizer:
    """SentencePiece BPE with byte fallback (Gemma): spaces become U+2581 and the whole text is one
    word (no pre-tokenizer split), unknown characters fall back to their <0xNN> byte tokens."""
    if meta.get("tokenizer.ggml.add_space_prefix"):
        # Llama 2-style SentencePiece prepends a space; nothing here has been checked against such a file.
        raise UnsupportedModelError("GGUF SentencePiece tokenizers with add_space_prefix are not supported")
    # Runs of spaces are stored as real spaces; the text they match has its spaces respelled first.
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    rank = {t: i for i, t in enumerate(spelled)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=rank, merges=_sentencepiece_merges(spelled, rank), fuse_unk=True, byte_fallback=True,
                     unk_token=tokens[int(unk)] if unk is not None else None)
    backend = _HFTokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    # User-defined tokens (Gemma's runs of newlines, "[multimodal]") match whole, as llama.cpp matches them.
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in rank])
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _variables_read(source: str, own_variables: Iterable[str]) -> frozenset[str]:
    """What a template reads from whoever renders it, beyond what the renderer always sets."""
    env = _template_env()
    used = jinja2.meta.find_undeclared_variables(env.parse(source))
    return frozenset(used - {"messages", "add_generation_prompt", "tools", "documents", *own_variables, *env.globals})


@lru_cache(maxsize=8)
def _compiled_with_reads(source: str, own_variables: tuple[str, ...]) -> tuple[jinja2.Template, frozenset[str]]:
    """A per-call chat template (LLM.chat's chat_template), compiled once per source."""
    return compile_chat_template(source), _variables_read(source, own_variables)


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates read it: OpenAI's text parts joined, no content as ""."""
    content = message.get("content")
    if isinstance(content, list):
        kinds = [part.get("type") if isinstance(part, Mapping) else None for part in content]
        if any(kind != "text" for kind in kinds):
            raise InvalidRequestError(f"only text content is supported (got content parts of types {kinds})",
                                      param="messages")
        content = "".join(str(part.get("text", "")) for part in content)
    return {**message, "content": "" if content is None else content}


def _compile_template(source: str) -> jinja2.Template:
    return _template_env().from_string(source)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template given to replace the model's, compiled (ChatTemplateError if it does not)."""
    try:
        return _compile_template(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def _template_env() -> ImmutableSandboxedEnvironment:
    """A sandboxed environment configured like transformers' chat-template renderer."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's built-in tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env
