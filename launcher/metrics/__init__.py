"""Metrics: the meter (figures per step), the console view, and the file/wandb sinks."""
