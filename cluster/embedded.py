"""Where Tether's Redis is: ``TETHER_REDIS_URL`` if set, otherwise an embedded ``redis-server``.

The embedded default (issue 3, "Embedded default") starts ``redis-server`` on a free loopback port with
its data under ``$TETHER_HOME/redis`` (``.tether/redis`` by default), with AOF and ``appendfsync always``
(see ``cluster.redis_server``), and stops it when the process exits. After starting it the URL is put in
``os.environ["TETHER_REDIS_URL"]`` so child processes (a local Ray's workers) use the same server instead
of starting their own.

Two processes must never run a server over one data directory (both would write the same AOF), so the
embedded server holds an exclusive lock on ``<data dir>/embedded.lock``; a second process gets a clear
error telling it how to share the first one's server or use another ``TETHER_HOME``.

Also here, because every Redis user in ``cluster/`` needs them: ``redact_url`` (never print a password)
and ``redis_errors`` (redis-py exceptions -> ``runtime.errors``).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.exceptions

from cluster.redis_server import RedisServer
from runtime.errors import DependencyError, InputError

__all__ = [
    "REDIS_URL_ENV",
    "EmbeddedRedis",
    "check_redis_url",
    "redact_url",
    "redis_errors",
    "redis_url_from_env",
    "stop_embedded",
    "tether_home",
]

REDIS_URL_ENV = "TETHER_REDIS_URL"
HOME_ENV = "TETHER_HOME"


def tether_home(env: Mapping[str, str] | None = None) -> Path:
    """``$TETHER_HOME`` or ``.tether`` (relative to the working directory)."""
    env = os.environ if env is None else env
    return Path(env.get(HOME_ENV) or ".tether")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@contextlib.contextmanager
def redis_errors(url: str, doing: str) -> Iterator[None]:
    """Translate redis-py failures raised inside the block into ``runtime.errors`` types.

    Unreachable or timing-out servers become retryable ``DependencyError``; authentication failures are
    non-retryable (retrying cannot fix a wrong password). The message names ``doing`` and the redacted URL.
    Works around ``await`` expressions too (it is a plain context manager around the awaiting code).
    """
    where = redact_url(url)
    try:
        yield
    except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as e:
        # redis-py reports a missing password as NOAUTH, or as an AuthenticationError from HELLO.
        needs_password = isinstance(e, redis.exceptions.AuthenticationError) or str(e).startswith("NOAUTH")
        if needs_password and not _has_password(url):
            raise DependencyError(
                f"{doing}: Redis at {where} requires a password; put it in the URL "
                "(redis://:PASSWORD@host:port/0)",
                scope="redis",
                non_retryable=True,
            ) from e
        if needs_password:
            raise DependencyError(
                f"{doing}: Redis at {where} refused the credentials ({e})", scope="redis", non_retryable=True
            ) from e
        raise DependencyError(f"{doing}: Redis at {where} answered an error: {e}", scope="redis") from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        raise DependencyError(f"{doing}: Redis at {where} is unreachable ({e})", scope="redis") from e


def _has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def check_redis_url(url: str, *, timeout: float = 2.0) -> str:
    """Return ``url`` if a Redis there answers PING within ``timeout``; otherwise a clear error."""
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise InputError(
            f"expected a redis://, rediss:// or unix:// URL, got {redact_url(url)!r}", where=REDIS_URL_ENV
        )
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        with redis_errors(url, "checking the Redis in TETHER_REDIS_URL"):
            client.ping()
    finally:
        client.close()
    return url


class EmbeddedRedis:
    """A Tether-owned ``redis-server`` under ``data_dir``; a context manager yielding its URL.

    ``start`` takes the data-directory lock, starts the server and registers an ``atexit`` stop, so a
    forgotten ``stop`` still leaves nothing running; ``stop`` is idempotent.
    """

    def __init__(self, data_dir: Path, *, appendfsync: str = "always") -> None:
        self.data_dir = data_dir
        self.server = RedisServer(data_dir=data_dir, appendfsync=appendfsync)
        self._lock_file: IO[str] | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> str:
        """Start the server (if not started) and return its URL."""
        if self._lock_file is not None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = (self.data_dir / "embedded.lock").open("a+")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            lock.seek(0)
            owner = lock.read().strip() or "another process"
            lock.close()
            raise DependencyError(
                f"the embedded Redis data directory {self.data_dir} is in use by {owner}; "
                f"set {REDIS_URL_ENV} to that server's URL to share it, "
                f"or {HOME_ENV} to use another directory",
                scope="redis",
                non_retryable=True,
            ) from e
        try:
            self.server.start()
        except BaseException:
            lock.close()
            raise
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} serving {self.url}\n")
        lock.flush()
        self._lock_file = lock
        atexit.register(self.stop)
        return self.url

    def stop(self) -> None:
        """Stop the server and release the lock; safe to call more than once."""
        self.server.stop()
        lock, self._lock_file = self._lock_file, None
        if lock is not None:
            lock.close()  # closing drops the flock
            atexit.unregister(self.stop)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


_embedded: EmbeddedRedis | None = None
_embedded_guard = threading.Lock()


def redis_url_from_env(env: Mapping[str, str] | None = None, *, check: bool = True) -> str:
    """The Redis URL Tether should use.

    With ``TETHER_REDIS_URL`` set: that URL, after checking it answers (``check=False`` skips the PING).
    Unset: start (once per process) the embedded server under ``tether_home()/redis``, export its URL in
    ``os.environ`` for child processes, and stop it at exit.
    """
    global _embedded
    env = os.environ if env is None else env
    url = env.get(REDIS_URL_ENV)
    if url:
        return check_redis_url(url) if check else url
    with _embedded_guard:
        if _embedded is None:
            embedded = EmbeddedRedis(tether_home(env) / "redis")
            embedded.start()
            _embedded = embedded
            os.environ[REDIS_URL_ENV] = embedded.url
        return _embedded.url


def stop_embedded() -> None:
    """Stop the process's embedded server now (tests, and callers that want to stop before exit)."""
    global _embedded
    with _embedded_guard:
        embedded, _embedded = _embedded, None
    if embedded is not None:
        if os.environ.get(REDIS_URL_ENV) == embedded.url:
            del os.environ[REDIS_URL_ENV]
        embedded.stop()
