"""The seeded workload: chats whose rendered prompts have exact, uniformly drawn token lengths.

A prompt's length is what the engine sees: the user message rendered with the model's own chat
template (thinking off, as the worker renders it) and encoded with the model's tokenizer. The
message is built from whole vocabulary words (" the", " model", …): the tokenizer cuts before
every space, so k such words are k tokens and every drawn length is hit exactly. Random words
also keep prefix caching from sharing anything but the template's own header between prompts.

Same seed, same tokenizer → the same prompts, lengths and sampling seeds, in every mode.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edgeq.core.protocol import ChatMessage

#: A word is one letter-only vocabulary entry that starts with a space; in byte-level BPE
#: vocabularies (Qwen, GPT) the space is spelled "Ġ", in SentencePiece ones "▁".
WORD_TOKEN = re.compile(r"[Ġ▁][a-z]+")
#: Enough different words that prompts do not repeat; low ids first, the commonest words.
WORD_POOL_SIZE = 1000
#: A word's neighbours almost never merge with it; a few corrections cover the rare case.
MAX_LENGTH_CORRECTIONS = 64
#: Per-request sampling seeds stay in a range every server accepts as a plain int.
SAMPLING_SEED_LIMIT = 2**31


class WorkloadError(ValueError):
    """The workload cannot be built as asked (e.g. a length shorter than the template)."""


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workload uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def get_vocab(self) -> Mapping[str, int]: ...

    def convert_tokens_to_string(self, tokens: list[str]) -> str: ...


def load_tokenizer(model: str) -> ChatTokenizer:
    """The model's own tokenizer and chat template (a local directory or a Hugging Face id)."""
    from transformers import AutoTokenizer  # heavy: only when a workload is built

    tokenizer: ChatTokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    input_len_min: int
    input_len_max: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError("the workload needs at least one request")
        if not 1 <= self.input_len_min <= self.input_len_max:
            raise WorkloadError(
                f"input lengths must satisfy 1 <= min <= max "
                f"(got {self.input_len_min}..{self.input_len_max})"
            )
        if self.max_tokens < 1:
            raise WorkloadError("max_tokens must be at least 1")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    messages: tuple[ChatMessage, ...]
    #: The rendered prompt's length in tokens, as the engine will count it.
    prompt_tokens: int
    #: This request's sampling seed: the same answer in every mode that honours seeds.
    seed: int


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    model: str
    #: Tokens the chat template adds around one user message (its fixed cost).
    template_tokens: int
    requests: tuple[BenchRequest, ...]

    def sampling_fields(self, request: BenchRequest) -> dict[str, Any]:
        """The request's fields in edgeq's ChatRequest terms (the same for every mode)."""
        return {
            "max_tokens": self.spec.max_tokens,
            "temperature": self.spec.temperature,
            "top_p": self.spec.top_p,
            "seed": request.seed,
            "enable_thinking": False,
        }


class PromptMeter:
    """Counts a chat's prompt tokens exactly as the worker renders it (worker/engine.py)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer

    def count(self, messages: Sequence[ChatMessage]) -> int:
        text = self._tokenizer.apply_chat_template(
            [message.model_dump() for message in messages],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        return len(self._tokenizer.encode(text, add_special_tokens=False))


def vocabulary_words(tokenizer: ChatTokenizer, limit: int = WORD_POOL_SIZE) -> list[str]:
    """Words (with their leading space) that encode to exactly one token, commonest first."""
    candidates = sorted(
        (token_id, token)
        for token, token_id in tokenizer.get_vocab().items()
        if WORD_TOKEN.fullmatch(token)
    )
    words: list[str] = []
    for token_id, token in candidates:
        word = tokenizer.convert_tokens_to_string([token])
        if tokenizer.encode(word, add_special_tokens=False) == [token_id]:
            words.append(word)
            if len(words) == limit:
                break
    if not words:
        raise WorkloadError("the tokenizer has no single-token words to build prompts from")
    return words


def _user(content: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage(role="user", content=content),)


def _fit(
    words: list[str], target: int, meter: PromptMeter, pool: Sequence[str], rng: random.Random
) -> tuple[ChatMessage, ...]:
    """Add or drop words until the rendered prompt is exactly ``target`` tokens."""
    for _ in range(MAX_LENGTH_CORRECTIONS):
        messages = _user("".join(words))
        length = meter.count(messages)
        if length == target:
            return messages
        if length < target:
            words.append(rng.choice(pool))
        elif len(words) > 1:
            words.pop()
        else:
            break
    raise WorkloadError(f"could not build a prompt of exactly {target} tokens with this tokenizer")


def build_workload(spec: WorkloadSpec, tokenizer: ChatTokenizer, model: str) -> Workload:
    """Draw every request's prompt length uniformly in [min, max] and build its message."""
    rng = random.Random(spec.seed)
    meter = PromptMeter(tokenizer)
    pool = vocabulary_words(tokenizer)
    template_tokens = meter.count(_user(""))
    if spec.input_len_min <= template_tokens:
        raise WorkloadError(
            f"input length {spec.input_len_min} leaves no room for a message: this model's "
            f"chat template alone is {template_tokens} tokens (use at least {template_tokens + 1})"
        )
    requests = []
    for index in range(spec.num_requests):
        target = rng.randint(spec.input_len_min, spec.input_len_max)
        words = [rng.choice(pool) for _ in range(target - template_tokens)]
        messages = _fit(words, target, meter, pool, rng)
        seed = rng.randrange(SAMPLING_SEED_LIMIT)
        requests.append(BenchRequest(index, messages, target, seed))
    return Workload(spec, model, template_tokens, tuple(requests))
