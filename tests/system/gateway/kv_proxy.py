"""A TCP proxy in front of one worker that spoils its first KV copy stream, for the fault tests.

The worker advertises the proxy's address (`--advertise-url`), so gateways and draining workers
reach it through the proxy; every connection is forwarded byte for byte, both ways, except the
first one to `/v1/kv` (shared/protocol/kv_copy.py), whose sender's bytes are, by `mode`:
- `corrupt`: forwarded with one byte flipped, `CORRUPT_AT` bytes in (inside the first session's
  pages, past its header frame): the target's CRC-32 check fails, as after a bit flip on the wire;
- `stall`: forwarded up to `STALL_AT` bytes, then held (`stalled` is set): the copy is in the
  middle of its pages, where a test then kills the target.
Real sockets and the real streams: the WebSocket frames pass unparsed (a client's frames are masked,
and a flipped masked byte is a flipped payload byte).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Final, Literal

from shared.protocol.kv_copy import KV_COPY_PATH

CORRUPT_AT: Final = 40_000
STALL_AT: Final = 100_000
HEAD_END: Final = b"\r\n\r\n"


class KVProxy:
    def __init__(self, target_port: int, mode: Literal["corrupt", "stall"]) -> None:
        self.target_port = target_port
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.spoiled = threading.Event()  # the first KV stream was corrupted, or is held (`stall`)
        self._taken = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kv-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self.listener))
        self._loop.run_forever()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        head = await client_reader.readuntil(HEAD_END)
        spoil = not self._taken and head.startswith(f"GET {KV_COPY_PATH} ".encode())
        self._taken = self._taken or spoil
        writer.write(head)
        await asyncio.gather(
            self._pipe(client_reader, writer, spoil=spoil),
            self._pipe(reader, client_writer, spoil=False),
            return_exceptions=True,
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, spoil: bool) -> None:
        sent = 0
        try:
            while data := await reader.read(65536):
                if spoil and self.mode == "corrupt" and sent <= CORRUPT_AT < sent + len(data):
                    flipped = bytearray(data)
                    flipped[CORRUPT_AT - sent] ^= 0xFF
                    data = bytes(flipped)
                    self.spoiled.set()
                if spoil and self.mode == "stall" and sent + len(data) >= STALL_AT:
                    writer.write(data[: STALL_AT - sent])
                    await writer.drain()
                    self.spoiled.set()
                    await asyncio.Event().wait()  # held until the target dies and the test ends
                writer.write(data)
                await writer.drain()
                sent += len(data)
        finally:
            writer.close()
