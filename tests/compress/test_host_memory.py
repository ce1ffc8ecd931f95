"""compress/host_memory.py: after a layer, the C heap's free holes go back to the system."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import re
from deltazip.compress.host_memory import release_freed_memory

def anon_kib():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1))

chunks = [bytearray(100_000) for _ in range(4000)]  # 400 MB of heap chunks (under the mmap threshold)
del chunks[::2]  # every other one freed: holes between live chunks, which glibc keeps resident
before = anon_kib()
released = release_freed_memory()
print(released, before, anon_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim (Linux)")
def test_freed_holes_of_the_heap_leave_resident_memory():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout.split()
    released, before, after = out[0] == "True", int(out[1]), int(out[2])
    assert released
    assert before - after > 150 * 1024, (before, after)  # most of the 200 MB of holes (KiB) left
