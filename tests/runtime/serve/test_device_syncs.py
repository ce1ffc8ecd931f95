"""No device-wide synchronisation where a server's threads run: the engine captures decode graphs on one
thread while the kernel tuner (launch configs, grouped LoRA paths) and the loader use the device on
others, and synchronising the device (``torch.cuda.synchronize``) while any stream captures is invalid in
CUDA: it breaks the engine's capture. Each thread synchronises its own stream or event instead.

A static check (the race needs a GPU and a capture at the wrong moment): the package's modules may call it
only where no capture can be underway."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# module -> why a device-wide synchronisation is safe there
ALLOWED = {
    "runtime/share/weight_share.py": "fills the shared base weights before any server thread starts",
}


def test_no_device_wide_synchronisation_on_a_servers_threads():
    found = {}
    for top in ("runtime", "kernels", "formats", "models", "compress", "deltacli"):
        for f in sorted((ROOT / top).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            hits = [i + 1 for i, ln in enumerate(f.read_text().splitlines())
                    if re.search(r"torch\.cuda\.synchronize\(|cuda\.device_synchronize|cudaDeviceSynchronize", ln)]
            if hits:
                found[rel] = hits
    assert set(found) <= set(ALLOWED), {k: v for k, v in found.items() if k not in ALLOWED}
    assert set(ALLOWED) <= set(found)  # an entry without its call goes too
