"""glibc's malloc tuned for a CPU worker (`cpu_allocator`): what a training step's large tensors cost to
allocate. No torch here: the calibration's probes set it too (launcher/hardware/probes/host.py).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
# cpu_allocator modes as (mallopt parameter, value) pairs; values are C ints
ALLOCATOR = {
    "lean": ((M_MMAP_THRESHOLD, 4 << 20), (M_TRIM_THRESHOLD, 128 << 10)),  # the trim: glibc's default
    "fast": ((M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 2**31 - 1)),
}


def allocator_mode(setting: str, steps: int) -> str:
    """`cpu_allocator=auto`: lean for a `steps=0` memory check, fast for training."""
    return ("lean" if steps == 0 else "fast") if setting == "auto" else setting


def set_cpu_allocator(mode: str) -> bool:
    """Tune glibc's malloc in a CPU worker; False where the C library is not glibc.

    glibc by default mmaps every block above its threshold (raised after the first large free, to
    32 MiB at most) and unmaps it when freed, so every larger tensor faults its pages in again: at the
    peer shape (seq 2048) QKV, gate+up and attention buffers are 48-96 MiB, allocated every layer,
    ~450K page faults a step on one process. `fast` serves every block below 1 GiB from the heap and
    never trims it, so freed blocks are reused without faults (peer shape, 5 steps side by side: page
    faults 2.8M -> 1.0M one process, 8.2M -> 2.0M FSDP; tokens/s +11% one process, +10% tp=2, +22%
    FSDP; peak RSS +6-8%: glibc's cache counts as resident). `lean` does the opposite: blocks of 4 MiB
    and more are mmapped, so a freed tensor goes back to the system and peak RSS is the run's tensors
    (FSDP's gathered blocks and gradient buffers, freed every layer, otherwise stay resident: a 125m
    rank 2.60 GiB against 1.83 lean, bench memory); its faults make it the slow one."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(param, value) for param, value in ALLOCATOR[mode])
    except (OSError, AttributeError):
        return False
