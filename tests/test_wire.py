"""The worker's deserializer is the trust boundary: nothing in Redis can make it do more."""

from __future__ import annotations

import json
import pickle

from edgeq.core.protocol import dump_json
from edgeq.worker.wire import JobPayload, load_job
from edgeq.worker.wire import dump_json as worker_dump_json


def test_a_producer_job_decodes_to_its_request() -> None:
    raw = dump_json({"f": "chat", "a": [{"messages": []}], "k": {}, "t": 1, "et": 123})
    job = load_job(raw)
    assert job["f"] == "chat" and job["t"] == 1 and job["et"] == 123
    payload = job["a"][0]
    assert payload == JobPayload(request={"messages": []}, problem=None, size=len(raw))


def test_pickle_becomes_a_problem_without_being_loaded() -> None:
    job = load_job(pickle.dumps({"f": "chat", "a": [], "k": {}}))
    assert job["f"] == "chat"
    assert "pickle is never accepted" in job["a"][0].problem


def test_the_payload_repr_never_shows_the_prompt() -> None:
    payload = load_job(dump_json({"f": "chat", "a": [{"secret": "prompt"}], "k": {}}))["a"][0]
    assert "prompt" not in repr(payload) and "secret" not in repr(payload)


def test_results_keep_the_request_as_json() -> None:
    payload = JobPayload(request={"messages": [1]}, problem=None, size=3)
    assert json.loads(worker_dump_json({"a": [payload]})) == {"a": [{"messages": [1]}]}
