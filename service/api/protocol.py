"""uvicorn's HTTP protocol with a deadline for receiving each request (408 past it).

Hand-written because uvicorn has none: `timeout_keep_alive` restarts on every byte and ASGI
middleware runs only after the headers, so a client trickling them would hold a connection
forever (slowloris). The deadline runs from a request's first byte to the end of its body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("r4t.protocol")
_BODY = json.dumps({"error": {"type": "RequestTimeout",
                              "message": "request not received in time"}}).encode()
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                   b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class ReceiveDeadlineProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose requests must arrive whole within `receive_timeout_s`."""

    receive_timeout_s = 10.0
    on_timeout: Callable[[], None] | None = None
    _receive_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is closed too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._receive_timer is None:  # a later request on a kept-alive connection
            self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._receive_timer = self.loop.call_later(self.receive_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._receive_timer is not None:
            self._receive_timer.cancel()
            self._receive_timer = None

    def _expired(self) -> None:
        self._receive_timer = None
        if self.transport.is_closing():
            return
        log.warning("closing a connection whose request did not arrive within %.1f s",
                    self.receive_timeout_s)
        cycle = self.cycle  # on a kept-alive connection, the last request's until headers end
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()
        if self.on_timeout is not None:
            self.on_timeout()


def receive_deadline_protocol(
    timeout_s: float, on_timeout: Callable[[], None] | None = None
) -> type[ReceiveDeadlineProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), with its deadline set."""
    return type("ReceiveDeadline", (ReceiveDeadlineProtocol,),
                {"receive_timeout_s": timeout_s, "on_timeout": staticmethod(on_timeout)
                 if on_timeout else None})
