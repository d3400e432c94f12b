"""The kernel-moved tunnel (``_splice.relay_pair``): every byte both ways, what the
readers had buffered first, a half-close carried over, a reset ending both sides."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct

import pytest

from proctor.broker._proxy import _relay
from proctor.broker._splice import relay_pair


async def _through_relay(payload: bytes, early: bytes) -> tuple[bytes, tuple[int, int], bool]:
    aborted = []

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while d := await r.read(1 << 16):
            w.write(d)
            await w.drain()
        w.close()

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    counts: list[tuple[int, int]] = []

    async def front(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        # Read a line first, as the proxy reads a CONNECT head: bytes after it are
        # in the reader's buffer and must go first.
        await r.readline()
        ur, uw = await asyncio.open_connection("127.0.0.1", port)

        def abort() -> None:
            aborted.append(True)
            uw.transport.abort()
            w.transport.abort()

        counts.append(await relay_pair(r, w, ur, uw, abort, _relay))
        w.close()

    front_server = await asyncio.start_server(front, "127.0.0.1", 0)
    r, w = await asyncio.open_connection("127.0.0.1", front_server.sockets[0].getsockname()[1])
    w.write(b"CONNECT x\n" + early)
    got = bytearray()

    async def read_all() -> None:
        while d := await r.read(1 << 16):
            got.extend(d)

    reading = asyncio.create_task(read_all())
    w.write(payload)
    await w.drain()
    w.write_eof()
    await asyncio.wait_for(reading, 30)
    w.close()
    for s in (upstream, front_server):
        s.close()
    await asyncio.sleep(0.05)
    return bytes(got), counts[0], bool(aborted)


@pytest.mark.parametrize("size", [0, 1, 3 << 20])
def test_every_byte_both_ways_buffered_bytes_first(size: int) -> None:
    payload = os.urandom(size)
    early = b"early bytes in the reader's buffer"
    got, (up, down), aborted = asyncio.run(_through_relay(payload, early))
    assert hashlib.sha256(got).digest() == hashlib.sha256(early + payload).digest()
    assert (up, down) == (len(early) + size, len(early) + size)
    assert not aborted


def test_a_reset_upstream_ends_both_sides() -> None:
    async def main() -> tuple[bool, bytes]:
        aborted: list[bool] = []

        async def reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read(10)
            # A reset, not a close: linger 0 sends RST whatever was read.
            w.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            w.transport.abort()

        upstream = await asyncio.start_server(reset, "127.0.0.1", 0)
        port = upstream.sockets[0].getsockname()[1]
        done = asyncio.get_running_loop().create_future()

        async def front(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            ur, uw = await asyncio.open_connection("127.0.0.1", port)

            def abort() -> None:
                aborted.append(True)
                uw.transport.abort()
                w.transport.abort()

            done.set_result(await relay_pair(r, w, ur, uw, abort, _relay))

        front_server = await asyncio.start_server(front, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", front_server.sockets[0].getsockname()[1])
        got = b""
        try:
            # A little, then silence: the guest neither sends more nor closes, so
            # only the relay's own stop can end the direction that reads from it.
            w.write(os.urandom(100))
            await w.drain()
            got = await asyncio.wait_for(r.read(), 10)
        except (ConnectionError, OSError):
            pass
        await asyncio.wait_for(done, 10)
        w.close()
        for s in (upstream, front_server):
            s.close()
        return bool(aborted), got

    aborted, got = asyncio.run(main())
    assert aborted and got == b""
