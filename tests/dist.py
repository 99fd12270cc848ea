"""Run a function in N gloo processes on this machine and collect what each returns.

    results = run(fn, 4, arg1, arg2)   # fn(rank, world_size, arg1, arg2) in each process

The parent hosts the rendezvous store on a free port (port 0: no race for a port), children come
from a forkserver that has torch imported already (no 2-3 s import per process), each with one
intra-op thread. `fn` must be importable (a module-level function). Results travel back as bytes
written by `torch.save`. A child that raises or dies takes the others down, and the parent raises
with its rank and traceback; a run past `timeout` is killed: a broken test never hangs.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

_CTX = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
    return _CTX


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, conn: Any, timeout: float
) -> None:
    import torch
    import torch.distributed as dist

    from launcher.compat.torch_compat import leave_process_groups

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        conn.send(("ok", buffer.getvalue()))
        if dist.is_initialized():
            leave_process_groups()
    except BaseException:  # noqa: B036 - report everything, then die
        conn.send(("error", traceback.format_exc()))
        conn.close()
        sys.stderr.flush()
        os._exit(1)
    conn.close()


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """fn(rank, world_size, *args) in `world_size` gloo processes; the list of their return values."""
    return run_many([(fn, world_size, args)], timeout)[0]


def run_many(jobs: list[tuple[Callable[..., Any], int, tuple]], timeout: float = 240.0) -> list[list[Any]]:
    """Several independent worlds at once (each its own store and process group): for each job
    (fn, world_size, args), the list of what fn(rank, world_size, *args) returned on each rank."""
    import torch
    import torch.distributed as dist

    ctx = _context()
    stores = [dist.TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False) for _, n, _ in jobs]
    procs: dict[tuple[int, int], Any] = {}
    readers: dict[Any, tuple[int, int]] = {}
    for j, ((fn, n, args), store) in enumerate(zip(jobs, stores)):
        for rank in range(n):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(fn, rank, n, store.port, args, writer, timeout), daemon=True)
            proc.start()
            writer.close()
            readers[reader] = (j, rank)
            procs[j, rank] = proc
    results: dict[tuple[int, int], Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(procs) - set(results))
                raise TimeoutError(f"(job, rank) {missing} did not finish within {timeout:.0f} s")
            pending = {r: key for r, key in readers.items() if key not in results}
            sentinels = {procs[key].sentinel: (r, key) for r, key in pending.items()}
            for obj in wait(list(pending) + list(sentinels), timeout=left):
                if obj in sentinels:  # a process ended: did it leave its result or error first?
                    reader, key = sentinels[obj]
                    if key not in results and not reader.poll(0.5):
                        raise RuntimeError(f"rank {key[1]} died (exit code {procs[key].exitcode}) without a word")
                    continue
                key = pending[obj]
                try:
                    status, payload = obj.recv()
                except EOFError:
                    raise RuntimeError(f"rank {key[1]} died (exit code {procs[key].exitcode})") from None
                if status == "error":
                    raise RuntimeError(f"rank {key[1]} failed:\n{payload}")
                results[key] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for proc in procs.values():
            if proc.is_alive() and len(results) < len(procs):
                proc.kill()
        for proc in procs.values():
            proc.join(5)
    return [[results[j, r] for r in range(n)] for j, (_, n, _) in enumerate(jobs)]
