"""The engine: bytes in and bytes out of checkpoint files, with bounded memory, over the Storage seam.

1. Find what a directory holds: `checkpoint_dir` (verl's rank files), `dcp_step` (an incremental step),
   `merge_input` (which reader a merge gets), `remote_step` (a step on an object store, brought local).
2. Read it: `pt_index` (where every tensor's bytes sit in a `.pt`, no torch), `pt_tensors` (tensors over
   those offsets), `verl_sources` / `dcp_source` (a role's tensors, memory-mapped), unpickling only what
   `pickle_policy` allows (`safe_load`, `dcp_pickle`, `step_pickles`).
3. Write it: `out_files` (**the** range writer: files at their final size, bytes at their offsets; the
   merge, the in-training export and convert all write through it) and `share_writer` (the merge's
   shares as positional writes, cast in bounded chunks; `race_points`, `writer_stats`); DCP's shards through
   `dcp_file_writer` with checksums computed as they are written (`hashing_fs`).
4. Close it: `manifest_put` (**the** put of every manifest, never over a committed one), `output_dir`
   (an output dir's life: partial, manifest, rename), `resume_records` (a step's records, each whole or absent), `upload` (a finished local dir put on a medium without renames).
"""
