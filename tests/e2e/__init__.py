"""End to end: verl's trainer runs (tests/helpers/verl_runs.py), the launchers, and the bench/fault/compare scripts run as users run them."""
