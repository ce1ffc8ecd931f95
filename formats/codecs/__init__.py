"""One codec per manifest kind, found through one registry (see ``base`` for the contract).

Kinds: ``packed`` (a compressed linear delta), ``rows`` (an embedding delta row by row), ``xor``,
``dense_delta``, ``full``, ``same``, ``alias`` (exact or stored-nothing forms of the other tensors),
and the variant kind ``lora`` (a PEFT adapter's factors). Every module of this package is imported
on the registry's first use and registers its codec, so a new kind is one module here (plus its
reference function and one test file); ``verify``, ``merge``, ``inspect`` and ``serve`` pick it up.
"""

from deltazip.formats.codecs.base import Codec, Entry, MatrixCodec, codec_file, entries, get, kinds, register

__all__ = ["Codec", "Entry", "MatrixCodec", "codec_file", "entries", "get", "kinds", "register"]
