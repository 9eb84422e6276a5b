"""Redis Sentinel URLs in EDGEQ_REDIS_URL, against a real redis-server and a real Sentinel."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from arq.worker import Worker, func
from redis.asyncio.sentinel import SentinelConnectionPool

from edgeq.core.connection import make_redis
from edgeq.core.errors import ConfigError, RedisUnavailable
from edgeq.core.protocol import DeltaEvent, DoneEvent, dump_json, load_json
from edgeq.core.sentinel import SentinelTarget, parse_sentinel_url
from edgeq.core.settings import ConnectionSettings, load_settings, redacted_url
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess
from helpers import FULL_LENGTH_SEEDS, SentinelServer, free_port

SECRET = "s3cret"


@pytest.fixture(scope="module")
def sentinel(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SentinelServer]:
    """A Sentinel monitoring the suite's Redis, the one the shared worker serves."""
    server = SentinelServer(redis_server.port, tmp_path_factory.mktemp("sentinel")).start()
    yield server
    server.stop()


# --- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+sentinel://h1:26379/edgeq",
            SentinelTarget(hosts=(("h1", 26379),), service_name="edgeq"),
        ),
        (
            "redis+sentinel://:pw@h1:1,10.0.0.2:2,[::1]:3/svc/4",
            SentinelTarget(
                hosts=(("h1", 1), ("10.0.0.2", 2), ("::1", 3)),
                service_name="svc",
                db=4,
                password="pw",
            ),
        ),
        (
            "rediss+sentinel://alice:p%40ss@h:26379/my%20svc/1"
            "?sentinel_password=sp%26w&sentinel_username=sam",
            SentinelTarget(
                hosts=(("h", 26379),),
                service_name="my svc",
                db=1,
                username="alice",
                password="p@ss",
                sentinel_username="sam",
                sentinel_password="sp&w",
                ssl=True,
            ),
        ),
    ],
)
def test_sentinel_urls_are_accepted(
    clean_edgeq_env: None, monkeypatch: pytest.MonkeyPatch, url: str, expected: SentinelTarget
) -> None:
    monkeypatch.setenv("EDGEQ_REDIS_URL", url)
    assert load_settings(ConnectionSettings).redis_url == url
    target = parse_sentinel_url(url)
    assert target == expected
    assert "pw" not in repr(target) and "p@ss" not in repr(target)


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        (f"redis+sentinel://:{SECRET}@h1:26379", "names no service"),
        (f"redis+sentinel://:{SECRET}@h1:26379/", "names no service"),
        (f"redis+sentinel://:{SECRET}@h1:26379//1", "names no service"),
        (f"redis+sentinel://:{SECRET}@h1:port/edgeq", "'h1:port' has no valid port"),
        (f"redis+sentinel://:{SECRET}@h1:0/edgeq", "'h1:0' has no valid port"),
        (f"redis+sentinel://:{SECRET}@h1:65536/edgeq", "has no valid port"),
        (f"redis+sentinel://:{SECRET}@h1/edgeq", "'h1' is not host:port"),
        (f"redis+sentinel://:{SECRET}@h1:1,,h2:2/edgeq", "'' is not host:port"),
        (f"redis+sentinel://:{SECRET}@::1:26379/edgeq", "is not host:port"),
        (f"redis+sentinel://:{SECRET}@/edgeq", "names no Sentinel host:port"),
        ("redis+sentinel:///edgeq", "names no Sentinel host:port"),
        (f"redis+sentinel://:{SECRET}@h1:1/edgeq/x", "db must be a number"),
        (f"redis+sentinel://:{SECRET}@h1:1/edgeq/-1", "db must be a number"),
        (f"redis+sentinel://:{SECRET}@h1:1/edgeq/0/more", "more than /service_name/db"),
        (f"redis+sentinel://{SECRET}@h1:1/edgeq", "[username]:password@"),
        (f"redis+sentinel://h1:1/edgeq?sentinel_pasword={SECRET}", "unknown query parameter"),
        (f"redis+sentinel://h1:1/edgeq?sentinel_password={SECRET}&sentinel_password=x", "twice"),
        (f"redis+sentinel://:pw#{SECRET}@h1:1/edgeq", "percent-encode"),
        (f"sentinel://:{SECRET}@h1:1/edgeq", "redis+sentinel://"),
    ],
)
def test_a_bad_sentinel_url_is_refused_without_its_password(
    clean_edgeq_env: None, monkeypatch: pytest.MonkeyPatch, url: str, complaint: str
) -> None:
    monkeypatch.setenv("EDGEQ_REDIS_URL", url)
    with pytest.raises(ConfigError) as failure:
        load_settings(ConnectionSettings)
    message = str(failure.value)
    assert "EDGEQ_REDIS_URL: " in message
    assert complaint in message
    assert SECRET not in message


