"""The pipeline schedules, one row each: every fact about a schedule that the rules, the runtime,
the planner, the report and the search read. Adding a schedule is adding a row here (and, where
torch has no class for it, the class its `runtime` names).

Stages: with pp ranks and v stages per rank there are pp x v stages, placed looped (rank r holds
r, r + pp, ...: interleaved 1F1B, Narayanan et al. 2021) or in a V (rank r holds r and 2 pp - 1 - r:
zbv, dualpipev; rank 0 then holds the embedding and the loss). Zero-bubble schedules (Qi et al.
2024) split each backward into the input gradient (I) and the weight gradient (W) and run the W's
where 1F1B idles; their blocks stay eager (torch does not split a compiled backward).

The planner's formulas are checked against the timelines of torch's own action orders
(tests/unit/test_schedules.py), with forward, input and weight gradient equally long (one GEMM per weight):
- bubble(p, v, m): idle time of the busiest rank, in slots (one microbatch's forward and backward of
  all its layers);
- in_flight(p, v, m, r): microbatches whose activations rank r holds at its peak (in units of all
  its layers); a zero-bubble schedule keeps a microbatch's until its W;
- logits(p, m): microbatches whose logits (and the loss's fp32 log-softmax) the last stage holds.
No torch here: the runtime imports the class `runtime` names (launcher/parallel/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str  # the `pp_schedule` value
    runtime: str  # the class that runs it, dotted: torch's own, or the launcher's where torch has none
    virtual: int | None  # stages per rank: fixed (1, or 2 in a V), or None: `virtual_stages`, looped
    bubble: Callable[[int, int, int], float]  # (pp, v, microbatches) -> idle slots (module docstring)
    in_flight: Callable[[int, int, int, int], float]  # (pp, v, microbatches, rank) -> microbatches held
    logits: Callable[[int, int], int]  # (pp, microbatches) -> logits the last stage holds
    v_shape: bool = False  # stages in a V: rank 0 holds the first and the last
    zero_bubble: bool = False  # backward split into input and weight gradients
    fill: int = 1  # microbatches per step: at least fill x pp
    rounds: bool = False  # microbatches a multiple of pp (whole rounds of the loop)
    tries: tuple[int, ...] = ()  # virtual stages the search tries when the config leaves them (virtual None)
    auto: bool = True  # among the schedules `pp_schedule=auto` searches
    label: str = ""  # its name in tables, when not `name`

    @property
    def interleaved(self) -> bool:
        """Any number of stages per rank (`virtual_stages`), looped."""
        return self.virtual is None

    @property
    def multi_stage(self) -> bool:
        """torch's class takes the rank's list of stages (PipelineScheduleMulti), not one stage."""
        return self.virtual != 1

    def virtual_tries(self) -> tuple[int, ...]:
        """The virtual stages the search tries for this schedule when the config leaves them."""
        return self.tries if self.virtual is None else (self.virtual,)

    def text(self, chunks: int) -> str:
        """The schedule in the planner's table and the run's header: `1f1b`, `interleaved x2`, `zbv`."""
        label = self.label or self.name
        return f"{label} x{chunks}" if self.interleaved else label


def _one_f_one_b_bubble(p: int, v: int, m: int) -> float:
    return (p - 1) / v  # p - 1 hops of one chunk forward and backward each, chunks 1/v of the layers


def _zero_bubble(p: int, v: int, m: int) -> float:
    return (p - 1) / (3 * v)  # all but one chunk forward per hop filled with weight gradients


def _zbv_bubble(p: int, v: int, m: int) -> float:
    return max(p - 1, 2 * (2 * p - 1 - m)) / (3 * v)  # fewer than 2p - 1 microbatches cannot fill the warm-up


def _all_in_flight(p: int, v: int, m: int, r: int) -> float:
    return float(m)  # every forward before any backward


def _warmup_in_flight(p: int, v: int, m: int, r: int) -> float:
    if v > 1:  # Megatron's interleaved warm-up depth, deepest on rank 0
        return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) / v
    return float(min(m, p - r))  # 1F1B: a warm-up of p - r forwards


def _zb1p_in_flight(p: int, v: int, m: int, r: int) -> float:
    return float(min(m, p))  # warm-up of (v - 1) p + p - r - 1 chunks, the W's lag the I's


def _zbv_in_flight(p: int, v: int, m: int, r: int) -> float:
    return min(2 * p, m + r + 1) / 2  # chunk 0's warm-up 2(p - r) - 1, then r pairs and p - r chunk-1 forwards


def _dualpipev_in_flight(p: int, v: int, m: int, r: int) -> float:
    return (2 * p + 1) / 2  # 2p + 1 chunks on every rank (m >= 2p)


def _all_logits(p: int, m: int) -> int:
    return m


def _one_logits(p: int, m: int) -> int:
    return 1


def _zb1p_logits(p: int, m: int) -> int:
    return p  # the loss's graph lives from the input to the weight backward, p microbatches later


_TORCH = "torch.distributed.pipelining."
# fmt: off
ROWS = (
    Schedule(  # all forwards, then all backwards: 1F1B's bubble, every microbatch in flight
        name="gpipe", runtime=_TORCH + "ScheduleGPipe", virtual=1, auto=False,
        bubble=_one_f_one_b_bubble, in_flight=_all_in_flight, logits=_all_logits,
    ),
    Schedule(  # after a warm-up of pp - r forwards, one forward then one backward
        name="1f1b", runtime=_TORCH + "Schedule1F1B", virtual=1,
        bubble=_one_f_one_b_bubble, in_flight=_warmup_in_flight, logits=_one_logits,
    ),
    Schedule(  # 1F1B over v smaller stages per rank: the bubble shrinks by v
        name="interleaved_1f1b", runtime=_TORCH + "ScheduleInterleaved1F1B", virtual=None, rounds=True,
        tries=(2, 4, 8), label="interleaved",
        bubble=_one_f_one_b_bubble, in_flight=_warmup_in_flight, logits=_one_logits,
    ),
    Schedule(  # ZB1P, looped; v=1 is ZB-H1
        name="interleaved_zb", runtime=_TORCH + "ScheduleInterleavedZeroBubble", virtual=None, rounds=True,
        tries=(1, 2, 4, 8), zero_bubble=True,
        bubble=_zero_bubble, in_flight=_zb1p_in_flight, logits=_zb1p_logits,
    ),
    Schedule(  # ZB-V
        name="zbv", runtime=_TORCH + "ScheduleZBVZeroBubble", virtual=2, v_shape=True, zero_bubble=True,
        bubble=_zbv_bubble, in_flight=_zbv_in_flight, logits=_one_logits,
    ),
    Schedule(  # DeepSeek's DualPipe folded into a V
        name="dualpipev", runtime=_TORCH + "ScheduleDualPipeV", virtual=2, v_shape=True, zero_bubble=True, fill=2,
        bubble=_zero_bubble, in_flight=_dualpipev_in_flight, logits=_one_logits,
    ),
)
# fmt: on
SCHEDULE: dict[str, Schedule] = {row.name: row for row in ROWS}
SCHEDULES = tuple(SCHEDULE)  # the `pp_schedule` names (besides `auto`: the planner's choice)
