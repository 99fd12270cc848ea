"""`profile.start=N profile.steps=K`: a torch.profiler trace of steps N .. N+K-1 per rank, written as a
Chrome trace (Perfetto, chrome://tracing, TensorBoard) to run_dir/profile/rankR.trace.json, and one
line per rank of its top ops by self time. On CUDA, `profile.memory=true` also records the allocator's
history over those steps and dumps it as run_dir/profile/rankR.memory.pickle (pytorch.org/memory_viz)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from launcher.compat.torch_compat import dump_cuda_memory_snapshot, record_cuda_memory_history
from launcher.config.schema import ProfileConfig

TOP = 5  # ops in the summary line


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.cuda = cfg, rank, device.type == "cuda"
        self.dir = run_dir / "profile"
        self.active: profile | None = None
        self.mark: record_function | None = None  # the step being traced: `step_N` in the trace
        self.line = ""  # this rank's summary, once the window closed

    def begin(self, step: int) -> None:
        if self.cfg.start == step:
            self.open()
        if self.active is not None:
            self.mark = record_function(f"step_{step}")
            self.mark.__enter__()

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cfg.memory and self.cuda:
            record_cuda_memory_history(True)
        self.active = profile(activities=activities, record_shapes=False, profile_memory=self.cfg.memory)
        self.active.start()

    def end(self, step: int) -> None:
        """After a step's work (and its device sync): mark the step; close the window after its last."""
        if self.active is None:
            return
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        if step >= self.cfg.start + self.cfg.steps - 1:
            self.close()

    def close(self) -> None:
        prof, self.active = self.active, None
        if prof is None:
            return
        prof.stop()
        prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.trace.json"))
        if self.cfg.memory and self.cuda:
            dump_cuda_memory_snapshot(str(self.dir / f"rank{self.rank}.memory.pickle"))
            record_cuda_memory_history(False)
        self.line = f"rank {self.rank}: {top_ops(prof, self.cuda)}"

    def finish(self) -> list[str]:
        """Every rank's summary line, in rank order (the same list on every rank); [] without profiling.
        Closes a window the run ended inside."""
        if self.cfg.start is None:
            return []
        self.close()
        if not dist.is_initialized():
            return [self.line]
        lines: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(lines, self.line)  # once, at the end of the run
        return lines


def top_ops(prof: profile, cuda: bool) -> str:
    """`top ops by self CPU time: aten::mm 41% (12.3 ms), ...` over the profiled steps."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    attr, where = ("self_device_time_total", "CUDA") if cuda else ("self_cpu_time_total", "CPU")
    total = sum(getattr(e, attr) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:TOP]
    ops = ", ".join(f"{e.key} {100 * getattr(e, attr) / total:.0f}% ({getattr(e, attr) / 1e3:.1f} ms)" for e in ranked)
    return f"top ops by self {where} time: {ops}"