def test_redacted_url_hides_sentinel_passwords() -> None:
    assert (
        redacted_url("redis+sentinel://alice:pw@h1:1,h2:2/edgeq/0?sentinel_password=spw")
        == "redis+sentinel://alice:***@h1:1,h2:2/edgeq/0?sentinel_password=***"
    )
    assert redacted_url("rediss+sentinel://:p@w@h1:x,h2/e") == "rediss+sentinel://:***@h1:x,h2/e"
    assert redacted_url("redis+sentinel://h1:1/e?sentinel_username=sam") == (
        "redis+sentinel://h1:1/e?sentinel_username=sam"
    )


# --- against a real Sentinel ----------------------------------------------------------------


@pytest.mark.engine
async def test_a_chat_through_sentinel_streams_to_done(
    worker: WorkerProcess, redis_server: RedisServer, sentinel: SentinelServer
) -> None:
    assert worker.env["EDGEQ_REDIS_URL"] == redis_server.url  # the Sentinel's master
    async with ChatClient(redis_url=sentinel.url(), queue=worker.env["EDGEQ_QUEUE"]) as client:
        pool = client.redis.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        job = await client.submit("Say something.", max_tokens=24, seed=FULL_LENGTH_SEEDS[0])
        events = [event async for event in job.stream()]
        assert pool.master_address == ("127.0.0.1", redis_server.port)
    assert [event.seq for event in events] == list(range(len(events)))
    assert isinstance(events[-1], DoneEvent)
    deltas = [event for event in events[:-1] if isinstance(event, DeltaEvent)]
    assert len(deltas) == len(events) - 1 >= 1
    assert events[-1].usage.completion_tokens > 0


async def add(ctx: dict[str, Any], a: int, b: int) -> int:
    return a + b


async def test_arq_enqueues_and_works_through_sentinel(sentinel: SentinelServer) -> None:
    settings = ConnectionSettings(redis_url=sentinel.url(db=3), queue="edgeq:sentinel-arq")
    redis = make_redis(settings)
    assert redis.default_queue_name == settings.queue and redis.job_serializer is dump_json
    job = await redis.enqueue_job("add", 2, 3)
    assert job is not None
    worker = Worker(
        functions=[func(add, name="add")],
        queue_name=settings.queue,
        redis_pool=make_redis(settings),
        burst=True,
        handle_signals=False,
        poll_delay=0.05,
        job_serializer=dump_json,
        job_deserializer=load_json,
    )
    try:
        await worker.main()
        assert await job.result(timeout=5) == 5
    finally:
        await worker.close()
        await redis.aclose()


@pytest.mark.parametrize("service", ["no-such-service", None])
async def test_an_unknown_service_or_no_sentinel_is_a_clear_error(
    sentinel: SentinelServer, service: str | None
) -> None:
    if service is None:  # nothing listens where the URL says the Sentinel is
        url = f"redis+sentinel://:{SECRET}@127.0.0.1:{free_port()}/edgeq?sentinel_password={SECRET}"
    else:
        url = sentinel.url(service=service, password=SECRET)
    async with ChatClient(redis_url=url, redis_connect_timeout_s=1) as client:
        with pytest.raises(RedisUnavailable) as failure:
            await client.submit("hello", max_tokens=1)
    message = str(failure.value)
    assert f"No master found for {service or 'edgeq'!r}" in message
    assert "EDGEQ_REDIS_URL" in message
    assert SECRET not in message
    assert failure.value.__cause__ is None and failure.value.__suppress_context__


