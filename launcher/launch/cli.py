"""Entry points only: compose (Hydra), resolve, check, dispatch. Bad input ends as one line, exit 2."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from dataclasses import asdict, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, ListConfig, OmegaConf, ValueNode
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from launcher.compat.hydra_compat import hydra_errors_raised, hydra_full_error, plain_overrides
from launcher.config.extras import install_hint, installed, require
from launcher.config.options import BuildOptions
from launcher.config.run import Run
from launcher.config.schema import CONF_DIR, TrainConfig, compose_config
from launcher.errors import INTERRUPTED, PREEMPTED, LauncherError, broken_pipe_quiet, usage_errors_raised
from launcher.files import make_dir, remove_if_unused
from launcher.layout import Layout

if TYPE_CHECKING:
    from launcher.planner import Prediction

SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"  # conf/hydra/launcher/slurm.yaml builds on its config


def schema_keys(node: Any = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, for 'did you mean' hints."""
    keys = []
    for f in fields(node):
        key = prefix + f.name
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys += schema_keys(type(default), key + ".")
        elif isinstance(default, dict):  # batch, init: dicts with fixed keys (see config.py)
            keys += [f"{key}.{k}" for k in default]
        else:
            keys.append(key)
    return keys


def compose_error(err: Exception) -> str:
    """One line for an error Hydra raised while composing: the key and the fix, from the exception's
    own fields (OmegaConf's, the cause or context, names the key, value and node type; Hydra the missing option)."""
    cause = next((e for e in (err.__cause__, err.__context__) if isinstance(e, OmegaConfBaseException)), err)
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
        close = difflib.get_close_matches(cause.full_key, schema_keys(), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "see `train --cfg job` for the keys"
        return f"unknown config key '{cause.full_key}': {hint}"
    if isinstance(cause, ValidationError) and cause.full_key and isinstance(cause.child_node, ValueNode):
        expected = type(cause.child_node).__name__.removesuffix("Node")  # IntegerNode -> Integer
        return f"{cause.full_key}={cause.value}: expected a value of type {expected}"
    if isinstance(cause, ValidationError) and cause.full_key and isinstance(cause.child_node, ListConfig):
        return f"{cause.full_key}={cause.value}: expected a list, e.g. {cause.full_key}=[{cause.value}]"
    if isinstance(err, yaml.MarkedYAMLError) and (mark := err.problem_mark):  # a --config-dir file that is not YAML
        return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {err.problem}: fix the YAML"
    if isinstance(err, MissingConfigException) and "submitit" in str(err) and not installed(SUBMITIT_PLUGIN):
        return f"hydra/launcher=slurm needs the hydra_submitit_launcher package: {install_hint(SUBMITIT_PLUGIN)}"
    if isinstance(err, MissingConfigException):  # its first paragraph; then the options, or the search path
        found = str(err).split("\n\n")[0]
        if err.options and err.missing_cfg_file:
            found += f" available {err.missing_cfg_file.rpartition('/')[0]}: {', '.join(err.options)}"
        return found
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or "invalid command line"


def exit_with(err: LauncherError) -> NoReturn:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)


def run_app(config_name: str, task: Callable[[Any], None], overrides: list[str] | None = None) -> None:
    """Run a Hydra app (`overrides`: composed once, Hydra's compose API). Errors arrive as exception objects: ours
    (LauncherError, from the task or a plugin) exit with their code; Hydra's compose errors: one line, exit 2."""
    full_error = hydra_full_error()  # the user asked for Hydra's tracebacks: they get them
    with hydra_errors_raised() as restore_hydra_errors, usage_errors_raised(), broken_pipe_quiet():

        def wrapped(cfg: DictConfig) -> None:
            restore_hydra_errors()  # from here on Hydra reports the task's own crashes as the user asked
            try:
                task(OmegaConf.to_object(cfg))
            except LauncherError as err:
                exit_with(err)

        try:
            if overrides is not None:  # no job, output folder or log; HYDRA_FULL_ERROR is hydra.main's alone
                return task(compose_config(*overrides, config_name=config_name))
            hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)(wrapped)()
        except KeyboardInterrupt:  # Ctrl-C before a run can save, or a second one (launcher/train/preemption.py)
            print("interrupted: stopped without saving", file=sys.stderr)
            sys.exit(INTERRUPTED)
        except LauncherError as err:  # from a sweeper or launcher plugin, before any task ran
            exit_with(err)
        except (HydraException, OmegaConfBaseException, yaml.YAMLError) as err:
            if full_error:
                raise
            exit_with(LauncherError(compose_error(err)))


