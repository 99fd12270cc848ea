"""Metrics: the meter (figures per step), the console view, the file/wandb sinks, and the end of a run
for people (the summary table, the loss curve)."""
