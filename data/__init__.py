"""Training data. For now: byte-level windows over the Python standard library's own source."""
