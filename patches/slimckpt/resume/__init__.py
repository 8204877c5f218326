"""Resume: which step a run goes on from, and its load.

1. `adopt`: which saved step a run resumes, whatever format it is in, and what loading it drops.
2. `tracker_recovery`: a tracker file cut short by a kill; `intact_resume`: resume_mode=auto walks back
   from a damaged newest step to the newest intact one.
3. `step_check` and `pickle_gate`: every rank agrees the step is whole and holds no refused pickle
   before any rank reads it.
4. `load`: the incremental tier's load into the live model, optimizer and extra state.
"""
