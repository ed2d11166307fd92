"""A TCP proxy in front of Redis that can lose a reply (not a test module): the request reaches Redis and is
applied, then the connection is cut before Redis's answer reaches the client. Used to show that an append
whose reply was lost is not written twice (``cluster.log_store``: batch ids)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class ReplyEater:
    """Forwards every connection to ``upstream_port``. ``arm(match)``: the next request for which
    ``match(request_bytes)`` is true is forwarded, and its connection is cut when Redis answers it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.eaten = 0
        self.port = 0
        self._match: Callable[[bytes], bool] | None = None
        self._server: asyncio.Server | None = None

    def arm(self, match: Callable[[bytes], bool]) -> None:
        self._match = match

    async def __aenter__(self) -> ReplyEater:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        doomed = asyncio.Event()  # this connection sent the matched request: its next reply is eaten

        async def to_redis() -> None:
            while data := await client_r.read(65536):
                if self._match is not None and self._match(data):
                    self._match = None
                    doomed.set()
                up_w.write(data)
                await up_w.drain()

        async def to_client() -> None:
            while data := await up_r.read(65536):
                if doomed.is_set():
                    self.eaten += 1
                    return  # Redis answered; the client never hears it
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(to_redis()), asyncio.ensure_future(to_client())]
        with contextlib.suppress(ConnectionError):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, up_w):
            writer.close()
