"""Helpers the tests share: checkpoints to merge and verl's merger (merge_helpers), slimckpt's log lines (slim_logs), the background verl trainer runs (verl_runs)."""
