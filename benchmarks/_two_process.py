"""RAD against TCP between two processes, as peers are: a receiver process holds a
transport (the direct data path) and a plain TCP server; this process sends it, in
rounds, one signed message of ``size`` bytes (answered once decoded) and the same
bytes over TCP (answered once read), in turn each first. On one machine both
processes share its cores, hashing included."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import time
from typing import Any

ACK = b"k"


def _receiver(conn: multiprocessing.connection.Connection, size: int) -> None:
    import uvloop

    uvloop.run(_receive(conn, size))


async def _receive(conn: multiprocessing.connection.Connection, size: int) -> None:
    import torch

    from protocol.net.dhtstart import start_dht
    from protocol.net.transport import Transport
    from protocol.trust.identity import Identity, public_key
    from protocol.wire.gate import Gate
    from protocol.wire.messages import Activations

    async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                got = 0
                while got < size:
                    chunk = await reader.read(1 << 22)
                    if not chunk:
                        return
                    got += len(chunk)
                writer.write(ACK)
        except asyncio.CancelledError:  # the loop ends with the stream open: quietly
            pass
        finally:
            writer.close()

    dht, key = start_dht(), Identity.generate()
    tp = Transport(await dht.replicate_p2p(), key, Gate("bench", 4 << 30))
    server = await asyncio.start_server(tcp, "127.0.0.1", 0)
    try:
        await tp.start()
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        conn.send((tp.peer_id, maddrs, key.public_hex, server.sockets[0].getsockname()[1]))
        sender, sender_key = conn.recv()
        tp.gate.admit(sender, public_key(sender_key))
        conn.send("ready")
        closed = asyncio.get_running_loop().run_in_executor(None, _until_closed, conn)
        while not closed.done():
            inbox = asyncio.ensure_future(tp.inbox.get())
            await asyncio.wait({inbox, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not inbox.done():
                inbox.cancel()
                break
            got = inbox.result()
            got.values()
            await tp.send(sender, Activations("bench", got.message.step, 0, 1), [torch.zeros(1)])  # type: ignore[attr-defined]
    finally:
        server.close()
        await tp.aclose()
        dht.shutdown()


def _until_closed(conn: multiprocessing.connection.Connection) -> None:
    """Returns once the other end of ``conn`` has gone (the benchmark ended or died)."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        return


async def rounds(size: int, count: int) -> tuple[list[float], list[float]]:
    """MB/s of each timed round's RAD and TCP transfers (after one that opens both)."""
    import torch

    from protocol.net.dhtstart import start_dht
    from protocol.net.transport import Transport
    from protocol.trust.identity import Identity, public_key
    from protocol.wire.gate import Gate
    from protocol.wire.messages import Activations

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(theirs, size))  # it ends when the pipe closes
    proc.start()
    rad: list[float] = []
    tcp: list[float] = []
    dht: Any = None
    tp: Transport | None = None
    try:
        peer, maddrs, peer_key, port = await _reply(ours, 120)
        dht, key = start_dht(initial_peers=maddrs), Identity.generate()
        tp = Transport(await dht.replicate_p2p(), key, Gate("bench", 4 << 30))
        tp.gate.admit(peer, public_key(peer_key))
        tp.learn(peer, maddrs)
        await tp.start()
        ours.send((tp.peer_id, key.public_hex))
        await _reply(ours, 60)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        blob, data = torch.ones(size // 4), bytes(size)

        async def one_rad(i: int) -> float:
            start = time.perf_counter()
            assert tp is not None
            await tp.send(peer, Activations("bench", i, 0, 1), [blob])
            await asyncio.wait_for(tp.inbox.get(), 60)
            return time.perf_counter() - start

        async def one_tcp() -> float:
            start = time.perf_counter()
            writer.write(data)
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(len(ACK)), 60)
            return time.perf_counter() - start

        for i in range(count + 1):
            if i % 2:
                r = await one_rad(i)
                t = await one_tcp()
            else:
                t = await one_tcp()
                r = await one_rad(i)
            if i:  # the first opens the streams
                rad.append(size / r / 1e6)
                tcp.append(size / t / 1e6)
        writer.close()
    finally:
        ours.close()
        if tp is not None:
            await tp.aclose()
        if dht is not None:
            dht.shutdown()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rad, tcp


async def _reply(conn: multiprocessing.connection.Connection, timeout: float) -> Any:
    """The next object from ``conn``, waited for off the event loop."""
    got = await asyncio.to_thread(lambda: conn.recv() if conn.poll(timeout) else None)
    if got is None:
        raise TimeoutError(f"the receiver process did not answer within {timeout:.0f} s")
    return got
