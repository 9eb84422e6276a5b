"""Build a tiny random LoRA adapter for the tiny model (edgeq.testing.tiny_model), the way PEFT
saves one: ``adapter_config.json`` and ``adapter_model.safetensors`` with each targeted
projection's low-rank ``lora_A`` (rank x in) and ``lora_B`` (out x rank) matrices.

Its weights are random, so its answers are noise too, but different noise from the base's:
the base's logits are near uniform (tiny_model.py), and the adapter's update, scaled well
above the base's weights, moves them enough that a sampled answer differs within a few
tokens. ``zero_b=True`` writes B matrices of zeros, an adapter whose update is exactly zero:
it must answer exactly as the base model does.

Only numpy and safetensors are imported, as for the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from edgeq.testing.tiny_model import (
    HEAD_DIM,
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    NUM_ATTENTION_HEADS,
    NUM_HIDDEN_LAYERS,
    NUM_KEY_VALUE_HEADS,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_RANK = 8
LORA_ALPHA = 16
# Well above the base's 0.02: the update must show in a near-uniform sampler's choices.
WEIGHT_STD = 0.5

#: Each projection a tiny adapter may target: (its module's path in a layer, in, out).
PROJECTIONS = {
    "q_proj": ("self_attn", HIDDEN_SIZE, NUM_ATTENTION_HEADS * HEAD_DIM),
    "k_proj": ("self_attn", HIDDEN_SIZE, NUM_KEY_VALUE_HEADS * HEAD_DIM),
    "v_proj": ("self_attn", HIDDEN_SIZE, NUM_KEY_VALUE_HEADS * HEAD_DIM),
    "o_proj": ("self_attn", NUM_ATTENTION_HEADS * HEAD_DIM, HIDDEN_SIZE),
    "gate_proj": ("mlp", HIDDEN_SIZE, INTERMEDIATE_SIZE),
    "up_proj": ("mlp", HIDDEN_SIZE, INTERMEDIATE_SIZE),
    "down_proj": ("mlp", INTERMEDIATE_SIZE, HIDDEN_SIZE),
}
DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def make_tiny_adapter(
    directory: Path,
    *,
    base_model: str | Path,
    seed: int = 0,
    rank: int = DEFAULT_RANK,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    zero_b: bool = False,
    hidden_size: int = HIDDEN_SIZE,
) -> Path:
    """Write a LoRA adapter for the tiny model into ``directory`` (created if missing); the same
    arguments always give byte-identical files. ``hidden_size`` other than the tiny model's
    makes an adapter whose shapes do not fit it (a "wrong base" adapter, for tests)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    scale = hidden_size / HIDDEN_SIZE
    tensors: dict[str, np.ndarray] = {}
    for layer in range(NUM_HIDDEN_LAYERS):
        for name in targets:
            block, size_in, size_out = PROJECTIONS[name]
            size_in, size_out = int(size_in * scale), int(size_out * scale)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, WEIGHT_STD, (rank, size_in))
            b_shape = (size_out, rank)
            b = np.zeros(b_shape) if zero_b else rng.normal(0, WEIGHT_STD, b_shape)
            tensors[f"{prefix}.lora_B.weight"] = b
    weights = {key: value.astype(np.float32) for key, value in tensors.items()}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "base_model_name_or_path": str(base_model),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(targets),
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
