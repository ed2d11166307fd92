"""Pure edges of the Redis adapters: URLs never print passwords, redis-py errors map to runtime.errors,
and the in-memory store can simulate an outage."""

from __future__ import annotations

import pytest
import redis.exceptions

from cluster.embedded import redact_url, redis_errors
from runtime.errors import DependencyError
from runtime.memstore import MemoryLogStore


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6400/0", "redis://127.0.0.1:6400/0"),
        ("redis://:s3cret@127.0.0.1:6400/0", "redis://:***@127.0.0.1:6400/0"),
        ("rediss://tether:s3cret@cache.internal:6380/2", "rediss://tether:***@cache.internal:6380/2"),
        ("redis://:s3cret@[::1]:6400", "redis://:***@[::1]:6400"),
        ("redis://user@host:1/0", "redis://user@host:1/0"),
    ],
)
def test_redact_url_hides_only_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "error", "says", "retryable"),
    [
        ("redis://:pw@h:1/0", redis.exceptions.ConnectionError("refused"), "is unreachable", True),
        ("redis://:pw@h:1/0", redis.exceptions.TimeoutError("slow"), "is unreachable", True),
        (
            "redis://:pw@h:1/0",
            redis.exceptions.AuthenticationError("invalid password"),
            "refused the credentials",
            False,
        ),
        (
            "redis://h:1/0",
            redis.exceptions.AuthenticationError("HELLO must be called"),
            "requires a password",
            False,
        ),
        (
            "redis://h:1/0",
            redis.exceptions.ResponseError("NOAUTH Authentication required."),
            "requires a password",
            False,
        ),
        (
            "redis://:pw@h:1/0",
            redis.exceptions.ResponseError("WRONGTYPE Operation"),
            "answered an error",
            True,
        ),
    ],
    ids=["connection", "timeout", "wrong-password", "no-password-hello", "no-password-noauth", "wrongtype"],
)
def test_redis_errors_become_dependency_errors_without_the_password(
    url: str, error: Exception, says: str, retryable: bool
) -> None:
    # Given a redis-py failure inside the block
    # When it propagates
    with pytest.raises(DependencyError) as caught, redis_errors(url, "appending to tether:log:t"):
        raise error

    # Then it is a DependencyError saying what was being done, where, and whether a retry can help
    message = str(caught.value)
    assert message.startswith("appending to tether:log:t: Redis at redis://")
    assert says in message and ":pw@" not in message
    assert caught.value.non_retryable is (not retryable)
    assert caught.value.__cause__ is error


async def test_an_unavailable_memory_store_refuses_and_stores_nothing() -> None:
    # Given a store that has one entry and then goes down
    store = MemoryLogStore()
    await store.append("t", b"before")
    store.unavailable = "disk on fire"

    # When appending and reading
    # Then both raise DependencyError and nothing new is stored once it is back
    with pytest.raises(DependencyError, match="disk on fire"):
        await store.append("t", b"during")
    with pytest.raises(DependencyError):
        await store.read("t")
    store.unavailable = None
    assert [p for _, p in await store.read("t")] == [b"before"]
    assert store.appends == 1
