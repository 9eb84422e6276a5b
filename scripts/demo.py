"""`make demo`: Redis (started here if none answers), a worker on EDGEQ_MODEL (or the tiny
model when that is not available offline), one chat streamed to the terminal, then everything
this script started is stopped again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import redis

from edgeq.core.errors import ConfigError
from edgeq.core.sentinel import is_sentinel_url
from edgeq.core.settings import load_settings, redacted_url
from edgeq.testing.processes import RedisServer, WorkerFailed, WorkerProcess
from edgeq.worker.settings import WorkerSettings

DEMO_DIR = Path(".demo")
PROMPT = "In one sentence, what is a job queue good for?"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def redis_answers(url: str) -> bool:
    if is_sentinel_url(url):
        return True  # the Sentinels are someone else's to run; the worker says if they fail
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def ensure_redis(url: str) -> RedisServer | None:
    """None when a Redis already answers at the URL; else a private one on its port."""
    if redis_answers(url):
        say(f"using the Redis at {redacted_url(url)}")
        return None
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.hostname not in LOCAL_HOSTS:
        sys.exit(f"edgeq demo: nothing answers at {redacted_url(url)}, and it is not local")
    say(f"no Redis at {redacted_url(url)}: starting one on port {parts.port or 6379}")
    extra = ("--requirepass", parts.password) if parts.password else ()
    return RedisServer(port=parts.port or 6379, extra_args=extra).start()


def model_available_offline(model: str) -> bool:
    if Path(model).is_dir():
        return True
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def choose_model(model: str) -> tuple[str, dict[str, str]]:
    if model_available_offline(model):
        say(f"model: {model}")
        return model, {"HF_HUB_OFFLINE": "1"}
    try:
        from huggingface_hub import snapshot_download

        say(f"model: {model} is not on this machine; trying to download it once")
        snapshot_download(model, etag_timeout=5)
        return model, {}
    except Exception as error:  # no network, no hub: the demo still runs, and says so
        tiny = DEMO_DIR / "tiny-model"
        say(f"{model} is not available here ({type(error).__name__})")
        say(f"using the generated tiny model in {tiny}: random weights, so its answer is noise")
        subprocess.run([sys.executable, "-m", "edgeq", "make-tiny-model", str(tiny)],
                       check=True)  # fmt: skip
        return str(tiny.resolve()), {"HF_HUB_OFFLINE": "1"}


def main() -> int:
    try:
        settings = load_settings(WorkerSettings)
    except ConfigError as error:
        sys.exit(f"edgeq demo: {error}")
    redis_server = ensure_redis(settings.redis_url)
    worker: WorkerProcess | None = None
    try:
        model, model_env = choose_model(settings.model)
        env = {"EDGEQ_MODEL": model, **model_env}
        worker = WorkerProcess(env, DEMO_DIR / "worker.log").start()
        say(f"starting the worker (log: {worker.log_path}); the engine takes ~20-60 s to warm")
        ready = worker.wait_ready()
        say(f"worker ready after {ready['since_process_start_s']} s; sending one chat:")
        print(f"\n  you> {PROMPT}\n  edgeq> ", end="", flush=True)
        chat = subprocess.run(
            [sys.executable, "-m", "edgeq", "chat", PROMPT, "--max-tokens", "64"],
            env={**os.environ, **env},
        )
        print()
        return chat.returncode
    except WorkerFailed as error:
        print(f"edgeq demo: {error}", file=sys.stderr)
        return 1
    finally:
        if worker is not None:
            say("stopping the worker")
            worker.stop()
        if redis_server is not None:
            say("stopping the Redis this demo started")
            redis_server.stop()


if __name__ == "__main__":
    sys.exit(main())
