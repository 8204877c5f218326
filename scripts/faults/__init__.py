"""`make faults`: the SIGKILL campaign (`python -m scripts.faults.reliability`, its trial children and oracle), the
corruption, environment-fault and lost-rank campaigns it runs, and RELIABILITY.md's renderer."""
