"""The gateway fuzzed: every route of its OpenAPI schema, called by Hypothesis with bodies,
ids and query parameters a careless or hostile client sends (wrong types, huge numbers, lone
surrogates, control characters, unknown fields, bodies that are not JSON), against a real
gateway process on the suite's Redis, no worker. None may answer 5xx.

A request that passes every check goes on as far as it can: a response is created in the
background (stored, queued, answered), a batch is created from a real file; a chat completion
(or a response not in the background) waits for a worker that never comes and ends after
EDGEQ_STREAM_TIMEOUT_S with a 504 `stream_timeout`, the one 5xx allowed (and only for that).
Bounded to about a minute.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeq.gateway.app import create_app
from edgeq.gateway.settings import GatewaySettings
from edgeq.testing.processes import GatewayProcess, RedisServer

QUEUE = "edgeq:abuse-unserved"
MODEL = "tiny"
KEY = "sk-abuse"
# Per test: well under a minute in all on a loaded two-core machine. The long run, whose
# report is in docs/gateway.md ("The abuse suite"), sets EDGEQ_ABUSE_EXAMPLES.
EXAMPLES = int(os.environ.get("EDGEQ_ABUSE_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a request's time is the machine's, not the gateway's fault
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: The routes as the gateway's own OpenAPI schema lists them (it serves none: openapi_url is
#: None; the schema is still what FastAPI knows of its routes).
SCHEMA = create_app(GatewaySettings(model=MODEL)).openapi()
ROUTES = sorted(
    (method.upper(), path)
    for path, operations in SCHEMA["paths"].items()
    for method in operations
    if path.startswith("/v1/")
)
#: A body that passes every check, per JSON route; the fuzzer changes its fields.
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 8, "temperature": 0.5, "user": "u", "metadata": {"k": "v"},
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    },
    "/v1/responses": {
        "model": MODEL, "background": True, "instructions": "be brief", "metadata": {"k": "v"},
        "max_output_tokens": 8, "text": {"format": {"type": "text"}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    },
    "/v1/batches": {"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                    "completion_window": "24h", "metadata": {"k": "v"}},  # file: the fixture's
}  # fmt: skip
STREAM_TIMEOUT_S = 0.3

NASTY_TEXT = st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "\u202e", "\ufeff", "x" * 600, "../../etc", "%00", "",
     "resp_", "file-", "batch_", "1e400", "-1", "Infinity"]
)  # fmt: skip
TEXT = st.text(max_size=40) | NASTY_TEXT
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
JSON = (
    NASTY_TEXT
    | st.dictionaries(TEXT, TEXT, max_size=3)  # nearly a metadata
    | st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
        max_leaves=12,
    )
)


def leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value: each leaf, each dict key's value, each list item."""
    places = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            places += leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            places += leaves(item, (*path, index))
    return places


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``value`` with ``new`` at ``path``; as it was if an earlier change removed the path."""
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict) and head in value:
        return {**value, head: replaced(value[head], tuple(rest), new)}
    if isinstance(value, list) and isinstance(head, int) and head < len(value):
        copy = list(value)
        copy[head] = replaced(copy[head], tuple(rest), new)
        return copy
    return value


def field_names(path: str) -> list[str]:
    """The body fields the schema names for the POST of ``path``."""
    body = SCHEMA["paths"][path].get("post", {}).get("requestBody")
    if body is None:
        return []
    ref = body["content"]["application/json"]["schema"].get("$ref", "")
    model = SCHEMA["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
    return sorted(model.get("properties", {}))


@pytest.fixture(scope="module")
def http(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": QUEUE,
        "EDGEQ_MODEL": MODEL,
        "EDGEQ_STREAM_TIMEOUT_S": str(STREAM_TIMEOUT_S),
        "EDGEQ_GATEWAY_TENANT_KEYS": f"acme={KEY}",
    }
    gateway = GatewayProcess(env, tmp_path_factory.mktemp("abuse") / "gateway.log").start()
    base = f"http://127.0.0.1:{gateway.port}"
    try:
        with httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as client:
            line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": VALID["/v1/chat/completions"]}  # fmt: skip
            upload = client.post(
                "/v1/files",
                files={"file": ("in.jsonl", json.dumps(line).encode())},
                data={"purpose": "batch"},
            )
            assert upload.status_code == 200, upload.text
            VALID["/v1/batches"]["input_file_id"] = upload.json()["id"]
            yield client
    finally:
        gateway.stop()


WAITING_ROUTES = ("/v1/chat/completions", "/v1/responses")


def no_server_error(response: httpx.Response) -> None:
    request = response.request
    # A chat, or a response that is not in the background, waits for a worker that never
    # comes: by design (found by the long run: a body the fuzzer set "background": false).
    if response.status_code == 504 and request.url.path in WAITING_ROUTES:
        assert response.json()["error"]["code"] == "stream_timeout"
        return
    assert response.status_code < 500, (
        f"{request.method} {request.url} {request.content[:300]!r} -> "
        f"{response.status_code} {response.text[:300]}"
    )


def test_the_schema_lists_every_route() -> None:
    assert ("POST", "/v1/chat/completions") in ROUTES
    assert ("GET", "/v1/responses/{response_id}") in ROUTES
    assert ("DELETE", "/v1/files/{file_id}") in ROUTES
    assert field_names("/v1/responses")  # the fuzzer knows the body's fields


@FUZZ
@given(
    path=st.sampled_from(sorted(VALID)),
    changes=st.data(),
    raw=st.none() | st.binary(max_size=64),
)
def test_json_bodies_never_get_a_5xx(
    http: httpx.Client, path: str, changes: st.DataObject, raw: bytes | None
) -> None:
    if raw is not None:  # not JSON, or not the JSON asked for
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        no_server_error(response)
        return
    body: dict[str, Any] = VALID[path]
    # A few places of a valid body changed (a nasty string in a message's text, a metadata
    # value of the wrong type), and maybe a field the schema names, or none, added.
    for place in changes.draw(st.lists(st.sampled_from(leaves(body)), max_size=2)):
        body = replaced(body, place, changes.draw(JSON))
    names = st.sampled_from(field_names(path)) | TEXT
    for name, value in changes.draw(st.dictionaries(names, JSON, max_size=2)).items():
        body = {**body, name: value}
    # ensure_ascii: a lone surrogate goes as its \u escape, as a careless client sends it
    content = json.dumps(body)
    no_server_error(
        http.post(path, content=content, headers={"Content-Type": "application/json"})
    )


@FUZZ
@given(
    route=st.sampled_from([route for route in ROUTES if "{" in route[1] or route[0] == "GET"]),
    ident=TEXT,
    query=st.dictionaries(
        st.sampled_from(["limit", "after", "order", "purpose", "stream", "starting_after"]),
        TEXT | st.integers(min_value=-(2**70), max_value=2**70).map(str),
        max_size=3,
    ),
)
def test_ids_and_query_parameters_never_get_a_5xx(
    http: httpx.Client, route: tuple[str, str], ident: str, query: dict[str, str]
) -> None:
    method, template = route
    quoted = quote(ident.encode("utf-8", "surrogatepass"), safe="") or "x"
    path = template.split("{", 1)[0] + quoted + template.split("}", 1)[1] if "{" in template \
        else template  # fmt: skip
    params = {name: value.encode("utf-8", "surrogatepass") for name, value in query.items()}
    no_server_error(http.request(method, path, params=params))


@settings(FUZZ, max_examples=EXAMPLES // 3)
@given(
    content=st.binary(max_size=256),
    filename=TEXT,
    purpose=TEXT,
    fields=st.integers(min_value=0, max_value=2),
)
def test_uploads_never_get_a_5xx(
    http: httpx.Client, content: bytes, filename: str, purpose: str, fields: int
) -> None:
    name = filename.encode("utf-8", "surrogatepass").decode("latin-1")
    files = [("file", (name, content))] * max(fields, 1)
    data = {"purpose": purpose.encode("utf-8", "surrogatepass").decode("latin-1")}
    no_server_error(http.post("/v1/files", files=files, data=data if fields else None))
