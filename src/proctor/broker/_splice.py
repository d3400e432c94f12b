"""A tunnel's bytes moved by the kernel: ``splice(2)`` through a pipe, socket to
socket, for tunnels whose bytes the broker does not look at (a CONNECT tunnel, a
redirected connection once its name is checked).

Copying through Python costs two copies and an object per read; splice moves
pages between the sockets' buffers and a pipe without them reaching user space.
Both connections come from asyncio streams: their transports stop reading
(``pause_reading``), whatever their readers had already buffered is sent first,
and the event loop's readiness callbacks drive non-blocking splices. When both
directions end, the transports are handed back to be closed as before.

Where splice is unavailable (no ``os.splice``, or a transport without a socket,
such as TLS), :func:`relay_pair` copies through the streams as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable
from typing import Any, Final

#: How much one splice moves at most (also the pipe's size, where it may be set).
CHUNK: Final = 1 << 20
_F_SETPIPE_SZ: Final = 1031
_SPLICE = getattr(os, "splice", None)
_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


def _socket_of(writer: asyncio.StreamWriter) -> socket.socket | None:
    if writer.get_extra_info("sslcontext") is not None:
        return None  # the bytes on the socket are TLS records, not the stream's
    sock = writer.get_extra_info("socket")
    return sock if sock is not None else None


def _buffered(reader: asyncio.StreamReader) -> bytes:
    """What ``reader`` read from its socket and nobody has taken yet (it goes first).
    asyncio has no public way to ask; the buffer is the stream's documented state."""
    buffer: bytearray = getattr(reader, "_buffer", bytearray())
    data = bytes(buffer)
    buffer.clear()
    return data


async def relay_pair(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
    abort: Callable[[], None],
    copy: Callable[..., Any],
) -> tuple[int, int]:
    """Relay a->b and b->a until both end; (bytes a->b, bytes b->a). ``copy`` is the
    stream copier used where splice cannot be (``copy(reader, writer, abort)``)."""
    a_sock, b_sock = _socket_of(a_writer), _socket_of(b_writer)
    if _SPLICE is None or a_sock is None or b_sock is None:
        up, down = await asyncio.gather(copy(a_reader, b_writer, abort),
                                        copy(b_reader, a_writer, abort))  # fmt: skip
        return int(up), int(down)
    a_writer.transport.pause_reading()  # type: ignore[attr-defined]
    b_writer.transport.pause_reading()  # type: ignore[attr-defined]
    first_up, first_down = _buffered(a_reader), _buffered(b_reader)
    # Duplicates: the event loop watches no descriptor a transport owns, and these
    # are closed here while the transports' own stay theirs to close.
    a_dup = socket.socket(fileno=os.dup(a_sock.fileno()))
    try:
        b_dup = socket.socket(fileno=os.dup(b_sock.fileno()))
    except BaseException:
        a_dup.detach()
        raise

    def stop() -> None:
        # The duplicates hold the sockets open past the transports' abort: shut
        # them down too, or the other direction would wait on a peer that never
        # sends again.
        for dup in (a_dup, b_dup):
            with contextlib.suppress(OSError):
                dup.shutdown(socket.SHUT_RDWR)
        abort()

    try:
        up, down = await asyncio.gather(
            _one_way(a_dup, b_dup, first_up, stop), _one_way(b_dup, a_dup, first_down, stop)
        )
    finally:
        a_dup.close()
        b_dup.close()
    return up, down


async def _one_way(
    src_sock: socket.socket, dst_sock: socket.socket, first: bytes, abort: Callable[[], None]
) -> int:
    src, dst = src_sock.fileno(), dst_sock.fileno()
    total = 0
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, _F_SETPIPE_SZ, CHUNK)
        if first:
            await _send_all(dst, first)
            total += len(first)
        while True:
            try:
                n = _SPLICE(src, w, CHUNK, flags=_FLAGS)  # type: ignore[misc]
            except BlockingIOError:
                await wait_ready(src, readable=True)
                continue
            if n == 0:
                break
            left = n
            while left:
                try:
                    left -= _SPLICE(r, dst, left, flags=_FLAGS)  # type: ignore[misc]
                except BlockingIOError:
                    await wait_ready(dst, readable=False)
            total += n
        with contextlib.suppress(OSError):
            dst_sock.shutdown(socket.SHUT_WR)
    except (ConnectionError, OSError):
        # One side failed: end the other too, or its splice would wait forever.
        abort()
    finally:
        os.close(r)
        os.close(w)
    return total


async def _send_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await wait_ready(fd, readable=False)


async def wait_ready(fd: int, *, readable: bool) -> None:
    """Until ``fd`` (one no transport of the loop owns) is readable, or writable."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    if readable:
        loop.add_reader(fd, wake)
    else:
        loop.add_writer(fd, wake)
    try:
        await done
    finally:
        if readable:
            loop.remove_reader(fd)
        else:
            loop.remove_writer(fd)
