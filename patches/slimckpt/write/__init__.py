"""Writing planned bytes: output files created at their final size, positional writes,
dtype casts, the merge's writer and its timings, and DCP's hashing filesystem."""
