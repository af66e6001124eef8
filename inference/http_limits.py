"""How much one connection or request may hold: a body read with a cap, and connections that must
send a whole request head within a time limit.

- `read_body`: a request's body, refused (`BodyTooLarge`, answered 413) as soon as its declared
  Content-Length or the bytes received so far pass the limit, so the process never holds more than
  the limit plus one chunk of it; a body that does not arrive within the read timeout is refused
  too (`asyncio.TimeoutError`, answered 408).
- `HeaderTimeoutH11`: uvicorn's h11 protocol with its keep-alive timer armed from the moment a
  connection opens, and cleared only by a complete request head. uvicorn arms that timer only
  after a response and clears it on any byte, so a connection that never sends a request, or
  trickles one a byte at a time, would hold its socket forever.
- `uvicorn_options`: the options `serve` and `ThreadedServer` give uvicorn.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is over {limit:,} bytes; send less (the server's --max-body-bytes)")
        self.limit = limit


async def read_body(request, limit: int, timeout: float) -> bytes:
    """The body of a Starlette `request`, at most `limit` bytes, within `timeout` seconds."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    return await asyncio.wait_for(read(), timeout)


class HeaderTimeoutH11(H11Protocol):
    """A connection is closed when a whole request head has not arrived within uvicorn's
    `timeout_keep_alive` seconds of its opening (or of its previous response)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        # Not super's: it clears the timer on any byte. handle_events clears it on a whole request head.
        self.conn.receive_data(data)
        self.handle_events()


def uvicorn_options(read_timeout: float) -> dict:
    """uvicorn.Config keywords: the h11 protocol above (named, so an installed httptools does not
    replace it) with `read_timeout` seconds for a request head to arrive."""
    return {"http": HeaderTimeoutH11, "timeout_keep_alive": read_timeout}
