"""Data: token sources (corpus.py) and the deterministic DP-sharded loader (loader.py)."""

from launcher.data.corpus import Splits, load_splits
from launcher.data.loader import BatchLoader

__all__ = ["BatchLoader", "Splits", "load_splits"]