def train_task(cfg: TrainConfig) -> None:
    from launcher.launch.sweep import multirun, sweep_point

    try:
        with sweep_point(cfg.run_dir):  # multirun: a failed point is recorded for the summary, the sweep goes on
            _train_task(cfg)
    finally:  # a dry run or bad input: no folder of Hydra's files alone left behind
        if not multirun():
            remove_if_unused(Path(cfg.run_dir or HydraConfig.get().runtime.output_dir), dated=not cfg.run_dir)


def _check_inputs(cfg: TrainConfig, run_dir: Path, every_rank: bool) -> None:
    """What the workers will read (data, init.from, wandb, the checkpoint to resume), checked before any starts."""
    from launcher.data.corpus import check_source
    from launcher.data.mix import check_mix
    from launcher.model.hf import check_folder
    from launcher.train.ckpt_pick import preflight_resume

    if cfg.checkpoint.dir:
        make_dir(Path(cfg.checkpoint.dir), "checkpoint.dir")
    check = check_mix if cfg.data.name == "mix" else check_source  # a mixture: each source's checks, naming it
    check(cfg.data, cfg.model.vocab_size, cfg.seq_len, evaluates=cfg.eval.every > 0)
    check_folder(cfg.model, cfg.init.get("from"))  # init.from: a readable Llama folder of exactly the model's shapes
    check_wandb(cfg)
    root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")  # a bad path, no readable checkpoint: fails here
    preflight_resume(cfg.resume, root, every_rank=every_rank, data=cfg.data)


def _train_task(cfg: TrainConfig) -> None:
    from launcher.config.ft import check_ft
    from launcher.config.layout_keys import check_environment
    from launcher.launch.ft import group_dir, group_run
    from launcher.launch.rank_env import cuda_env_defaults, env_rank
    from launcher.launch.spawn import launch
    from launcher.planner import resolve, too_big
    from launcher.train.faults import fault_plan

    fault_plan()  # tests only: a LAUNCHER_TEST_* value that does not parse is refused before any worker starts
    env = env_rank()
    replica, world = ft_step(cfg, env.world_size if env else None)
    # the run's one layout (resolve checks the ranges first: the world size and the layout read them)
    # simulate: a layout predicted not to fit is simulated (will it?), not refused
    layout, prediction, options = resolve(replace(cfg, force=True) if cfg.simulate else cfg, world)
    check_ft(cfg.ft, layout.dp_replicate)
    if cfg.dry_run:  # shapes only: a layout that would not fit is reported, not refused
        from launcher.launch.dryrun import dry_run

        dry_run(cfg.model, layout, options)
        if not prediction.fits and not cfg.force:
            print(f"note: {too_big(cfg, prediction)}")
        return
    if cfg.simulate:  # one step of one rank per pipeline position on fake tensors, beside the planner
        return _simulate(cfg, run_of(cfg, layout, prediction, options))
    if options.fp8 is not None:
        require("torchao", what="dtype=fp8")
    if not (emit := cfg.slurm.emit):  # emit: the job runs on the cluster's nodes, not this (login) node
        cuda_env_defaults(cfg.hardware.kind)  # before check_environment's first torch.cuda call
    check_environment(cfg, layout, local=env is None and replica is None and not emit, here=not emit)
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)
    make_dir(run_dir, "run_dir")
    if emit:
        from launcher.launch.slurm import emit_script

        print(emit_script(cfg, run_dir, layout))
        return
    _check_inputs(cfg, run_dir, every_rank=env is not None)
    # a failed worker raises WorkerFailed (exit 1); the loop puts the prediction into summary.json
    run = run_of(cfg, layout, prediction, options)
    if replica is not None:
        # the emitted script restarts the group's job step (max_restarts times), not an agent inside it
        run, run_dir = replace(group_run(run, replica), max_restarts=0), group_dir(run_dir, replica)
    summary = launch(run, run_dir)
    if "preempted_at_step" in summary:
        from launcher.launch.slurm_job import requeue

        requeue()  # under SLURM: back in the queue; the rerun resumes from this checkpoint
        print(
            f"preempted at step {summary['preempted_at_step']}: checkpoint saved under {summary['checkpoint']}; "
            f"run again with run_dir={run_dir} to resume",
            file=sys.stderr,
        )
        sys.exit(PREEMPTED)


