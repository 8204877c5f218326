"""slimckpt: bounded-memory, crash-safe FSDP checkpointing for verl.

Importing this package is cheap and changes nothing in verl. verl's plugin loader imports
`slimckpt.verl.plugin`, which applies the patches listed in `slimckpt.verl.patch_list`.
"""

__version__ = "0.1.0"

# The verl releases whose internals every patch in `slimckpt.verl.patch_list` was written against.
SUPPORTED_VERL = "==0.9.1"


class SlimckptError(Exception):
    """The root of every exception class slimckpt defines: `except SlimckptError` catches any of them.
    Each also keeps the builtin type its callers and verl catch it by (`class LayoutError(SlimckptError,
    ValueError)`: an `except ValueError` still takes it); str() is the one-line message."""
