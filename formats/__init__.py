"""The deltazip artifact: manifest, safetensors containers, bit packing, checksums."""
