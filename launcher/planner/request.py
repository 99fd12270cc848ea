"""From a TrainConfig to what the search needs (Problem, Space): the layout rules of
launcher/layout/ parse and check the keys. Every error is a LauncherError whose one line names the
key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.config.hardware import HardwareConfig
from launcher.config.layout_keys import given_degrees
from launcher.config.schema import TrainConfig, compile_enabled
from launcher.config.validate import require_fp8_units
from launcher.errors import LauncherError
from launcher.flops import document_span
from launcher.hardware.machine import Machine
from launcher.hardware.profile import machine
from launcher.layout import SCHEDULE, check_world, int_or_auto, recompute_layers_of, worker_threads, workers_per_node
from launcher.planner.fp8 import RECIPE_RATE, Fp8
from launcher.planner.predict import Problem
from launcher.planner.search import Space


def core_share(cfg: TrainConfig, world: int) -> float:
    """The share of its threads' cores a CPU worker gets: local workers share the cores, and with more
    threads than cores everything time-slices (the matmuls, gloo's copies and reductions, the dispatch)."""
    local = workers_per_node(world, cfg.nodes)
    return min(1.0, (os.cpu_count() or 1) / (local * worker_threads(cfg.threads, local)))


def resolve_machine(cfg: TrainConfig, world: int) -> Machine:
    threads = worker_threads(cfg.threads, workers_per_node(world, cfg.nodes))
    mach = machine(cfg.hardware, threads, cfg.cache_dir, alone=world == 1)
    if mach.kind == "cpu":
        share = core_share(cfg, world)
        levels = tuple(lv.time_sliced(share) for lv in mach.levels)
        mach = dataclasses.replace(
            mach,
            peak_flops=mach.peak_flops * share,
            levels=levels,
            host_overhead=mach.host_overhead / share,
            block_overhead=mach.block_overhead / share,
            optimizer_time=mach.optimizer_time / share,
            host_copy_time=mach.host_copy_time / share,
        )
    return mach


def elem_bytes(cfg: TrainConfig) -> int:
    """Bytes per activation element: fp32 on a CPU, bf16 on accelerators, unless dtype says."""
    if cfg.dtype == "auto":
        return 4 if cfg.hardware.kind == "cpu" else 2
    return 4 if cfg.dtype == "fp32" else 2


def fp8_term(hw: HardwareConfig, recipe: str, emulate: bool, min_features: int) -> Fp8:
    """dtype=fp8 on `hw`: its fp8 matmul rate over its bf16 one; emulated (fp8.emulate=true): none faster."""
    require_fp8_units(hw, emulate)  # a profile plan.compare names too
    if emulate or hw.peak_tflops_fp8 is None or hw.peak_tflops is None or hw.matmul_efficiency is None:
        return Fp8(recipe, 1.0, None, min_features)
    fp8_rate = hw.peak_tflops_fp8 * (hw.fp8_matmul_efficiency or hw.matmul_efficiency)
    speedup = RECIPE_RATE[recipe] * fp8_rate / (hw.peak_tflops * hw.matmul_efficiency)
    return Fp8(recipe, speedup, hw.peak_tflops_fp8 * 1e12, min_features)


def fp8_of(cfg: TrainConfig, auto: bool = False) -> Fp8 | None:
    """The fp8 term of dtype=fp8 (`auto`: of dtype=auto, where the profile has FP8 units on CUDA, for
    `plan` to rank beside bf16); None otherwise. The recipe and emulation come from the `fp8` section."""
    hw, recipe, emulate = cfg.hardware, cfg.fp8.recipe, cfg.fp8.emulate
    if cfg.dtype == "fp8":
        return fp8_term(hw, recipe, emulate, cfg.fp8.min_features)
    if auto and cfg.dtype == "auto" and hw.kind == "cuda" and hw.peak_tflops_fp8 is not None:
        return fp8_term(hw, recipe, False, cfg.fp8.min_features)
    return None


def problem(cfg: TrainConfig, world: int) -> Problem:
    return Problem(
        model=cfg.model,
        seq=cfg.seq_len,
        world=world,
        machine=resolve_machine(cfg, world),
        elem=elem_bytes(cfg),
        async_tp=cfg.async_tp,
        compiled=cfg.hardware.kind == "tpu" or compile_enabled(cfg),  # XLA compiles every step on a TPU
        fp8=fp8_of(cfg),
        # documents of the typical length: each query attends within its own (flops.document_span)
        span=document_span([cfg.data.document_len], cfg.seq_len) if cfg.data.document_mask else 0.0,
        documents=cfg.data.document_mask,  # and each forward's mask, the machine's kind says which (memory.py)
        device_snapshot=cfg.guard.spike == "rollback" and cfg.guard.snapshot == "device",
        ft=cfg.ft.on,
    )


def space(cfg: TrainConfig, world: int, explore: bool) -> Space:
    """The allowed values of each key (None: searched); the given degrees must fit the world."""
    degrees = given_degrees(cfg)
    if cfg.data.document_mask and degrees["cp"] is None:  # validate.check_document_mask: masks need cp=1
        degrees["cp"] = 1
    check_world(world, degrees)
    schedule = None if cfg.pp_schedule == "auto" else cfg.pp_schedule
    interleaved = schedule is not None and SCHEDULE[schedule].interleaved
    virtual = int_or_auto("virtual_stages", cfg.virtual_stages, auto=None) or 1
    searched_v = virtual == 1 and (schedule is None or (explore and interleaved))
    return Space(
        degrees=degrees,
        micro=int_or_auto("batch.micro", cfg.batch.get("micro", "auto")),
        global_batch=int_or_auto("batch.global", cfg.batch.get("global"), auto=None),
        microbatches=int_or_auto("microbatches", cfg.microbatches, auto=None),
        schedule=schedule,
        virtual_stages=None if searched_v else virtual,
        recompute=None if cfg.recompute == "auto" else cfg.recompute,
        sequence_parallel=True if cfg.sequence_parallel else (None if explore else False),
        recompute_layers=recompute_layers_of(cfg.recompute_layers),
        reshard=None if explore and cfg.fsdp.reshard_after_forward == "auto" else cfg.fsdp.reshard_after_forward,
    )


def recorded_problem(record: dict[str, Any], hardware: HardwareConfig, world: int, source: str) -> Problem:
    """The Problem of a finished run, from the config its summary.json records (`source`), on `hardware`
    (the profile `plan.calibrate` fits) instead of the profile it ran with."""
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), record))
    except OmegaConfBaseException as err:
        msg = str(err).splitlines()[0]
        raise LauncherError(
            f"{source}: its config does not compose ({msg}): leave that run out of plan.calibrate"
        ) from None
    assert isinstance(cfg, TrainConfig)
    return problem(dataclasses.replace(cfg, hardware=hardware), world)
