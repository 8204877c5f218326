"""`slimckpt convert`: a committed step (slimckpt's incremental dcp/ or verl's own rank files, at N
ranks) written as verl 0.9.1's native rank files at M ranks, which unpatched verl resumes.

plan (pure: what is written where, rows per rank) -> source (the step opened, memory-mapped) ->
rank_file (one verl rank file, tensor by tensor) -> command (the CLI: .partial, rename, tracker).
"""
