"""`slimckpt verify <dir>`: is a merge output, an incremental-tier step or a verl-native role dir whole?"""
