from __future__ import annotations

from edgeq.worker.reasoning import ReasoningSplitter


def feed_all(splitter: ReasoningSplitter, deltas: list[str]) -> str:
    return "".join(splitter.feed(delta) for delta in deltas)


def test_thinking_off_passes_text_through_untouched() -> None:
    splitter = ReasoningSplitter(thinking=False)
    assert feed_all(splitter, ["\nHello", " </think> world"]) == "\nHello </think> world"
    assert splitter.reasoning == ""


def test_reasoning_and_answer_are_split_at_the_closing_tag() -> None:
    splitter = ReasoningSplitter(thinking=True)
    answer = feed_all(splitter, ["<think>", "\nLet me", " see.\n", "</think>", "\n\n", "Blue", "."])
    assert answer == "Blue."
    assert splitter.reasoning == "Let me see."


def test_tag_and_text_in_one_merged_delta() -> None:
    splitter = ReasoningSplitter(thinking=True)
    assert feed_all(splitter, ["<think>a b</think>\n\nc", " d"]) == "c d"
    assert splitter.reasoning == "a b"


def test_a_generation_that_never_closes_its_think_block_is_all_reasoning() -> None:
    splitter = ReasoningSplitter(thinking=True)
    assert feed_all(splitter, ["<think>", "still going"]) == ""
    assert splitter.reasoning == "still going"


def test_newlines_inside_the_answer_are_kept() -> None:
    splitter = ReasoningSplitter(thinking=True)
    assert feed_all(splitter, ["r</think>", "\n", "\n", "a\n\nb"]) == "a\n\nb"
