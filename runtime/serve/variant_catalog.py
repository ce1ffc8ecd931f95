"""The names a server answers for, and which of its variants have been read.

A server over thousands of variants does not read them all at start-up (issue 23 item 4): it reads
and checks those that the host tier is warmed with, and keeps only a
:class:`~deltazip.runtime.serve.variant_sources.VariantRef` (name, directory, kind; a few hundred
bytes) of every other one. Listing (``/v1/models``, ``/v1/variants``), routing (is this name
served?) and the capacity report work from the names; a variant's manifest is read, checked
against the base and planned when its first request arrives (:meth:`VariantCatalog.first_use`),
exactly as ``POST /v1/variants`` registers one. A variant that fails those checks is refused: one
line in the log, its requests answered with that line, and it is no longer listed.

Every method is safe to call from any thread; the catalog's own lock is held only for dictionary
updates (never while a variant is read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from deltazip.formats.errors import DeltazipError, InputError
from deltazip.runtime.serve.variant_sources import VariantInfo, VariantRef

log = logging.getLogger("deltazip.serve")


class VariantRefused(InputError):
    """A variant found at start-up failed its checks when it was first used (the message is one line)."""


class VariantCatalog:
    """Variants by name: ``read`` (checked and served), ``found`` (not read yet) and ``refused``.

    Args:
        read: the variants read and checked at start-up, in listing order.
        found: the variants found on disk whose manifests are read on first use.
    """

    def __init__(self, read: list[VariantInfo], found: list[VariantRef] = ()):
        self._lock = threading.Lock()
        self.read: dict[str, VariantInfo] = {v.name: v for v in read}
        self.found: dict[str, VariantRef] = {r.name: r for r in found}
        self.refused: dict[str, tuple[VariantRef, str]] = {}
        self._resolving: dict[str, Future] = {}

    # -- reading (any thread) -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.read) + len(self.found)

    def __contains__(self, name: str) -> bool:
        return name in self.read or name in self.found

    def names(self) -> list[str]:
        """Every served variant name: those read first (in the order they were), then the others."""
        with self._lock:
            return list(self.read) + list(self.found)

    def checked(self) -> list[VariantInfo]:
        with self._lock:
            return list(self.read.values())

    def unread(self) -> list[VariantRef]:
        with self._lock:
            return list(self.found.values())

    def get(self, name: str) -> VariantInfo | None:
        return self.read.get(name)

    def refusal(self, name: str) -> str | None:
        """Why ``name`` was refused on first use (None when it was not)."""
        got = self.refused.get(name)
        return None if got is None else got[1]

    # -- changes --------------------------------------------------------------------------------
    def add(self, v: VariantInfo) -> None:
        """A variant registered while serving (its name checked free by the caller)."""
        with self._lock:
            self.refused.pop(v.name, None)
            self.read[v.name] = v

    def admit(self, v: VariantInfo) -> bool:
        """Move a variant read on first use from ``found`` to ``read``; False when it was deleted
        meanwhile (then it must not be served)."""
        with self._lock:
            if self.found.pop(v.name, None) is None:
                return False
            self.read[v.name] = v
            return True

    def remove(self, name: str) -> bool:
        """Forget ``name`` in every state; True when it was there."""
        with self._lock:
            hit = self.read.pop(name, None) is not None
            hit = self.found.pop(name, None) is not None or hit
            return self.refused.pop(name, None) is not None or hit

    def first_use(self, name: str, read: Callable[[VariantRef], None]) -> bool:
        """Read and serve variant ``name`` if it is found but not read yet; True when it is served now.

        ``read(ref)`` reads, checks and commits the variant (it calls :meth:`admit`); concurrent first
        requests for one variant share a single read.

        Raises:
            VariantRefused: the variant failed its checks (now and for every later request), one line.
        """
        with self._lock:
            if name in self.read:
                return True
            if name in self.refused:
                raise VariantRefused(self.refused[name][1])
            ref = self.found.get(name)
            if ref is None:
                return False
            fut, owner = self._resolving.get(name), False
            if fut is None:
                fut, owner = Future(), True
                self._resolving[name] = fut
        if owner:
            self._read_once(ref, fut, read)
        fut.result()
        return name in self.read

    def _read_once(self, ref: VariantRef, fut: Future, read: Callable[[VariantRef], None]) -> None:
        try:
            read(ref)
        except DeltazipError as e:
            line = f"variant {ref.name} cannot be served: {str(e).splitlines()[0]}"
            log.error("%s", line)
            with self._lock:
                if self.found.pop(ref.name, None) is not None:
                    self.refused[ref.name] = (ref, line)
            fut.set_exception(VariantRefused(line))
        except BaseException as e:  # a bug: the variant stays unread, the request gets a 500
            fut.set_exception(e)
        else:
            fut.set_result(None)
        finally:
            with self._lock:
                self._resolving.pop(ref.name, None)
