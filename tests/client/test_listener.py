"""The attention client's API listener (``bind_listener``) with real sockets: the connections the
asyncio server accepts on it have Nagle off (``TCP_NODELAY``), so streamed tokens leave at once."""

from __future__ import annotations

import asyncio
import socket

import pytest

from eaas.runtime.client.main import bind_listener

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("reuse_port", [False, True])
def test_accepted_connections_have_nagle_off(reuse_port):
    """asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP (accepted sockets
    inherit the listener's). The listener was made with proto 0: Nagle stayed on, and on a
    kept-alive streaming connection every SSE chunk after the headers waited for the client's
    delayed ACK (~40 ms added to the time to first token of every request but a connection's
    first)."""
    sock = bind_listener("127.0.0.1", 0, reuse_port=reuse_port)
    assert sock.proto == socket.IPPROTO_TCP

    async def accepted_nodelay() -> int:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):  # type: ignore[override]
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Probe, sock=sock)
        client = socket.create_connection(sock.getsockname()[:2], timeout=60)
        try:
            return await asyncio.wait_for(got, 60)
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) == 1
