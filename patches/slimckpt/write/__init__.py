"""Writing planned bytes: output files created at their final size, positional and O_DIRECT writes,
dtype casts (torch and numpy), the merge's forked torch-free writer, and DCP's hashing filesystem."""
