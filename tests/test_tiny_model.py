import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.numpy import load_file
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from edgeq.testing.tiny_model import ALPHABET, SPACE_MARK, TinyModelInfo, make_tiny_model

MAX_TOTAL_BYTES = 5 * 1024 * 1024
# "A few hundred": small enough that the embedding stays tiny.
MAX_VOCAB_SIZE = 512
REPLACEMENT_CHARACTER = "\ufffd"
# What the base (non-added) vocabulary decodes to: printable ASCII, space, tab, newline.
DECODED_CHARACTERS = re.compile(r"[\x20-\x7e\t\n]+")
# A maximal run of characters the tokenizer has no symbol for: it becomes one <unk>.
OUTSIDE_ALPHABET = re.compile("[^" + re.escape("".join(ALPHABET).replace(SPACE_MARK, "")) + " ]+")
RANDOM_SEQUENCES = 300
RANDOM_SEQUENCE_MAX_LEN = 64
PLAIN_ASCII_TEXTS = [
    "The worker reads a job, then answers: 42 jobs!",
    "  two  leading spaces, and two trailing  ",
    "Tabs\tand\nnew lines\n\nsurvive, as do 'quotes' & {braces} ~ `ticks` @ #5 100%.",
    "x",
    " ",
    "\n",
]
THINKING_OFF_SUFFIX = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
GENERATION_PROMPT = "<|im_start|>assistant\n"

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "<think>\nprivate reasoning\n</think>\n\nFour."},
    {"role": "user", "content": "And three plus three?"},
]


def file_hashes(info: TinyModelInfo) -> dict[str, str]:
    return {
        name: hashlib.sha256((info.directory / name).read_bytes()).hexdigest()
        for name in info.files
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> TinyModelInfo:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(built: TinyModelInfo) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(built.directory))


def render(tokenizer: PreTrainedTokenizerBase, **kwargs: object) -> str:
    return tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, **kwargs
    )


