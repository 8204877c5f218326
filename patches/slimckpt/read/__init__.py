"""Reading verl checkpoint directories: the listing of a rank's files, the readers of verl's `.pt`
shards (memory-mapped with torch, or indexed without it), and the advisory locks that keep
retention away from a dir being read or written."""
