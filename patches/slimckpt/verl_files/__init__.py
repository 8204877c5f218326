"""What slimckpt reads of verl without importing it: the installed version, and verl's helper files
loaded by path (`leaves`). The wings below the verl wing use verl through here only."""
