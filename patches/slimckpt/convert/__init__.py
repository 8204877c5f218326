"""`slimckpt convert`: a committed step (slimckpt's incremental dcp/ or verl's own rank files, at N
ranks) written as verl 0.9.1's native rank files at M ranks, which unpatched verl resumes.

1. `plan` (pure: what is written where, rows per rank; `layout` the model's shape from its config).
2. `source`: the step opened, memory-mapped (`remote` brings an `s3://` step local first).
3. `rank_file`: one verl rank file, tensor by tensor.
4. `write`: the conversion: every role written at M ranks into `.partial`, renamed, the tracker moved.
5. `cli`: the command's arguments; `command`: its run and one-line errors.
"""
