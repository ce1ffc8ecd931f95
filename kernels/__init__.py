"""The math of a compressed delta: pure-torch reference functions (fast paths live beside them)."""
