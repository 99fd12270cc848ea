"""Training: the worker body (loop.py) and the optimizer and schedule (optim.py)."""
