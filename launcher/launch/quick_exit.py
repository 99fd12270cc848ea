"""A process of the launcher ends without the interpreter's final garbage collections.

Those collections walk torch's whole heap: 0.6-1 s of CPU in every process that imported it (the
launcher and each of its workers), seconds more on a loaded machine, spent after the run's last word.
Freezing the heap once every exit handler has run skips them. Nothing is lost that was promised:
objects still alive at exit are not guaranteed their finalizers (Python's data model), so what must
reach disk (checkpoints, metrics, the wandb run) is closed explicitly before.
"""

from __future__ import annotations

import atexit
import gc


def skip_final_collections() -> None:
    """Call early in the process: exit handlers run last-registered first, so this one runs after
    those registered later (wandb's, torch's). Calling it again changes nothing."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
