"""launcher/launch/quick_exit.py: the heap is frozen after every exit handler registered later has run."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, gc
from launcher.launch.quick_exit import skip_final_collections
atexit.register(lambda: print("first registered", gc.get_freeze_count() > 0))
skip_final_collections()
skip_final_collections()
atexit.register(lambda: print("last registered", gc.get_freeze_count() > 0))
"""


def test_the_heap_is_frozen_after_later_handlers_and_before_the_final_collections() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    # last-registered first: the later handler sees a live heap, the freeze, then the earlier one a frozen heap
    assert out.splitlines() == ["last registered False", "first registered True"], out
