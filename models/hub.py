"""Hub ids without a network: found out once, up front, and said in one line.

``datasets`` and ``huggingface_hub`` retry an unreachable hub for most of half a minute and log a line
per try. Before any of them is asked for a hub id, :func:`require_hub` opens one TCP connection to the
hub's endpoint (or the HTTPS proxy) with a short timeout, once per process; when that fails, or when
``HF_HUB_OFFLINE=1`` says not to try, the caller gets one line naming the id, the cause, and the fix
(local files, or ``HF_HUB_OFFLINE=1`` to use only the Hugging Face cache).
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from deltazip.formats.errors import InputError

PROBE_TIMEOUT_S = 3.0
_probe: dict[str, str | None] = {}  # endpoint -> None (reachable) or why not; one probe per process


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE``) asks for the local cache only."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _target() -> tuple[str, int, str]:
    """``(host, port, endpoint)`` that a hub request would connect to first (the proxy when one is set)."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or os.environ.get("ALL_PROXY")
    url = urlsplit(proxy or endpoint)
    port = url.port or (443 if url.scheme in ("https", "") else 80)
    return url.hostname or "", port, endpoint


def _connect(host: str, port: int, result: list) -> None:
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        result.append(None)
    except OSError as e:
        result.append(e.strerror or type(e).__name__)


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (``None`` when a connection opens); probed once per process. Name
    resolution runs in a thread so that a hanging resolver costs at most the timeout too."""
    host, port, endpoint = _target()
    if endpoint not in _probe:
        result: list = []
        t = threading.Thread(target=_connect, args=(host, port, result), daemon=True)
        t.start()
        t.join(PROBE_TIMEOUT_S + 0.5)
        why = result[0] if result else f"no answer in {PROBE_TIMEOUT_S:.0f} s"
        _probe[endpoint] = None if why is None else f"{host}:{port}: {why}"
    return _probe[endpoint]


def require_hub(what: str, local_hint: str) -> None:
    """Fail at once, in one line, when ``what`` (e.g. ``calibration data 'org/name'``) would need the hub
    and the hub cannot be reached. With ``HF_HUB_OFFLINE=1`` nothing is probed (the cache is used).

    Args:
        local_hint: what to pass instead, e.g. ``"a local .jsonl/.json/.txt/.parquet file"``.
    Raises:
        InputError
    """
    if hub_offline():
        return
    why = hub_unreachable()
    if why is not None:
        raise InputError(f"{what} is a hub id, but the Hugging Face hub cannot be reached ({why}); pass "
                         f"{local_hint}, or set HF_HUB_OFFLINE=1 to use only what the local Hugging Face "
                         "cache holds")


def offline_miss(what: str, local_hint: str) -> InputError:
    """The one-line error for a hub id that ``HF_HUB_OFFLINE=1`` could not find in the local cache."""
    return InputError(f"{what} is a hub id that is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
                      f"forbids downloading it; pass {local_hint} (or unset HF_HUB_OFFLINE where the hub "
                      "is reachable)")
