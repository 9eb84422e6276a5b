"""The gateway's tenant keys (EDGEQ_GATEWAY_TENANT_KEYS): how they are read, and that a bad
entry stops `edgeq gateway` with an error that names it but never shows a key."""

from __future__ import annotations

import os
import subprocess

import pytest

from edgeq.cli import main
from edgeq.core.errors import ConfigError
from edgeq.core.settings import load_settings
from edgeq.exit_codes import EXIT_CONFIG
from edgeq.gateway.settings import GatewaySettings
from helpers import EDGEQ

pytestmark = pytest.mark.usefixtures("clean_edgeq_env")

SECRET = "c2VjcmV0LWtleQ=="  # base64 padding: the entry splits at its first "="


def test_tenant_keys_are_tenant_equals_key_split_at_the_first_equals_sign(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entries = f" nightly = {SECRET}, ,support=sk-a,support=sk-b"
    monkeypatch.setenv("EDGEQ_GATEWAY_TENANT_KEYS", entries)
    settings = load_settings(GatewaySettings)
    assert settings.gateway_tenant_keys == [
        ("nightly", SECRET),
        ("support", "sk-a"),  # a tenant may have several keys (rotation)
        ("support", "sk-b"),
    ]
    assert settings.auth_required  # tenant keys alone turn auth on
    monkeypatch.delenv("EDGEQ_GATEWAY_TENANT_KEYS")
    assert load_settings(GatewaySettings).gateway_tenant_keys == []
    assert not load_settings(GatewaySettings).auth_required


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (f"ok=sk-1,bad tenant={SECRET}", "entry 2: the part before its first '=' is not a tenant"),
        (f"-dash={SECRET}", "entry 1: the part before its first '=' is not a tenant"),
        (f"{'t' * 65}={SECRET}", "entry 1: the part before its first '=' is not a tenant"),
        (SECRET.rstrip("="), "entry 1 is not tenant=key"),  # a key without its tenant
        ("nightly=", "entry 1 is not tenant=key"),
        (f"a={SECRET},b={SECRET}", "entry 2 gives tenant 'b' the key of tenant 'a'"),
    ],
)
def test_a_bad_tenant_key_entry_is_named_without_its_key(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(GatewaySettings, gateway_tenant_keys=value)
    message = str(refused.value)
    assert "EDGEQ_GATEWAY_TENANT_KEYS" in message and problem in message
    assert SECRET.rstrip("=") not in message


def test_a_key_both_plain_and_a_tenants_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_GATEWAY_API_KEYS", f"sk-plain,{SECRET}")
    monkeypatch.setenv("EDGEQ_GATEWAY_TENANT_KEYS", f"nightly={SECRET}")
    with pytest.raises(ConfigError, match="EDGEQ_GATEWAY_API_KEYS") as refused:
        load_settings(GatewaySettings)
    assert "tenant 'nightly'" in str(refused.value)
    assert SECRET.rstrip("=") not in str(refused.value)


def test_an_admin_key_that_is_also_a_job_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEQ_GATEWAY_TENANT_KEYS", f"nightly={SECRET}")
    monkeypatch.setenv("EDGEQ_GATEWAY_ADMIN_KEYS", f"sk-admin,{SECRET}")
    with pytest.raises(ConfigError, match="EDGEQ_GATEWAY_ADMIN_KEYS: key 2") as refused:
        load_settings(GatewaySettings)
    assert "a key of its own" in str(refused.value)
    assert SECRET.rstrip("=") not in str(refused.value)


def test_edgeq_gateway_stops_on_a_bad_tenant_entry_naming_it_but_not_the_key() -> None:
    env = {**os.environ, "EDGEQ_GATEWAY_TENANT_KEYS": f"nightly=sk-1,night ly={SECRET}"}
    ran = subprocess.run([*EDGEQ, "gateway"], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == EXIT_CONFIG, ran.stderr
    assert "EDGEQ_GATEWAY_TENANT_KEYS: entry 2" in ran.stderr
    assert SECRET.rstrip("=") not in ran.stderr + ran.stdout


#: A value each gateway setting refuses; numbers and switches get a word (below).
BAD_VALUES = {
    "redis_url": "http://127.0.0.1:6379",
    "queue": "",
    "tenant": "-not-a-tenant",
    "gateway_host": "",
    "model": "",
    "gateway_tenant_keys": f"nightly={SECRET},night ly=sk-{SECRET}",
    "gateway_webhooks": f'[{{"url": "http://h/hook", "secret": "{SECRET[:7]}"}}]',
    "log_level": "loud",
}
#: Settings no value is wrong for on its own (every comma-separated list of strings is one).
ANY_VALUE_GOES = {"gateway_api_keys", "gateway_admin_keys", "gateway_model_aliases"}


def bad_value(name: str) -> str:
    if name in BAD_VALUES:
        return BAD_VALUES[name]
    annotation = GatewaySettings.model_fields[name].annotation
    if annotation is bool:
        return "maybe"
    assert annotation in (int, float, int | None, float | None), f"{name}: add a bad value"
    return "many"


@pytest.mark.parametrize("name", sorted(set(GatewaySettings.model_fields) - ANY_VALUE_GOES))
def test_every_gateway_setting_with_a_bad_value_stops_it_with_78_and_one_line_and_no_secret(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    variable = f"EDGEQ_{name.upper()}"
    monkeypatch.setenv(variable, bad_value(name))
    with pytest.raises(ConfigError):  # refused, so the command below never starts a server
        load_settings(GatewaySettings)
    assert main(["gateway"]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("edgeq gateway: invalid settings: ")
    assert variable in err
    assert SECRET[:7] not in err


@pytest.mark.parametrize(
    "value",
    [
        f'[{{"url": "http://h/hook", "secret": "{SECRET}"',  # cut short
        f'{{"url": "http://h/hook", "secret": "{SECRET}"}}',  # an object, not a list
        "http://h/hook",
    ],
)
def test_a_malformed_webhooks_setting_stops_the_gateway_with_78_not_a_traceback(
    value: str,
) -> None:
    env = {**os.environ, "EDGEQ_GATEWAY_WEBHOOKS": value}
    ran = subprocess.run([*EDGEQ, "gateway"], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == EXIT_CONFIG, ran.stderr
    assert ran.stderr.startswith("edgeq gateway: invalid settings: EDGEQ_GATEWAY_WEBHOOKS: ")
    assert ran.stderr.count("\n") == 1 and "Traceback" not in ran.stderr
    assert SECRET[:7] not in ran.stderr + ran.stdout
