"""Build a tiny random-weight Qwen3 model directory that vLLM can load offline.

The model is meant for tests and local runs of the worker: it exercises the real
vLLM loading path (config, safetensors, tokenizer, chat template) without any
download from a model hub. Its output is noise, but readable noise: the
tokenizer is a character-level BPE whose every token is a whole string of
printable ASCII, so sampled text reads as made-up words and never holds a
U+FFFD replacement character. A byte-level vocabulary would not do here: random
weights sample a near-uniform mix of ids, and lone partial UTF-8 bytes decode to
U+FFFD. The vocabulary still contains Qwen3's `<think>`/`</think>` tags, so
reasoning-parsing code paths can be hit too.

Only numpy, safetensors and tokenizers are imported: building takes well under a
second and does not pull torch into the importing process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)

# --- Architecture -----------------------------------------------------------

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_HIDDEN_LAYERS = 2
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2  # < attention heads, so the GQA path is exercised
# vLLM's CPU attention only accepts a fixed set of head sizes; 64 is one of them.
HEAD_DIM = 64
MAX_POSITION_EMBEDDINGS = 2048
RMS_NORM_EPS = 1e-6
ROPE_THETA = 1_000_000.0  # Qwen3's value
# Checkpoint dtype; vLLM downcasts to its CPU default (bfloat16) at load time.
CHECKPOINT_DTYPE = np.float32
CHECKPOINT_DTYPE_NAME = np.dtype(CHECKPOINT_DTYPE).name
# Same init std as Qwen3's `initializer_range`; it also keeps logits tiny
# (about sqrt(HIDDEN_SIZE) * 0.02), so sampling at temperature 1 is near uniform.
WEIGHT_INIT_STD = 0.02

# --- Tokenizer --------------------------------------------------------------

# 97 characters + <unk> + about 220 merges: a real BPE, still a tiny embedding.
BPE_VOCAB_SIZE = 320
# A pair seen once in the corpus is noise, not a pattern worth a merge.
BPE_MIN_PAIR_FREQUENCY = 2
# SentencePiece's word-boundary mark: spaces become part of the following word
# ("▁the"), as in Llama/Mistral vocabularies, so the bench can still find
# single-token words with a leading space (bench/workload.py's WORD_TOKEN).
SPACE_MARK = "▁"
NEWLINE = "\n"
# Every token is built from these, so every token decodes to whole characters.
# The space is spelled SPACE_MARK after pre-tokenization; tab and newline are
# the only other whitespace kept. "\r", "\v" and "\f" are left out on purpose:
# sampled at random they would wreck how a terminal shows the demo's output.
ALPHABET = (
    *(chr(code) for code in range(0x21, 0x7F)),  # printable ASCII without the space
    SPACE_MARK,
    NEWLINE,
    "\t",
)
# Whatever is not in ALPHABET (non-ASCII text, "\r", ...) encodes to this; it is a
# special token, so a sampled one is dropped by skip_special_tokens decoding
# (vLLM's default) instead of showing up as garbage.
UNK = "<unk>"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Order matters: ids are assigned after the BPE vocab in this order, as in Qwen3.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen3 marks the think tags non-special so they survive skip_special_tokens decoding.
NON_SPECIAL_ADDED_TOKENS = (THINK_OPEN, THINK_CLOSE)
MODEL_MAX_LENGTH = MAX_POSITION_EMBEDDINGS

# Qwen3-style template reduced to what the worker uses: plain messages, reasoning
# stripped from past assistant turns, `enable_thinking=False` pre-filling an empty think
# block, and Qwen3's tool format: the tools listed in the system turn, an assistant's calls
# as <tool_call> blocks, and tool results grouped into one user turn of <tool_response>s.
# Messages without tools render exactly as before the tools section existed.
TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{%- set first_system = messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if first_system %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    '{{- "' + TOOLS_PREAMBLE + '" }}'
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- "' + TOOLS_INSTRUCTIONS + '<|im_end|>\\n" }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if tools and loop.first and first_system %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set function = call['function'] %}"
    "{%- set arguments = function['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{{- arguments if arguments is string else (arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Plain English used only to learn BPE merges; changing it changes every token id.
TRAINING_CORPUS = """\
The small worker reads a job from the queue, asks the model for an answer, and
writes the reply back so that the caller can read it. When the queue is empty the
worker waits for a short time and then looks again. Each job has a name, a list
of messages, and a few settings that say how long the answer may be and how
much freedom the model has when it picks the next word.

