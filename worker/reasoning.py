"""Splitting a thinking model's output into reasoning and answer, as the tokens stream.

Qwen3 in thinking mode writes ``<think>reasoning</think>\\n\\nanswer``. Each tag is one added
token, so it always arrives whole inside one delta. A generation that stops before
``</think>`` was still thinking: all of it is reasoning, the answer is empty.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningSplitter:
    """Feed it deltas; it returns the answer part of each and keeps the reasoning aside."""

    def __init__(self, *, thinking: bool) -> None:
        self._in_reasoning = thinking
        self._answer_started = not thinking  # only text after a think block is trimmed
        self._reasoning: list[str] = []

    def feed(self, text: str) -> str:
        """The part of ``text`` that belongs to the answer (possibly empty)."""
        if self._in_reasoning:
            end = text.find(THINK_CLOSE)
            if end < 0:
                self._reasoning.append(text)
                return ""
            self._reasoning.append(text[:end])
            self._in_reasoning = False
            text = text[end + len(THINK_CLOSE) :]
        if not self._answer_started:
            # The blank lines the template puts between the think block and the answer.
            text = text.lstrip("\n")
            self._answer_started = bool(text)
        return text

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning).strip().removeprefix(THINK_OPEN).strip()
