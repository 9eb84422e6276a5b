"""Settings: every variable has a sane default, and a bad one is named in the error."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from edgeq.core.errors import ConfigError
from edgeq.core.settings import ConnectionSettings, load_settings, redacted_url
from edgeq.gateway.settings import GatewaySettings
from edgeq.worker.settings import WorkerSettings
from helpers import EDGEQ

ENV_EXAMPLE = Path(__file__).parent.parent / ".env.example"
# The worker's settings and the gateway's both extend the shared connection settings.
ALL_FIELDS = WorkerSettings.model_fields | GatewaySettings.model_fields


pytestmark = pytest.mark.usefixtures("clean_edgeq_env")


def test_defaults_are_the_documented_ones() -> None:
    settings = load_settings(WorkerSettings)
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.queue == "edgeq:queue"
    assert settings.model == "Qwen/Qwen3-0.6B"
    assert (settings.temperature, settings.top_p, settings.max_tokens) == (0.5, 0.9, 256)
    assert settings.enable_thinking is False


def test_the_job_slots_follow_the_engine_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_MAX_NUM_SEQS", "96")
    assert load_settings(WorkerSettings).job_slots == 96
    monkeypatch.setenv("EDGEQ_MAX_JOBS", "100")
    assert load_settings(WorkerSettings).job_slots == 100


def test_dot_env_is_read(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("EDGEQ_QUEUE=from-dotenv\n")
    assert load_settings(ConnectionSettings).queue == "from-dotenv"


@pytest.mark.parametrize("command", ["worker", "gateway"])
def test_a_missing_env_file_stops_the_command(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "tuned.env"
    completed = subprocess.run(
        [*EDGEQ, command, "--env-file", str(missing)], capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 78, completed.stderr
    assert f"--env-file: {missing} is not a file" in completed.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("EDGEQ_MAX_NUM_SEQS", "-3"),
        ("EDGEQ_TOP_P", "0"),
        ("EDGEQ_BLOCK_SIZE", "20"),
        ("EDGEQ_DTYPE", "fp8x"),
        ("EDGEQ_STREAM_INTERVAL_MS", "soon"),
        ("EDGEQ_LOG_LEVEL", "loud"),
    ],
)
def test_a_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as failure:
        load_settings(WorkerSettings)
    assert f"{variable}: " in str(failure.value)
    assert repr(value) in str(failure.value)


def test_a_batch_budget_smaller_than_the_batch_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEQ_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("EDGEQ_MAX_NUM_BATCHED_TOKENS", "32")
    with pytest.raises(ConfigError, match="EDGEQ_MAX_NUM_BATCHED_TOKENS must be at least"):
        load_settings(WorkerSettings)


def test_a_bad_redis_url_never_shows_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_REDIS_URL", "http://user:s3cret@host:6379")
    with pytest.raises(ConfigError) as failure:
        load_settings(ConnectionSettings)
    assert "EDGEQ_REDIS_URL" in str(failure.value)
    assert "s3cret" not in str(failure.value)


def test_redacted_url() -> None:
    assert redacted_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redacted_url("rediss://alice:pw@h/2") == "rediss://alice:***@h/2"
    assert redacted_url("redis://h:1/0") == "redis://h:1/0"


def test_env_example_documents_every_setting() -> None:
    documented = {
        line.split("=", 1)[0].lstrip("# ").strip()
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.lstrip("# ").startswith("EDGEQ_") and "=" in line
    }
    fields = {f"EDGEQ_{name.upper()}" for name in ALL_FIELDS}
    assert fields == documented
    # The docs site's reference (generated from the classes: make docs-generate) too.
    reference = (Path(__file__).parent.parent / "docs/reference/settings.md").read_text()
    assert set(re.findall(r"(?m)^\| `(EDGEQ_\w+)` \|", reference)) == documented


def test_the_docs_explain_every_setting() -> None:
    """README is short now (#32): the docs site explains each setting, on a written page or in
    the generated reference with a description (its field's, or .env.example's comment)."""
    docs = Path(__file__).parent.parent / "docs"
    written = "".join(page.read_text() for page in docs.glob("*.md"))
    described = {
        variable
        for variable, description in re.findall(
            r"(?m)^\| `(EDGEQ_\w+)` \|[^|]*\|[^|]*\| (.*) \|$",
            (docs / "reference/settings.md").read_text(),
        )
        if description != "(no description)"
    }
    missing = [
        variable
        for variable in (f"EDGEQ_{name.upper()}" for name in ALL_FIELDS)
        if f"`{variable}`" not in written and variable not in described
    ]
    assert missing == []


def test_gateway_lists_are_comma_separated_and_bad_values_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGEQ_GATEWAY_API_KEYS", " key-a, ,key-b ")
    monkeypatch.setenv("EDGEQ_GATEWAY_MODEL_ALIASES", "Qwen-0.6B")
    settings = load_settings(GatewaySettings)
    assert settings.gateway_api_keys == ["key-a", "key-b"]
    assert settings.gateway_model_aliases == ["Qwen-0.6B"]
    assert settings.gateway_host == "127.0.0.1"  # loopback unless told otherwise
    monkeypatch.setenv("EDGEQ_GATEWAY_PORT", "70000")
    with pytest.raises(ConfigError, match="EDGEQ_GATEWAY_PORT"):
        load_settings(GatewaySettings)