def test_same_seed_builds_byte_identical_files(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", seed=7)
    second = make_tiny_model(tmp_path / "b", seed=7)

    assert first.files == second.files
    assert file_hashes(first) == file_hashes(second)


def test_other_seed_changes_weights_but_not_tokenizer(tmp_path: Path) -> None:
    seed0 = make_tiny_model(tmp_path / "a", seed=0)
    seed1 = make_tiny_model(tmp_path / "b", seed=1)

    weights0 = load_file(str(seed0.directory / "model.safetensors"))
    weights1 = load_file(str(seed1.directory / "model.safetensors"))
    assert weights0.keys() == weights1.keys()
    assert not np.array_equal(
        weights0["model.embed_tokens.weight"], weights1["model.embed_tokens.weight"]
    )
    assert file_hashes(seed0)["tokenizer.json"] == file_hashes(seed1)["tokenizer.json"]


def test_info_describes_what_was_written(built: TinyModelInfo) -> None:
    on_disk = sorted(path.name for path in built.directory.iterdir())
    assert built.files == on_disk
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(on_disk)
    assert built.total_bytes == sum((built.directory / f).stat().st_size for f in on_disk)
    assert built.total_bytes < MAX_TOTAL_BYTES


def test_weights_cover_qwen3_parameters_with_tied_embeddings(built: TinyModelInfo) -> None:
    config = json.loads((built.directory / "config.json").read_text())
    weights = load_file(str(built.directory / "model.safetensors"))

    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert weights["model.embed_tokens.weight"].shape == (
        config["vocab_size"],
        config["hidden_size"],
    )
    assert "lm_head.weight" not in weights
    last = config["num_hidden_layers"] - 1
    assert weights[f"model.layers.{last}.self_attn.q_norm.weight"].shape == (config["head_dim"],)
    assert weights[f"model.layers.{last}.self_attn.k_proj.weight"].shape == (
        config["num_key_value_heads"] * config["head_dim"],
        config["hidden_size"],
    )
    assert all(w.dtype == np.float32 for w in weights.values())


def test_tokenizer_size_matches_model_vocab(
    built: TinyModelInfo, tokenizer: PreTrainedTokenizerBase
) -> None:
    config = json.loads((built.directory / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == built.vocab_size


def base_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that is not a special token (the think tags included: they are not special)."""
    special = set(tokenizer.all_special_ids)
    return [token_id for token_id in range(len(tokenizer)) if token_id not in special]


def test_vocabulary_is_a_few_hundred_whole_character_tokens(
    built: TinyModelInfo, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert len(ALPHABET) < built.vocab_size <= MAX_VOCAB_SIZE
    added = set(tokenizer.get_added_vocab())
    for token, token_id in tokenizer.get_vocab().items():
        if token not in added:
            assert set(token) <= set(ALPHABET), (token_id, token)
    assert set(ALPHABET) <= set(tokenizer.get_vocab())  # any ASCII text can be spelled


def test_every_single_token_decodes_to_whole_characters(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    added = set(tokenizer.get_added_vocab().values())
    for token_id in base_ids(tokenizer):
        text = tokenizer.decode([token_id])
        assert REPLACEMENT_CHARACTER not in text, token_id
        if token_id not in added:
            assert DECODED_CHARACTERS.fullmatch(text), (token_id, text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_id_sequences_decode_without_replacement_characters(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    # What a random-weight model samples: any id at all, special ones included.
    rng = random.Random(0)
    every_id = list(range(len(tokenizer)))
    for _ in range(RANDOM_SEQUENCES):
        ids = rng.choices(every_id, k=rng.randint(1, RANDOM_SEQUENCE_MAX_LEN))
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert REPLACEMENT_CHARACTER not in text, ids
        if skip_special_tokens:
            assert tokenizer.unk_token not in text, ids


def test_streaming_decode_matches_full_decode_without_replacement_characters(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # vLLM's incremental detokenizer is tokenizers' DecodeStream primed with the
    # prompt ids; each step must emit whole characters and lose no space.
    backend = tokenizer.backend_tokenizer
    prompt = tokenizer.encode("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    rng = random.Random(1)
    every_id = list(range(len(tokenizer)))
    for _ in range(RANDOM_SEQUENCES // 3):
        ids = rng.choices(every_id, k=rng.randint(1, RANDOM_SEQUENCE_MAX_LEN))
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        pieces = [stream.step(backend, token_id) or "" for token_id in ids]
        assert all(REPLACEMENT_CHARACTER not in piece for piece in pieces), ids
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("text", PLAIN_ASCII_TEXTS)
def test_plain_ascii_round_trips_exactly(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_words_keep_their_leading_space_in_one_token(tokenizer: PreTrainedTokenizerBase) -> None:
    # The bench builds exact-length prompts from such words (bench/workload.py).
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" the model")) == ["▁the", "▁model"]


def test_text_outside_the_alphabet_becomes_unk_and_is_dropped_when_skipping_special(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # The documented normalisation: each run of characters outside ALPHABET (here
    # non-ASCII letters, a symbol, CJK, a carriage return) is one <unk>; the rest
    # of the text, spaces included, is kept as it was.
    text = "The worker reads: 42 jobs! Ünïcode ✓ 日本\r\nnext line"
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.unk_token_id) == len(OUTSIDE_ALPHABET.findall(text)) == 4
    assert tokenizer.decode(ids) == OUTSIDE_ALPHABET.sub(tokenizer.unk_token, text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == OUTSIDE_ALPHABET.sub("", text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "The worker reads: 42 jobs! ncode  \nnext line"
    )


def test_unk_is_a_special_token(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.unk_token == "<unk>"
    assert tokenizer.unk_token_id in tokenizer.all_special_ids
    assert tokenizer.decode([tokenizer.unk_token_id], skip_special_tokens=True) == ""


def test_eos_and_generation_config_use_im_end(
    built: TinyModelInfo, tokenizer: PreTrainedTokenizerBase
) -> None:
    generation = json.loads((built.directory / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert generation["eos_token_id"] == im_end


@pytest.mark.parametrize("tag", ["<think>", "</think>"])
def test_think_tags_are_single_tokens(tokenizer: PreTrainedTokenizerBase, tag: str) -> None:
    assert len(tokenizer.encode(tag)) == 1


def test_think_tags_survive_skip_special_tokens_but_im_end_does_not(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = tokenizer.encode("<think>\nhmm\n</think>\n\nDone.<|im_end|>")
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == "<think>\nhmm\n</think>\n\nDone."


def test_chat_template_with_thinking_off_prefills_empty_think_block(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    assert render(tokenizer, enable_thinking=False).endswith(THINKING_OFF_SUFFIX)


@pytest.mark.parametrize("kwargs", [{"enable_thinking": True}, {}])
def test_chat_template_with_thinking_on_or_unset_ends_at_assistant_header(
    tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, object]
) -> None:
    prompt = render(tokenizer, **kwargs)
    assert prompt.endswith("<|im_end|>\n" + GENERATION_PROMPT)


def test_chat_template_strips_prior_assistant_reasoning(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    prompt = render(tokenizer, enable_thinking=True)
    assert "private reasoning" not in prompt
    assert "<think>" not in prompt
    assert "<|im_start|>assistant\nFour.<|im_end|>\n" in prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


# Run in a child of its own (vLLM on CPU always spawns an EngineCore process, and
# spawned children re-import the main module, hence the guard). It prints, per
# prompt, the streamed text and the sampled ids.
ENGINE_SCRIPT = """
import json
import sys

from vllm import LLM, SamplingParams


def main(model: str) -> None:
    llm = LLM(
        model=model, enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=True
    )
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for content in ("Hi!", "What is the queue for?", "Tell me a long story.")
        ]
        params = [
            SamplingParams(temperature=1.0, max_tokens=64, seed=seed)
            for seed in range(len(prompts))
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results = [
            {"text": output.outputs[0].text, "ids": list(output.outputs[0].token_ids)}
            for output in outputs
        ]
        print("RESULTS " + json.dumps(results))
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
"""
ENGINE_TIMEOUT_S = 300
# The EngineCore notices its parent is gone and exits, but not instantly.
ENGINE_EXIT_GRACE_S = 10


def processes_in_group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                found.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


@pytest.mark.engine
def test_real_engine_samples_text_without_replacement_characters(
    built: TinyModelInfo, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, short_tmp: Path
) -> None:
    """Starting a vLLM engine costs ~30 s on two cores (~55 s on a busy machine)."""
    script = tmp_path / "sample.py"
    script.write_text(ENGINE_SCRIPT)
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_RPC_BASE_PATH": str(short_tmp),  # vLLM never removes its sockets
    }
    child = subprocess.Popen(
        [sys.executable, str(script), str(built.directory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the engine's processes are ours to reap
    )
    try:
        output, _ = child.communicate(timeout=ENGINE_TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        deadline = time.monotonic() + ENGINE_EXIT_GRACE_S
        while (survivors := processes_in_group(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for survivor in survivors:
            survivor.send_signal(signal.SIGKILL)
    assert child.returncode == 0, output[-5000:]
    assert not survivors, [process.cmdline() for process in survivors]

    (line,) = [line for line in output.splitlines() if line.startswith("RESULTS ")]
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 3
    for result in results:
        assert result["ids"], result
        assert REPLACEMENT_CHARACTER not in result["text"], result
        assert tokenizer.unk_token not in result["text"], result
        # The streamed text is what a full decode gives: no space or character lost.
        assert result["text"] == tokenizer.decode(result["ids"], skip_special_tokens=True)
