"""`train -m hydra/sweeper=layouts sweep.top=N`: run the planner's best N layouts (see layout_sweeper.py)."""
