"""The deltazip artifact: manifest, safetensors containers, bit packing, checksums, lossless GDeflate
stage (chunked containers; nvCOMP CPU/GPU backends) and verification."""
