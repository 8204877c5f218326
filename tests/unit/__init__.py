"""In-process tests: one interpreter, no torchrun, no trainer run (some still start a fresh interpreter or a CLI)."""
