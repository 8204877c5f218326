"""Stress runs that repeat one operation many times under shaken timing and a loaded CPU (`make stress-merge`,
`make stress-flaky`)."""
