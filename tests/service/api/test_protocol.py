"""Limits the HTTP server keeps: the request-receipt deadline (slow headers, slow bodies, silent
connections get a 408 and are closed) and the cap on open connections. Every wait is on the
socket itself (the server's answer or its close), bounded by WAIT_S."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.service.live import WAIT_S, live_server, wait_until
from tests.service.scrape import metric

RECEIVE_TIMEOUT_S = 0.5


@contextmanager
def raw_connection(url: str) -> Iterator[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    try:
        yield sock
    finally:
        sock.close()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def test_requests_that_do_not_arrive_in_time_get_408_and_are_closed(settings_for):
    settings = settings_for(receive_timeout_s=RECEIVE_TIMEOUT_S)
    partial_headers = b"POST /v1/retrieve HTTP/1.1\r\nhost: r4t\r\ncontent-type: applic"
    partial_body = (b"POST /v1/retrieve HTTP/1.1\r\nhost: r4t\r\ncontent-type: application/json"
                    b"\r\ncontent-length: 200\r\n\r\n{\"query\": \"bo")
    with live_server(settings) as live:
        for sent in (b"", partial_headers, partial_body):  # silent, slow headers, slow body
            with raw_connection(live.url) as sock:
                sock.sendall(sent)
                answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408 "), (sent, answer)
            assert b"RequestTimeout" in answer
        with live.client() as client:  # whole requests are not affected
            response = client.post("/v1/retrieve", json={"query": "boat", "route": "single"})
            assert response.status_code == 200
        assert metric(live.url, "r4t_rejected_requests_total", reason="ReceiveTimeout") == 3
        assert metric(live.url, "r4t_in_flight") == 0


def test_a_kept_alive_connection_gets_a_fresh_deadline_per_request(settings_for):
    settings = settings_for(receive_timeout_s=RECEIVE_TIMEOUT_S)
    with live_server(settings) as live, live.client() as client:
        for _ in range(3):  # one connection, each request sent whole: never timed out
            assert client.get("/healthz").status_code == 200
        assert metric(live.url, "r4t_rejected_requests_total", reason="ReceiveTimeout") == 0


def test_connections_beyond_the_cap_are_refused_with_503(settings_for):
    settings = settings_for(max_connections=3)
    with live_server(settings) as live:
        with raw_connection(live.url), raw_connection(live.url):
            response = httpx.get(f"{live.url}/healthz", timeout=WAIT_S)  # the third one
            assert response.status_code == 503
        # the two idle connections closed: served again once the server has seen them go
        wait_until(lambda: httpx.get(f"{live.url}/healthz", timeout=WAIT_S).status_code == 200,
                   "served again under the cap")
