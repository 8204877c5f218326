"""Retention: which saved steps are kept, and when the rest go.

1. `earlier_steps`: steps an earlier launch of the run left join this launch's list (first commit).
2. `best_metric`: the metric keep_best ranks steps by, recorded next to each step.
3. `prune`: after a commit, old steps are deleted (never the tracker's, never a locked one), by
   layout.retention_plan's decision.
4. `optimizer_drop`: an old step keeps its model and loses its optimizer state (keep_optimizer_last).
"""
