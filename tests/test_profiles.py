"""EDGEQ_PROFILE: presets fill the knobs nobody set; anything set explicitly wins.

The expected values are stated here (the docs' table, docs/configuration.md "## Profiles",
states the same and is checked against them), never read from ``PROFILES``: a changed preset
fails until the test and the docs say so too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from edgeq.core.errors import ConfigError
from edgeq.core.settings import load_settings
from edgeq.worker.settings import PROFILES, WorkerSettings

# The profile table moved from README to the docs site (#32).
CONFIGURATION = Path(__file__).parent.parent / "docs" / "configuration.md"

#: What each profile sets; every other knob keeps its default.
EXPECTED: dict[str, dict[str, Any]] = {
    "latency": {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 2048,
        "enable_chunked_prefill": True,
        "stream_interval_ms": 10,
    },
    "throughput": {
        "max_num_seqs": 128,
        "max_num_batched_tokens": 8192,
        "enable_chunked_prefill": True,
        "max_model_len": 8192,
        "stream_interval_ms": 50,
        "stream_tokens": 4,
    },
    "edge-small": {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 1024,
        "enable_chunked_prefill": True,
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.7,
        "cpu_kv_cache_gib": 2,
        "max_tokens": 128,
        "stream_interval_ms": 50,
        "stream_tokens": 4,
    },
}
#: The defaults the tests below lean on (README's "Settings").
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_STREAM_INTERVAL_MS = 20


pytestmark = pytest.mark.usefixtures("clean_edgeq_env")


def test_no_profile_keeps_the_defaults() -> None:
    settings = load_settings(WorkerSettings)
    assert settings.profile is None
    assert settings.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert settings.stream_interval_ms == DEFAULT_STREAM_INTERVAL_MS


def test_the_profiles_are_the_three_documented() -> None:
    assert sorted(PROFILES) == sorted(EXPECTED)


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_each_profile_applies_its_presets(monkeypatch: pytest.MonkeyPatch, profile: str) -> None:
    defaults = load_settings(WorkerSettings)
    monkeypatch.setenv("EDGEQ_PROFILE", profile)
    settings = load_settings(WorkerSettings)
    assert settings.profile == profile
    for name, value in EXPECTED[profile].items():
        assert getattr(settings, name) == value, name
    changed = {
        name
        for name in WorkerSettings.model_fields
        if name != "profile" and getattr(settings, name) != getattr(defaults, name)
    }
    assert changed <= set(EXPECTED[profile])  # every other knob keeps its default


def test_presets_name_only_real_fields_with_valid_values() -> None:
    for profile, presets in PROFILES.items():
        assert set(presets) <= set(WorkerSettings.model_fields) - {"profile"}, profile
        load_settings(WorkerSettings, **presets)  # each preset is valid on its own


def test_an_explicit_env_var_beats_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", "throughput")
    monkeypatch.setenv("EDGEQ_MAX_NUM_SEQS", "96")
    monkeypatch.setenv("EDGEQ_STREAM_INTERVAL_MS", str(DEFAULT_STREAM_INTERVAL_MS))  # explicit
    settings = load_settings(WorkerSettings)
    assert settings.max_num_seqs == 96
    assert settings.stream_interval_ms == DEFAULT_STREAM_INTERVAL_MS
    assert settings.max_num_batched_tokens == 8192  # the profile's


def test_a_dot_env_value_beats_the_profile(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        "EDGEQ_PROFILE=edge-small\nEDGEQ_MAX_TOKENS=300\nEDGEQ_ENABLE_CHUNKED_PREFILL=false\n"
    )
    settings = load_settings(WorkerSettings)
    assert settings.profile == "edge-small"
    assert settings.max_tokens == 300
    assert settings.enable_chunked_prefill is False
    assert settings.max_model_len == 4096  # the profile's


def test_an_env_file_value_beats_a_profile_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env_file = tmp_path / "box.env"
    env_file.write_text("EDGEQ_MAX_NUM_SEQS=48\n")
    monkeypatch.setenv("EDGEQ_PROFILE", "latency")
    settings = load_settings(WorkerSettings, env_file=env_file)
    assert settings.max_num_seqs == 48
    assert settings.stream_interval_ms == 10  # the profile's


def test_an_argument_beats_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", "latency")
    assert load_settings(WorkerSettings, max_num_seqs=8).max_num_seqs == 8


def test_an_unknown_profile_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", "fastest")
    with pytest.raises(ConfigError) as failure:
        load_settings(WorkerSettings)
    message = str(failure.value)
    assert "EDGEQ_PROFILE: " in message and "'fastest'" in message
    for profile in EXPECTED:
        assert f"'{profile}'" in message


def test_a_profile_still_checks_the_budget_against_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", "edge-small")  # budget 1024
    monkeypatch.setenv("EDGEQ_MAX_NUM_SEQS", "2048")
    with pytest.raises(ConfigError, match="EDGEQ_MAX_NUM_BATCHED_TOKENS must be at least"):
        load_settings(WorkerSettings)


def cell_value(cell: str) -> bool | float:
    return {"true": True, "false": False}[cell] if cell in ("true", "false") else float(cell)


def readme_profiles() -> dict[str, dict[str, Any]]:
    """The docs' profile table: a column per profile, a row per knob, "–" for the default."""
    section = CONFIGURATION.read_text().split("\n## Profiles\n", 1)[1].split("\n#", 1)[0]
    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]
    (_, *profiles), *knobs = rows
    table: dict[str, dict[str, Any]] = {profile: {} for profile in profiles}
    for env_var, *values in knobs:
        assert re.fullmatch(r"EDGEQ_[A-Z_]+", env_var), env_var
        for profile, value in zip(profiles, values, strict=True):
            if value != "–":
                table[profile][env_var.removeprefix("EDGEQ_").lower()] = cell_value(value)
    return table


def test_the_docs_state_every_profile_as_the_tests_expect() -> None:
    assert readme_profiles() == EXPECTED
