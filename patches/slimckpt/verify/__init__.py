"""`slimckpt verify <dir>`: is a merge output, an incremental-tier step or a verl-native role dir whole?

1. `command` reads the dir's manifest (layout) and re-checks every file's size and checksum;
2. `native` checks what a verl-native role dir allows without a manifest (files, headers, pickles);
3. `cli`: the command's arguments.
"""
