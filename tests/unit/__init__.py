"""Tests of one piece at a time, mostly in this process: the planner's models, the rules, the config, the
model and its kernels, a layout against one process in-process (tests/conftest.py: the shared fixtures)."""
