import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker.tiny_model import TinyModelInfo, make_tiny_model

MAX_TOTAL_BYTES = 5 * 1024 * 1024
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


def test_tokenizer_round_trips_text(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "The worker reads a job, then answers: 42 jobs! Ünïcode ✓ 日本"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


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
