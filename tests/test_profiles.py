"""EDGEQ_PROFILE: presets fill the knobs nobody set; anything set explicitly wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeq.core.errors import ConfigError
from edgeq.core.settings import load_settings
from edgeq.worker.settings import PROFILES, WorkerSettings

README = Path(__file__).parent.parent / "README.md"


pytestmark = pytest.mark.usefixtures("clean_edgeq_env")


def test_no_profile_keeps_the_defaults() -> None:
    settings = load_settings(WorkerSettings)
    assert settings.profile is None
    assert settings.max_num_seqs == WorkerSettings.model_fields["max_num_seqs"].default


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_applies_its_presets(monkeypatch: pytest.MonkeyPatch, profile: str) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", profile)
    settings = load_settings(WorkerSettings)
    assert settings.profile == profile
    for name, value in PROFILES[profile].items():
        assert getattr(settings, name) == value, name


def test_presets_name_only_real_fields_with_valid_values() -> None:
    for profile, presets in PROFILES.items():
        assert set(presets) <= set(WorkerSettings.model_fields) - {"profile"}, profile
        load_settings(WorkerSettings, **presets)  # each preset is valid on its own


def test_an_explicit_env_var_beats_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", "throughput")
    monkeypatch.setenv("EDGEQ_MAX_NUM_SEQS", "96")
    monkeypatch.setenv("EDGEQ_STREAM_INTERVAL_MS", "20")  # the default's value, but explicit
    settings = load_settings(WorkerSettings)
    assert settings.max_num_seqs == 96
    assert settings.stream_interval_ms == 20
    assert settings.max_num_batched_tokens == PROFILES["throughput"]["max_num_batched_tokens"]


def test_a_dot_env_value_beats_the_profile(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        "EDGEQ_PROFILE=edge-small\nEDGEQ_MAX_TOKENS=300\nEDGEQ_ENABLE_CHUNKED_PREFILL=false\n"
    )
    settings = load_settings(WorkerSettings)
    assert settings.profile == "edge-small"
    assert settings.max_tokens == 300
    assert settings.enable_chunked_prefill is False
    assert settings.max_model_len == PROFILES["edge-small"]["max_model_len"]


def test_an_env_file_value_beats_a_profile_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env_file = tmp_path / "box.env"
    env_file.write_text("EDGEQ_MAX_NUM_SEQS=48\n")
    monkeypatch.setenv("EDGEQ_PROFILE", "latency")
    settings = load_settings(WorkerSettings, env_file=env_file)
    assert settings.max_num_seqs == 48
    assert settings.stream_interval_ms == PROFILES["latency"]["stream_interval_ms"]


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
    for profile in PROFILES:
        assert f"'{profile}'" in message


def test_a_profile_still_checks_the_budget_against_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEQ_PROFILE", "edge-small")  # budget 1024
    monkeypatch.setenv("EDGEQ_MAX_NUM_SEQS", "2048")
    with pytest.raises(ConfigError, match="EDGEQ_MAX_NUM_BATCHED_TOKENS must be at least"):
        load_settings(WorkerSettings)


def test_readme_lists_every_profile() -> None:
    readme = README.read_text()
    assert "### Profiles" in readme
    for profile in PROFILES:
        assert f"`{profile}`" in readme