A message has a role and some content. The user asks a question, the assistant
gives an answer, and the system sets the tone for the whole talk. Before the
model sees the messages, a template turns them into one long string of text with
clear marks between the turns. The model then reads that text one token at a
time and guesses what should come after it.

Some models like to think before they answer. They open a block, write down
their thoughts, close the block, and only then give the final answer. A caller
who does not want to wait for the thoughts can turn thinking off, and the
template then hands the model an empty block so that it starts with the answer
right away. When the answer comes back, the thoughts and the answer are kept
apart so that each can be shown in its own place.

It is good practice to test this path with a model that is small and fast. Such
a model knows nothing about the world, and its words are random, but it has the
same shape as the real one: the same kinds of layers, the same kind of
tokenizer, and the same chat template. If the worker can load it, send it a
prompt, and stream back the tokens, then the parts that move data around are
working, and the only thing left to change is the size of the model.

There are many ways for a job to fail. The model may be slow to start, the
queue may be down for a moment, or the caller may give up and cancel the job
while it is still running. A careful worker keeps track of what it has started,
cleans up what it no longer needs, and reports errors in a form that a person
can read. It also keeps a count of how many tokens it has made and how long each
step took, so that later on someone can find out where the time went.

Numbers matter too: 1 job, 2 jobs, 10 jobs, 100 jobs. The worker should treat
them all the same way, one after another, or several at once if the machine has
room for them. What it should never do is lose a job, answer the wrong caller,
or mix up the words of one answer with the words of another.
"""

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class TinyModelInfo:
    directory: Path
    vocab_size: int
    total_bytes: int
    files: list[str]


@dataclass(frozen=True)
class _TokenIds:
    endoftext: int
    im_start: int
    im_end: int


def make_tiny_model(directory: Path, *, seed: int = 0) -> TinyModelInfo:
    """Write a loadable random Qwen3 model into `directory` (created if missing).

    The same seed always yields byte-identical files; the seed only changes the
    weights, the tokenizer is fixed by the embedded corpus. Files of the same name
    are overwritten and nothing else is removed, so use a fresh directory: a stray
    `*.safetensors` left there would be loaded by vLLM as well.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    token_ids = _TokenIds(
        endoftext=_required_token_id(tokenizer, ENDOFTEXT),
        im_start=_required_token_id(tokenizer, IM_START),
        im_end=_required_token_id(tokenizer, IM_END),
    )

    tokenizer.save(str(directory / TOKENIZER_FILE))
    _write_json(directory / TOKENIZER_CONFIG_FILE, tokenizer_config())
    _write_json(directory / CONFIG_FILE, model_config(vocab_size, token_ids))
    _write_json(directory / GENERATION_CONFIG_FILE, generation_config(token_ids))
    save_file(
        random_weights(vocab_size, seed=seed),
        str(directory / WEIGHTS_FILE),
        metadata={"format": "np"},
    )

    files = sorted(
        [
            CONFIG_FILE,
            GENERATION_CONFIG_FILE,
            WEIGHTS_FILE,
            TOKENIZER_FILE,
            TOKENIZER_CONFIG_FILE,
        ]
    )
    total_bytes = sum((directory / name).stat().st_size for name in files)
    return TinyModelInfo(
        directory=directory,
        vocab_size=vocab_size,
        total_bytes=total_bytes,
        files=files,
    )


