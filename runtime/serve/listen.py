"""The server's listening socket, bound before anything heavy happens.

``deltazip serve`` binds (and listens on) its port first: a port already in use is one line within
a second, not a traceback after every model has loaded. The bound socket is then handed to uvicorn,
so nothing can take the port in between; connections that arrive while the models load wait in
the backlog.
"""

from __future__ import annotations

import errno
import socket

from deltazip.formats.errors import InputError


def bind_listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening (port 0: any free port).

    Raises:
        InputError: bad port or host, the port is taken, or binding it is not allowed.
    """
    if not 0 <= port <= 65535:
        raise InputError(f"--port {port} is not a TCP port (0..65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InputError(f"--host {host!r} cannot be resolved ({e.strerror}); pass an address such as 127.0.0.1 "
                         f"or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InputError(f"port {port} on {host} is already in use; stop the server that holds it or pass "
                             f"another --port") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise InputError(f"binding port {port} on {host} is not allowed (ports below 1024 need privileges); "
                             f"pass --port 1024 or above") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise InputError(f"--host {host} is not an address of this machine; pass 127.0.0.1 or 0.0.0.0") from None
        raise
    return sock
