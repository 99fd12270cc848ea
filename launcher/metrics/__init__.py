"""Metrics: the meter (figures per step), the console view, the file/wandb sinks, and the end of a run
for people (the summary table, the loss curve).

May import: the leaves, compat, config, layout, ops (the loss's per-token record), data. Never the model
or parallel/ (the runner and the MoE layers' loads come as values) or anything above them.
"""
