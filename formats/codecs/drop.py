"""Kind ``drop``: the delta was left out (``--target-ratio``); the tensor is rebuilt as the base's.

The byte allocator (deltazip.compress.allocation) gives every compressed tensor one setting from its
measured error-vs-bytes curve; for a tensor whose delta changes the calibration outputs least per
byte, storing nothing can be the best use of the budget. Unlike ``same`` (bit-identical to the base,
exact), ``drop`` is lossy: the manifest's ``allocation`` records the error it was measured to cost.
Nothing is stored; rebuilding reads the base tensor of the entry's name, and a served variant adds no
delta for it.
"""

from __future__ import annotations

from deltazip.formats.codecs.base import register
from deltazip.formats.codecs.same import SameCodec


class DropCodec(SameCodec):
    """Stored and rebuilt exactly like ``same`` (nothing stored, the base tensor read back); only the kind,
    and so what ``inspect`` and the allocation record say about it, differ."""

    kind = "drop"


register(DropCodec())
