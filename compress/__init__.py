"""ΔCompress: lazy checkpoint access, calibration data, the OBS solver and the layer-wise pipeline."""