async def test_data_node_and_sentinel_passwords(tmp_path: Path) -> None:
    data_password, sentinel_password = "d@ta:s3cret", "sentinel-s3cret"
    master = RedisServer(extra_args=("--requirepass", data_password)).start()
    sentinel = SentinelServer(
        master.port, tmp_path, master_password=data_password, requirepass=sentinel_password
    )
    try:
        sentinel.start()
        good = sentinel.url(password=data_password)
        async with ChatClient(redis_url=good) as client:
            assert await client.redis.ping()
        bad_urls = {
            good.partition("?")[0]: "Authentication required",  # no sentinel_password
            sentinel.url(password="wrong"): "refused the credentials",
        }
        for url, complaint in bad_urls.items():
            async with ChatClient(redis_url=url) as client:
                with pytest.raises(RedisUnavailable, match=complaint) as failure:
                    await client.submit("hello", max_tokens=1)
            assert "s3cret" not in str(failure.value)
    finally:
        sentinel.stop()
        master.stop()


async def test_a_new_client_follows_a_failover(tmp_path: Path) -> None:
    def node_args(name: str) -> tuple[str, ...]:  # a full sync writes dump.rdb into --dir
        (tmp_path / name).mkdir()
        return ("--dir", str(tmp_path / name), "--repl-diskless-sync-delay", "0")

    master = RedisServer(extra_args=node_args("master")).start()
    follow = ("--replicaof", "127.0.0.1", str(master.port))
    replica = RedisServer(extra_args=(*node_args("replica"), *follow)).start()
    sentinel = SentinelServer(master.port, tmp_path)
    try:
        sentinel.start()
        with sentinel.client() as control:
            deadline = time.monotonic() + 15
            while not any(  # the Sentinel must know a healthy replica to promote
                state["flags"] == "slave" and state["master-link-status"] == "ok"
                for state in control.sentinel_slaves(sentinel.service)
            ):
                assert time.monotonic() < deadline, "the Sentinel never saw the replica"
                await asyncio.sleep(0.1)
            settings = ConnectionSettings(redis_url=sentinel.url())
            before = make_redis(settings)
            await before.set("edgeq:written-before", "1")
            assert await before.execute_command("WAIT", 1, 5000) == 1  # on the replica too
            assert (await before.info("server"))["tcp_port"] == master.port
            await before.aclose()
            control.sentinel_failover(sentinel.service)
        await asyncio.to_thread(sentinel.wait_for_master, ("127.0.0.1", replica.port))
        after = make_redis(settings)
        try:
            assert (await after.info("server"))["tcp_port"] == replica.port
            assert await after.get("edgeq:written-before") == b"1"
            assert await after.set("edgeq:written-after", "1")  # a master: writes are taken
        finally:
            await after.aclose()
    finally:
        sentinel.stop()
        replica.stop()
        master.stop()


@pytest.fixture
def tls_files(tmp_path: Path) -> Path:
    """A throw-away CA (ca.crt) and a node certificate it signed (node.crt, node.key)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    for command in (
        "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=ca -keyout ca.key -out ca.crt",
        "req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout node.key -out node.csr",
        "x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out node.crt",
    ):
        subprocess.run(["openssl", *command.split()], cwd=tmp_path, check=True, capture_output=True)
    return tmp_path


async def test_rediss_sentinel_uses_tls_to_the_data_node(
    tls_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = {
        "tls-cert-file": tls_files / "node.crt",
        "tls-key-file": tls_files / "node.key",
        "tls-ca-cert-file": tls_files / "ca.crt",
        "tls-auth-clients": "no",
    }
    port = free_port()
    args = [item for name, value in tls.items() for item in (f"--{name}", str(value))]
    master = RedisServer(port, ("--port", "0", "--tls-port", str(port), *args)).start()
    sentinel = SentinelServer(  # the Sentinel itself listens in plain TCP
        port, tls_files, extra_config=("tls-replication yes", *(f"{n} {v}" for n, v in tls.items()))
    )
    try:
        sentinel.start()
        url = sentinel.url().replace("redis+sentinel://", "rediss+sentinel://")
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        async with ChatClient(redis_url=url) as client:  # the test CA is not trusted yet
            with pytest.raises(RedisUnavailable, match="certificate verify failed"):
                await client.submit("hello", max_tokens=1)
        monkeypatch.setenv("SSL_CERT_FILE", str(tls_files / "ca.crt"))
        async with ChatClient(redis_url=url) as client:
            assert await client.redis.ping()
        async with ChatClient(redis_url=sentinel.url()) as client:  # no TLS: refused
            with pytest.raises(RedisUnavailable):
                await client.submit("hello", max_tokens=1)
    finally:
        sentinel.stop()
        master.stop()
