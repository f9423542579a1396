"""A TCP forwarder in front of the S3 server, so a test can take "the S3 server" away mid-upload and bring it
back with its state (moto keeps objects in memory only: killing moto itself would lose the bucket).

    python tcp_proxy.py LISTEN_PORT TARGET_PORT [PATTERN N]

With PATTERN and N, the process dies at once (every connection dropped, the port closed) when the client side of
the traffic has carried PATTERN the N-th time: e.g. the second PUT of an artifact's files."""
import asyncio
import os
import sys


async def main(listen: int, target: int, pattern: bytes, after: int) -> None:
    seen = 0

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, watch: bool) -> None:
        nonlocal seen
        try:
            while data := await reader.read(65536):
                if watch and pattern:
                    seen += data.count(pattern)
                    if seen >= after:
                        os._exit(0)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(client_r, server_w, True), pipe(server_r, client_w, False))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(int(args[0]), int(args[1]), args[2].encode() if len(args) > 2 else b"",
                     int(args[3]) if len(args) > 3 else 0))
