"""Where ``omni-jax serve`` listens: its address taken before the pipeline is built.

The socket is bound first (a port in use is refused at once, before minutes of loading) and
handed to uvicorn, which starts listening once the app's start-up has begun the warm-up; uvicorn
logs no address for a socket it is given, so :class:`ListeningServer` says where it listens.
"""

from __future__ import annotations

import logging
import socket

import uvicorn

log = logging.getLogger("omni_jax.serve")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet: uvicorn starts that). ``OSError``
    naming the address when it cannot be had (in use, not this machine's, no permission)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"--host {host} --port {port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses it
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


class ListeningServer(uvicorn.Server):
    """uvicorn's server, which logs ``listening on http://HOST:PORT`` once its sockets accept
    connections."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:  # the app's start-up failed: nothing listens
            return
        for sock in sockets or ():
            host, port = sock.getsockname()[:2]
            log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