def _simulate(cfg: TrainConfig, run: Run) -> None:
    """`simulate=true` (launcher/simulate/): its table, and simulate.json in the run directory."""
    from launcher.planner import too_big
    from launcher.planner.request import problem
    from launcher.simulate import check, simulate

    check(run)  # what fake tensors cannot represent: refused before the run directory is made
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)
    make_dir(run_dir, "run_dir")
    simulate(run, problem(cfg, run.layout.world_size), json_path=run_dir / "simulate.json")
    if run.prediction is not None and not run.prediction.fits:
        print(f"note: {too_big(cfg, run.prediction)}")


def ft_step(cfg: TrainConfig, env_world: int | None) -> tuple[int | None, int | None]:
    """ft under SLURM: the replica group this job step runs (None: not one), and the layout's world size
    (the step's ranks x the groups; None: the degrees decide). `env_world`: torchrun's or SLURM's ranks."""
    from launcher.launch.slurm import check_ft_steps
    from launcher.launch.slurm_job import step_replica

    replica = step_replica() if cfg.ft.on else None
    if env_world is not None and replica is None:
        check_ft_steps(cfg.ft.replicas, "torchrun or one SLURM job step of every rank")
    return replica, env_world * (cfg.ft.replicas if replica is not None else 1) if env_world else None


def check_wandb(cfg: TrainConfig) -> None:
    """wandb asked for but not installed: online is refused, otherwise metrics go to the JSONL file only."""
    from launcher.metrics.sinks import check_wandb_login

    if cfg.metrics.wandb.mode != "disabled" and not installed("wandb"):
        if cfg.metrics.wandb.mode == "online":
            require("wandb", what="metrics.wandb.mode=online")
        print(f"note: wandb is not installed, metrics go to metrics.jsonl only ({install_hint('wandb')})")
        cfg.metrics.wandb.mode = "disabled"
    if cfg.metrics.wandb.mode == "online":
        check_wandb_login()


def run_of(cfg: TrainConfig, layout: Layout, prediction: Prediction | None, options: BuildOptions) -> Run:
    """The run every rank receives: `planner.resolve`'s output and the config sections the loop reads."""
    resolved = {"layout", "prediction", "options", "record", "replica"}  # the rest of Run's fields: config keys
    keys = [f.name for f in fields(Run) if f.name not in resolved]
    return Run(layout, prediction, options, record=asdict(cfg), **{key: getattr(cfg, key) for key in keys})


def train() -> None:
    run_app("train", train_task)


def plan_task(cfg: TrainConfig) -> None:
    from launcher.planner import run_plan

    run_plan(cfg)


def plan() -> None:
    run_app("plan", plan_task, plain_overrides(sys.argv[1:]))  # composed once; a Hydra flag (--help): hydra.main
