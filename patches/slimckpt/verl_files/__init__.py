"""What slimckpt reads of verl without importing it.

1. `version`: which verl is installed, and whether slimckpt was checked against it (the one guard).
2. `leaves`: verl's helper files loaded by path; `in_process_merger`: verl's own merger, the fallback.
The wings below the verl wing use verl through here only.
"""
