"""The LogStore contract, run against the in-memory store and a real redis-server; then what only Redis has
(password URLs, connection errors, AOF durability across a restart) and the embedded-server default."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import pytest
import redis

from cluster import embedded
from cluster.embedded import EmbeddedRedis, redis_url_from_env, stop_embedded
from cluster.log_store import DEFAULT_OUTAGE_S, OUTAGE_ENV, RedisLogStore, outage_budget_from_env
from cluster.redis_server import STREAM_NODE_MAX_BYTES, RedisServer, free_port
from runtime.codec import decode, encode
from runtime.errors import DependencyError, InputError
from runtime.fold import fold
from runtime.memstore import MemoryLogStore, parse_entry_id
from runtime.ports import LogStore
from runtime.record import TrajectoryRecord
from runtime.snapshot import encode_snapshot, fold_entries
from tests.integration.redis_proxy import ReplyEater

pytestmark = pytest.mark.integration


class ListingStore(LogStore, Protocol):
    async def list_trajectories(self) -> list[str]: ...


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ListingStore]:
    if request.param == "memory":
        yield MemoryLogStore()
        return
    url = request.getfixturevalue("redis_url")
    async with RedisLogStore.from_url(url) as redis_store:
        yield redis_store


# --------------------------------------------------------------------------- contract (both stores)


async def test_entries_come_back_in_append_order_with_increasing_ids(store: ListingStore) -> None:
    # Given three events appended to one trajectory
    payloads = [b"intent:model", b"result:model", b"intent:tool"]
    ids = [await store.append("t-1", p) for p in payloads]

    # When the log is read from the start
    entries = await store.read("t-1")

    # Then it holds exactly those bytes, in order, under the ids append returned, strictly increasing
    assert entries == list(zip(ids, payloads, strict=True))
    keys = [parse_entry_id(i) for i in ids]
    assert keys == sorted(keys) and len(set(keys)) == 3


async def test_append_many_stores_a_batch_in_order_after_single_appends(store: ListingStore) -> None:
    # Given one single append, then a batch of three
    first = await store.append("t-batch", b"a")
    ids = await store.append_many("t-batch", [b"b", b"c", b"d"])
    # Then the batch follows in order with increasing ids, and an empty batch stores nothing
    assert await store.append_many("t-batch", []) == []
    entries = await store.read("t-batch")
    assert [p for _, p in entries] == [b"a", b"b", b"c", b"d"]
    assert [i for i, _ in entries] == [first, *ids]


async def test_append_many_refuses_a_bad_payload_before_storing_any(store: ListingStore) -> None:
    with pytest.raises(InputError, match=r"payloads\[1\]"):
        await store.append_many("t-batch-bad", [b"ok", "not bytes"])  # type: ignore[list-item]
    assert not await store.exists("t-batch-bad")


async def test_read_after_returns_only_later_entries(store: ListingStore) -> None:
    # Given a log of four entries
    ids = [await store.append("t-1", f"e{i}".encode()) for i in range(4)]

    # When reading after the second and after the last
    later = await store.read("t-1", after=ids[1])
    none_left = await store.read("t-1", after=ids[-1])

    # Then only the third and fourth come back, and nothing after the last
    assert later == [(ids[2], b"e2"), (ids[3], b"e3")]
    assert none_left == []


async def test_read_after_an_id_never_issued_is_a_position(store: ListingStore) -> None:
    # Given a log with entries
    ids = [await store.append("t-1", b"x"), await store.append("t-1", b"y")]

    # When reading after the smallest possible id
    entries = await store.read("t-1", after="0-0")

    # Then every entry comes back
    assert [i for i, _ in entries] == ids


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x00\xff\x00", bytes(range(256)), b"\x93\x01\x02\x03", os.urandom(1 << 20)],
    ids=["empty", "nul-bytes", "all-bytes", "msgpack", "one-mebibyte"],
)
async def test_payload_bytes_round_trip_exactly(store: ListingStore, payload: bytes) -> None:
    # Given an opaque payload appended
    entry_id = await store.append("t-bytes", payload)

    # When read back
    # Then the bytes are identical
    assert await store.read("t-bytes") == [(entry_id, payload)]


async def test_logs_of_different_trajectories_are_separate(store: ListingStore) -> None:
    # Given appends interleaved across two trajectories
    await store.append("a", b"a1")
    await store.append("b", b"b1")
    await store.append("a", b"a2")

    # When each is read
    # Then each sees only its own entries
    assert [p for _, p in await store.read("a")] == [b"a1", b"a2"]
    assert [p for _, p in await store.read("b")] == [b"b1"]


async def test_an_unknown_trajectory_has_no_log(store: ListingStore) -> None:
    # Given an empty store
    # When asking about a trajectory that never appended
    # Then it does not exist and reads empty
    assert await store.exists("ghost") is False
    assert await store.read("ghost") == []


async def test_exists_and_listing_see_every_trajectory_with_a_log(store: ListingStore) -> None:
    # Given logs for three trajectories (ids with the characters real ids use)
    for tid in ("traj-b", "traj-a", "wl:7/x_1"):
        await store.append(tid, b"created")

    # When listing and checking
    listed = await store.list_trajectories()

    # Then all three are listed, sorted, and exist
    assert listed == ["traj-a", "traj-b", "wl:7/x_1"]
    assert all([await store.exists(t) for t in listed])


@pytest.mark.parametrize("bad_id", ["", "has space", "x" * 201, "tab\tin", "é"])
async def test_a_malformed_trajectory_id_is_refused_by_name(store: ListingStore, bad_id: str) -> None:
    # Given a trajectory id that cannot name a log
    # When appending, reading or checking it
    # Then each raises InputError naming the trajectory id, and nothing is stored
    for call in (store.append(bad_id, b"x"), store.read(bad_id), store.exists(bad_id)):
        with pytest.raises(InputError, match="trajectory_id"):
            await call
    assert await store.list_trajectories() == []


@pytest.mark.parametrize("bad_after", ["", "abc", "1-", "-1", "1-2-3", "$"])
async def test_a_malformed_after_id_is_refused_by_name(store: ListingStore, bad_after: str) -> None:
    # Given a log
    await store.append("t", b"x")

    # When reading after an id that is not '<int>-<int>'
    # Then InputError names the 'after' argument
    with pytest.raises(InputError, match="after"):
        await store.read("t", after=bad_after)


async def test_a_payload_that_is_not_bytes_is_refused(store: ListingStore) -> None:
    # Given a str where bytes are expected
    # When appending it
    # Then InputError names the payload and the log stays empty
    with pytest.raises(InputError, match="payload"):
        await store.append("t", "not bytes")  # type: ignore[arg-type]
    assert await store.exists("t") is False


# --------------------------------------------------------------------------- compaction (both stores)


def _hibernating_log() -> tuple[list[bytes], TrajectoryRecord]:
    """A trajectory's log up to an approval wait: a model call's spend, then a held call."""
    from tests.unit.runtime.scenario import Log

    log = Log()
    log.call_model()
    log.hold()
    return [encode(e) for e in log.events], log.record


async def test_trim_removes_only_the_entries_older_than_the_given_one(store: ListingStore) -> None:
    # Given five entries
    ids = [await store.append("t-trim", f"e{i}".encode()) for i in range(5)]
    # When trimmed before the fourth
    removed = await store.trim("t-trim", ids[3])
    # Then the first three are gone, the fourth and fifth stay under their ids, and appends go on after them
    assert removed == 3
    later = await store.append("t-trim", b"e5")
    assert await store.read("t-trim") == [(ids[3], b"e3"), (ids[4], b"e4"), (later, b"e5")]
    assert await store.exists("t-trim")
    assert await store.trim("t-trim", ids[3]) == 0  # again: nothing older is left


async def test_a_malformed_trim_id_is_refused_by_name(store: ListingStore) -> None:
    await store.append("t-trim-bad", b"e")
    with pytest.raises(InputError, match="before"):
        await store.trim("t-trim-bad", "latest")
    assert len(await store.read("t-trim-bad")) == 1


async def test_a_compacted_log_folds_to_the_record_of_the_whole_log(store: ListingStore) -> None:
    # Given a trajectory's log, compacted as a hibernating actor does it (snapshot appended, then the trim)
    payloads, record = _hibernating_log()
    await store.append_many("t-compact", payloads)
    [snapshot_id] = await store.append_many("t-compact", [encode_snapshot(record)])
    await store.trim("t-compact", snapshot_id)
    # When a woken incarnation reads it and folds it, and then appends on
    entries = await store.read("t-compact")
    # Then one entry is left, and it folds to the same record (spend, operations, the held call)
    assert len(entries) == 1
    woken = fold_entries(entries)
    assert woken == record and woken.spend == record.spend and woken.held == record.held


async def test_a_crash_between_snapshot_and_trim_loses_nothing(store: ListingStore) -> None:
    # Given the snapshot appended but the trim never run (the actor died in between)
    payloads, record = _hibernating_log()
    await store.append_many("t-crash", payloads)
    await store.append_many("t-crash", [encode_snapshot(record)])
    # Then the log still folds to the record, the covered entries ignored rather than applied twice
    entries = await store.read("t-crash")
    assert len(entries) == len(payloads) + 1
    assert fold_entries(entries) == record == fold([decode(p) for p in payloads])


# --------------------------------------------------------------------------- Redis specifics


def test_tethers_redis_uses_small_stream_nodes(redis_url: str) -> None:
    # A stream node is allocated whole: 2 KB nodes keep a compacted log (one snapshot entry) small
    raw = redis.Redis.from_url(redis_url)
    try:
        node_bytes = raw.config_get("stream-node-max-bytes")["stream-node-max-bytes"]
        raw.xadd("tether:log:t-node", {"e": b"x" * 2000})
        one_entry = raw.memory_usage("tether:log:t-node", samples=0)
    finally:
        raw.close()
    assert node_bytes == str(STREAM_NODE_MAX_BYTES)
    assert one_entry is not None and one_entry < 4096  # a 4 KB node (Redis's default) would not fit


async def test_entries_live_in_the_documented_stream_key_and_field(redis_url: str) -> None:
    # Given an append through the store
    async with RedisLogStore.from_url(redis_url) as store:
        entry_id = await store.append("t-9", b"\x81\xa1k\x01")

    # When the raw stream is inspected
    raw = redis.Redis.from_url(redis_url)
    try:
        entries = raw.xrange("tether:log:t-9")
    finally:
        raw.close()

    # Then the event is the 'e' field of that entry, beside the id of the batch that wrote it
    [(raw_id, fields)] = entries
    assert (raw_id, fields[b"e"], sorted(fields)) == (entry_id.encode(), b"\x81\xa1k\x01", [b"b", b"e"])


async def test_tethers_redis_fsyncs_every_acknowledged_append(redis_url: str) -> None:
    # Given the server Tether starts
    async with RedisLogStore.from_url(redis_url) as store:
        # When asked for its persistence settings
        durability = await store.durability()

    # Then AOF is on with fsync per write
    assert durability.appendonly is True and durability.appendfsync == "always"
    assert durability.fsync_per_write


async def test_acknowledged_entries_survive_a_redis_restart(tmp_path: Path) -> None:
    # Given entries acknowledged by a server that is then stopped
    server = RedisServer(data_dir=tmp_path / "r").start()
    try:
        async with RedisLogStore.from_url(server.url) as store:
            ids = [await store.append("t", f"e{i}".encode()) for i in range(5)]
    finally:
        server.stop()

    # When a new server starts over the same data directory
    with RedisServer(data_dir=tmp_path / "r") as restarted:
        async with RedisLogStore.from_url(restarted.url) as store:
            entries = await store.read("t")

    # Then every acknowledged entry is there (replayed from the AOF)
    assert entries == [(i, f"e{n}".encode()) for n, i in enumerate(ids)]


async def test_a_password_protected_url_works(tmp_path: Path) -> None:
    # Given a server that requires a password
    with RedisServer(data_dir=tmp_path / "r", password="s3cret-pw") as server:
        # When the store uses the URL carrying the password
        async with RedisLogStore.from_url(server.url) as store:
            entry_id = await store.append("t", b"x")
            entries = await store.read("t")

            # Then appends and reads work, and the store never shows the password
            assert entries == [(entry_id, b"x")]
            assert "s3cret-pw" not in store.url and "***" in store.url


@pytest.mark.parametrize(
    ("password_in_url", "expected"),
    [("wrong-pw", "refused the credentials"), (None, "requires a password")],
    ids=["wrong-password", "no-password"],
)
async def test_bad_credentials_are_a_non_retryable_dependency_error(
    tmp_path: Path, password_in_url: str | None, expected: str
) -> None:
    # Given a password-protected server and a URL with the wrong (or no) password
    with RedisServer(data_dir=tmp_path / "r", password="right-pw") as server:
        auth = f":{password_in_url}@" if password_in_url else ""
        url = f"redis://{auth}127.0.0.1:{server.port}/0"

        # When appending
        async with RedisLogStore.from_url(url) as store:
            with pytest.raises(DependencyError) as caught:
                await store.append("t", b"x")

    # Then the error says what is wrong, is not worth retrying, and leaks no password
    assert expected in str(caught.value)
    assert caught.value.non_retryable is True
    assert "wrong-pw" not in str(caught.value) and "right-pw" not in str(caught.value)


async def test_an_unreachable_redis_names_the_url_without_its_password() -> None:
    # Given a URL to a port nobody listens on, carrying a password
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"

    # When the store is used, with a short outage budget
    async with RedisLogStore.from_url(url, socket_timeout=2.0, outage_s=0.3) as store:
        with pytest.raises(DependencyError) as caught:
            await store.append("t", b"x")

    # Then, the budget spent, a retryable DependencyError names the redacted URL and the budget
    message = str(caught.value)
    assert "unreachable" in message and "outage budget of 0.3s" in message
    assert f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}" in message
    assert "hunter2" not in message and "***" in message
    assert caught.value.non_retryable is False


async def test_requiring_replicas_that_do_not_exist_fails_the_append(redis_url: str) -> None:
    # Given a store that requires one replica to acknowledge, on a server without replicas
    store = RedisLogStore(
        redis.asyncio.Redis.from_url(redis_url),
        url=redis_url,
        min_replicas=1,
        replica_timeout_ms=10,
        owns_client=True,
    )
    async with store:
        # When appending
        # Then the append is reported as not acknowledged
        with pytest.raises(DependencyError, match="0 of 1 replicas"):
            await store.append("t", b"x")


# --------------------------------------------------------------------------- riding out an outage


class BlindRetryStore(RedisLogStore):
    """Control: a store whose every attempt is a new batch (a retry cannot recognise its own write)."""

    async def _append_batch(self, key: str, batch: str, payloads: list[bytes], lookback: int) -> list[str]:
        return await super()._append_batch(key, uuid.uuid4().hex, payloads, lookback)


@pytest.mark.parametrize("store_kind", ["batch-ids", "control-blind-retry"])
async def test_an_append_whose_reply_was_lost_is_not_appended_twice(redis_url: str, store_kind: str) -> None:
    upstream = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    async with ReplyEater(upstream) as proxy:
        kind = RedisLogStore if store_kind == "batch-ids" else BlindRetryStore
        async with kind.from_url(proxy.url, outage_s=30.0) as store:
            # Given a log with one acknowledged entry (the script is loaded on the server)
            first = await store.append("t-lost", b"intent:1")
            # When the next batch reaches Redis and its reply is lost with the connection
            proxy.arm(lambda request: b"EVALSHA" in request.upper())
            ids = await store.append_many("t-lost", [b"intent:2", b"intent:3"])
        # Then the append still answers, once Redis has been asked again ...
        assert proxy.eaten == 1
    async with RedisLogStore.from_url(redis_url) as direct:
        entries = await direct.read("t-lost")
    # ... and the log holds the batch once, under the ids the append returned (control: twice)
    if store_kind == "batch-ids":
        assert entries == [(first, b"intent:1"), (ids[0], b"intent:2"), (ids[1], b"intent:3")]
    else:
        assert [p for _, p in entries] == [b"intent:1", b"intent:2", b"intent:3", b"intent:2", b"intent:3"]


async def test_appends_and_reads_wait_out_a_redis_restart_and_lose_nothing(tmp_path: Path) -> None:
    server = RedisServer(data_dir=tmp_path / "r").start()
    try:
        async with RedisLogStore.from_url(server.url, socket_timeout=2.0, outage_s=60.0) as store:
            # Given acknowledged entries, and then the server crashes (SIGKILL)
            acked = [await store.append("t-out", f"e{i}".encode()) for i in range(3)]
            server.kill()
            # When an append and a read are made while it is down, and it comes back 1 s later
            appending = asyncio.ensure_future(store.append_many("t-out", [b"during-1", b"during-2"]))
            reading = asyncio.ensure_future(store.read("t-out"))
            await asyncio.sleep(1.0)  # the outage itself: what is under test is that both wait it out
            assert not appending.done() and not reading.done()
            await asyncio.to_thread(server.restart)
            during = await asyncio.wait_for(appending, 30)
            seen = await asyncio.wait_for(reading, 30)
            after = await store.read("t-out")
    finally:
        server.stop()
    # Then both finished without an error, every acknowledged entry survived the crash (AOF), and the
    # append made while Redis was down is in the log exactly once
    assert [i for i, _ in seen[:3]] == acked
    assert after == [
        *[(i, f"e{n}".encode()) for n, i in enumerate(acked)],
        (during[0], b"during-1"),
        (during[1], b"during-2"),
    ]


async def test_an_outage_longer_than_the_budget_is_a_clear_dependency_error(tmp_path: Path) -> None:
    server = RedisServer(data_dir=tmp_path / "r").start()
    try:
        async with RedisLogStore.from_url(server.url, socket_timeout=1.0, outage_s=0.5) as store:
            await store.append("t-gone", b"e0")
            # Given the server is down for longer than the store's outage budget
            server.kill()
            # When appending
            with pytest.raises(DependencyError) as caught:
                await store.append("t-gone", b"e1")
    finally:
        server.stop()
    # Then the error says for how long Redis was unreachable and which setting bounds the wait
    message = str(caught.value)
    assert "outage budget of 0.5s" in message and OUTAGE_ENV in message
    assert caught.value.non_retryable is False


@pytest.mark.parametrize(("raw", "expected"), [(None, DEFAULT_OUTAGE_S), ("12.5", 12.5), ("0", 0.0)])
def test_the_outage_budget_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: float
) -> None:
    if raw is None:
        monkeypatch.delenv(OUTAGE_ENV, raising=False)
    else:
        monkeypatch.setenv(OUTAGE_ENV, raw)
    assert outage_budget_from_env() == expected


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_outage_budget_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(OUTAGE_ENV, raw)
    with pytest.raises(InputError, match=OUTAGE_ENV):
        outage_budget_from_env()


# --------------------------------------------------------------------------- the embedded default


@pytest.fixture
def no_redis_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_without_a_url_tether_starts_its_own_redis_and_stops_it(no_redis_env: Path) -> None:
    # Given no TETHER_REDIS_URL
    try:
        # When the URL is resolved (twice)
        url = redis_url_from_env()
        again = redis_url_from_env()

        # Then one server was started under $TETHER_HOME/redis, it answers, and children will see its URL
        assert url == again and os.environ["TETHER_REDIS_URL"] == url
        assert (no_redis_env / "redis" / "embedded.lock").exists()
        client = redis.Redis.from_url(url)
        try:
            assert client.ping() is True
            assert client.config_get("dir")["dir"] == str((no_redis_env / "redis").resolve())
        finally:
            client.close()
        server = embedded._embedded
        assert server is not None
        pid = server.server.pid
    finally:
        stop_embedded()

    # And after stop the process is gone and the URL is no longer exported
    assert pid is not None and _pid_gone(pid)
    assert "TETHER_REDIS_URL" not in os.environ


def test_a_second_embedded_server_over_the_same_data_is_refused(tmp_path: Path) -> None:
    # Given an embedded server running over a data directory
    with EmbeddedRedis(tmp_path / "redis") as url:
        # When another one is started over the same directory
        # Then it is refused with a message naming the running one and the way out
        with pytest.raises(DependencyError) as caught:
            EmbeddedRedis(tmp_path / "redis").start()
        assert url in str(caught.value) and "TETHER_REDIS_URL" in str(caught.value)


def test_a_set_url_is_used_when_it_answers(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    # Given TETHER_REDIS_URL pointing at a live server
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)

    # When resolved
    # Then that URL is used and no server is started
    assert redis_url_from_env() == redis_url
    assert embedded._embedded is None


@pytest.mark.parametrize("url_kind", ["dead-port", "not-redis-scheme"])
def test_a_set_url_that_does_not_answer_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, url_kind: str
) -> None:
    # Given TETHER_REDIS_URL pointing nowhere useful, with a password in it
    port = free_port()
    url = f"redis://:pw123@127.0.0.1:{port}/0" if url_kind == "dead-port" else f"http://:pw123@x:{port}/"
    monkeypatch.setenv("TETHER_REDIS_URL", url)

    # When resolved
    # Then the error names the URL without the password
    with pytest.raises((DependencyError, InputError)) as caught:
        redis_url_from_env()
    assert str(port) in str(caught.value) and "pw123" not in str(caught.value)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); RedisServer.stop() waits for it, so a live pid means running.
    return False