def build_tokenizer() -> Tokenizer:
    """Train the character-level BPE on the embedded corpus and add Qwen3's tokens."""
    # fuse_unk: a run of unknown characters (a word of CJK, say) costs one token.
    # No byte_fallback: byte tokens are exactly what sampled U+FFFD comes from. No
    # normalizer either: it could only rewrite non-ASCII text, which is <unk> anyway.
    tokenizer = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # A newline stands alone, so no merge spans one: the corpus is
            # hard-wrapped, and merges like "▁the\n" would only learn where its
            # lines happen to break.
            pre_tokenizers.Split(NEWLINE, behavior="isolated"),
            # split=True cuts before every space, so a word and its leading space
            # are one pre-token and merges never span two words.
            pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme="never", split=True),
        ]
    )
    # No space is invented before the first word (prepend_scheme="never"), so
    # encode/decode round-trips, and the decoder never strips a leading space, which
    # vLLM's streaming detokenizer (tokenizers' DecodeStream, decoding a window that
    # starts mid-text) would otherwise drop between tokens. The decoder is spelt as
    # Llama's is (replace the mark, byte fallback, fuse) rather than as Metaspace: it
    # decodes the same, and xgrammar recognises it, so a grammar that needs a space
    # (a regex, a tool call's JSON) knows which tokens produce one.
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    )

    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=BPE_MIN_PAIR_FREQUENCY,
        show_progress=False,
        # The whole alphabet up front, not just what the corpus happens to use;
        # the limit keeps a non-ASCII character, should one enter the corpus, out.
        initial_alphabet=list(ALPHABET),
        limit_alphabet=len(ALPHABET),
        # The BPE model needs <unk> in its own vocab; the trainer puts it at id 0
        # and adds it as a special token. Qwen3's tokens are added afterwards so
        # their ids follow the BPE vocab.
        special_tokens=[AddedToken(UNK, special=True, normalized=False)],
    )
    tokenizer.train_from_iterator(_corpus_paragraphs(), trainer=trainer)

    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in NON_SPECIAL_ADDED_TOKENS]
    )
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    # The fast tokenizer is fully described by tokenizer.json; this file only
    # names the class, the role tokens and the chat template.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": UNK,
        # Listed like Qwen3 does, so `all_special_ids` covers the chat markers.
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(vocab_size: int, token_ids: _TokenIds) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_HIDDEN_LAYERS,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": WEIGHT_INIT_STD,
        "use_cache": True,
        "bos_token_id": token_ids.endoftext,  # Qwen3 uses <|endoftext|> as bos too
        "eos_token_id": token_ids.im_end,
        "pad_token_id": token_ids.endoftext,
        "dtype": CHECKPOINT_DTYPE_NAME,
    }


def generation_config(token_ids: _TokenIds) -> dict[str, Any]:
    # Deliberately no sampling defaults (temperature/top_p/top_k): vLLM would
    # apply them to every request and hide what the caller asked for.
    return {
        "bos_token_id": token_ids.endoftext,
        "eos_token_id": token_ids.im_end,
        "pad_token_id": token_ids.endoftext,
    }


def random_weights(vocab_size: int, *, seed: int) -> dict[str, np.ndarray]:
    """Every tensor Qwen3ForCausalLM loads, drawn in a fixed order from one RNG."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in parameter_shapes(vocab_size):
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=CHECKPOINT_DTYPE)
        else:
            weights[name] = rng.normal(0.0, WEIGHT_INIT_STD, size=shape).astype(CHECKPOINT_DTYPE)
    return weights


def parameter_shapes(vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF checkpoint names and shapes ([out, in] for linears); lm_head is tied."""
    q_size = NUM_ATTENTION_HEADS * HEAD_DIM
    kv_size = NUM_KEY_VALUE_HEADS * HEAD_DIM
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (vocab_size, HIDDEN_SIZE)),
    ]
    for layer in range(NUM_HIDDEN_LAYERS):
        prefix = f"model.layers.{layer}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (HIDDEN_SIZE,)),
            (f"{prefix}.self_attn.q_proj.weight", (q_size, HIDDEN_SIZE)),
            (f"{prefix}.self_attn.k_proj.weight", (kv_size, HIDDEN_SIZE)),
            (f"{prefix}.self_attn.v_proj.weight", (kv_size, HIDDEN_SIZE)),
            (f"{prefix}.self_attn.o_proj.weight", (HIDDEN_SIZE, q_size)),
            (f"{prefix}.self_attn.q_norm.weight", (HEAD_DIM,)),
            (f"{prefix}.self_attn.k_norm.weight", (HEAD_DIM,)),
            (f"{prefix}.post_attention_layernorm.weight", (HIDDEN_SIZE,)),
            (f"{prefix}.mlp.gate_proj.weight", (INTERMEDIATE_SIZE, HIDDEN_SIZE)),
            (f"{prefix}.mlp.up_proj.weight", (INTERMEDIATE_SIZE, HIDDEN_SIZE)),
            (f"{prefix}.mlp.down_proj.weight", (HIDDEN_SIZE, INTERMEDIATE_SIZE)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN_SIZE,)))
    return shapes


def _corpus_paragraphs() -> list[str]:
    return [paragraph for paragraph in TRAINING_CORPUS.split("\n\n") if paragraph.strip()]


def _required_token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"tokenizer is missing {token!r}")
    return token_id


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    # Sorted keys and a trailing newline keep the bytes stable across builds.
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
