"""Redis Sentinel URLs in EDGEQ_REDIS_URL, for a highly available Redis.

    redis+sentinel://[[username]:password@]host1:port1[,host2:port2,...]/service_name[/db]

- ``host:port`` pairs are Sentinels (an IPv6 host goes in brackets: ``[::1]:26379``);
  ``service_name`` is the name the Sentinels monitor the master under; ``db`` defaults to 0.
- ``username`` and ``password`` (percent-encoded) are for the Redis master and replicas,
  the data nodes, not for the Sentinels.
- ``?sentinel_password=...`` (and ``&sentinel_username=...``) for Sentinels that require their
  own password.
- ``rediss+sentinel://`` uses TLS to the data nodes (certificates checked against the system's
  CAs); the Sentinels themselves are always reached in plain TCP.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme → TLS
SENTINEL_QUERY = ("sentinel_username", "sentinel_password")
SENTINEL_FORMAT = (
    "redis+sentinel://[[username]:password@]host1:port1[,host2:port2,...]/service_name[/db]"
)


@dataclass(frozen=True)
class SentinelTarget:
    """What a sentinel URL names. ``repr`` leaves the passwords out."""

    hosts: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False

    def __repr__(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.hosts)
        return f"SentinelTarget({hosts}/{self.service_name}/{self.db}, ssl={self.ssl})"


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a sentinel URL; ValueError (never showing a password) says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"a sentinel URL starts with {' or '.join(SENTINEL_SCHEMES)}://")
    hosts, username, password = parse_hosts_and_credentials(
        parts, what="Sentinel", url_format=SENTINEL_FORMAT
    )
    service, *rest = parts.path.removeprefix("/").split("/")
    if not service:
        raise ValueError(f"names no service (the Sentinels' master name): {SENTINEL_FORMAT}")
    if len(rest) > 1:
        raise ValueError(f"has more than /service_name/db after the hosts ({SENTINEL_FORMAT})")
    db = rest[0] if rest else "0"
    if not (db.isascii() and db.isdigit()):
        raise ValueError(f"db must be a number 0 or more, not {db!r}")
    query: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in SENTINEL_QUERY:
            accepted = ", ".join(SENTINEL_QUERY)
            raise ValueError(f"unknown query parameter {name!r} (accepted: {accepted})")
        if name in query:
            raise ValueError(f"query parameter {name!r} is given twice")
        query[name] = value
    return SentinelTarget(
        hosts=hosts,
        service_name=unquote(service),
        db=int(db),
        username=username,
        password=password,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
        ssl=SENTINEL_SCHEMES[parts.scheme],
    )


def parse_hosts_and_credentials(
    parts: SplitResult, *, what: str, url_format: str
) -> tuple[tuple[tuple[str, int], ...], str | None, str | None]:
    """(hosts, username, password) of a URL naming several hosts after optional
    credentials, ``[[username]:password@]host1:port1[,host2:port2,...]``; ValueError (never
    showing a password) names ``what`` the hosts are."""
    if parts.fragment:
        raise ValueError("has a '#': percent-encode it (%23) in a password")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        if ":" not in userinfo:
            raise ValueError(f"write the credentials as [username]:password@ ({url_format})")
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret)
    hosts = tuple(
        parse_host_port(item, what=what, url_format=url_format)
        for item in (hostlist.split(",") if hostlist else ())
    )
    if not hosts:
        raise ValueError(f"names no {what} host:port ({url_format})")
    return hosts, username, password


def parse_host_port(item: str, *, what: str, url_format: str) -> tuple[str, int]:
    """``host:port`` (``[IPv6]:port``) of one of a URL's hosts; ValueError names ``what``."""
    bracketed = item.startswith("[")
    host, _, port = item[1:].partition("]:") if bracketed else item.rpartition(":")
    if not host or ("]" if bracketed else ":") in host:
        raise ValueError(f"{what} {item!r} is not host:port ({url_format})")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{what} {item!r} has no valid port (1-65535) ({url_format})")
    return host, int(port)
