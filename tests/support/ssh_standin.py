"""A stand-in for a hypervisor's sshd (this machine has no ``sshd``), run inside the host's
network namespace: an asyncssh server that admits one client key and connects every session
channel to that host's libvirtd socket, whatever command the client asks for — what an sshd
with ``ForceCommand virt-ssh-helper`` does. No shell, no command is ever run.

    python -m tests.support.ssh_standin ADDR PORT HOST_KEY AUTHORIZED_KEYS LIBVIRT_SOCK

prints ``ready`` on stdout once it listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import asyncssh


def _session_to(sock: str):  # type: ignore[no-untyped-def]
    async def handle(process: asyncssh.SSHServerProcess[bytes]) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock)
        except OSError as e:
            process.stderr.write(f"libvirtd socket: {e}\n".encode())
            process.exit(1)
            return

        async def up() -> None:
            while data := await process.stdin.read(65536):
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        async def down() -> None:
            while data := await reader.read(65536):
                process.stdout.write(data)
                await process.stdout.drain()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        writer.close()
        process.exit(0)

    return handle


async def main(addr: str, port: int, host_key: str, authorized: str, sock: str) -> None:
    await asyncssh.create_server(
        None,
        addr,
        port,
        server_host_keys=[host_key],
        authorized_client_keys=authorized,
        process_factory=_session_to(sock),
        encoding=None,
        allow_pty=False,
        x11_forwarding=False,
        agent_forwarding=False,
        line_editor=False,
    )
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], int(a[1]), a[2], a[3], a[4]))
