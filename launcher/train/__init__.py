"""Training: the worker body (loop.py) and the optimizer and schedule (optim.py).

May import every runtime room (model, parallel, data, metrics and what they stand on). Never hardware/,
the planner (the prediction comes as a value: config/prediction.py) or the launchers (what
they tell a replica group's worker: config/ft.py).
"""
