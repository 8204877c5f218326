"""Pure planning and records: safetensors layout, the merge's and the resume state's manifests,
the export's writer assignment. No torch, no torch.distributed, no verl; imports nothing of slimckpt
outside this folder. Every stage above reads and writes what these modules describe."""
