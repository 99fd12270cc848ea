"""Each private Hydra / submitit API in launcher/compat/hydra_compat.py still has the signature and the
behaviour the project relies on: these fail loudly on an upgrade that changes one, naming the API to port."""

from __future__ import annotations

import inspect
import signal
import sys
from types import SimpleNamespace

import hydra
import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError

from launcher.compat import hydra_compat
from launcher.config.schema import CONF_DIR


# --- Hydra --------------------------------------------------------------------------------------------
def test_hydra_main_raises_compose_errors_as_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hydra_compat.FULL_ERROR, raising=False)
    monkeypatch.setattr(sys, "argv", ["train", "stpes=1"])
    app = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")(lambda cfg: None)
    try:
        with hydra_compat.hydra_errors_raised(), pytest.raises(ConfigCompositionException) as raised:
            app()
        assert isinstance(raised.value.__cause__, ConfigAttributeError)
        assert raised.value.__cause__.full_key == "stpes"
        assert not hydra_compat.hydra_full_error()  # the user's setting is back
        with pytest.raises(SystemExit):  # without: Hydra prints and exits
            app()
    finally:
        GlobalHydra.instance().clear()


def test_plain_overrides_are_what_hydras_parser_reads_as_overrides(tmp_path) -> None:
    """`plan` composes with the compose API what Hydra's own parser reads as overrides and --config-dir alone,
    the folder as the `hydra.searchpath` override; anything else (a flag, a Hydra override, a missing folder) it
    leaves to hydra.main."""
    from hydra._internal.utils import get_args_parser

    folder = str(tmp_path)
    plain = ([], ["+model=8b", "nodes=2", "seq_len=-1"], [f"--config-dir={folder}", "tp=2"], ["-cd", folder, "pp=1"],
             ["tp=1", "--config-dir", folder])  # fmt: skip
    for argv in plain:
        parsed, overrides = get_args_parser().parse_args(argv), hydra_compat.plain_overrides(argv)
        assert not any(v for k, v in vars(parsed).items() if k not in ("overrides", "config_dir")), parsed
        path = [f"hydra.searchpath=['file://{folder}']"] if parsed.config_dir else []
        assert overrides == parsed.overrides + path, argv
    others = (["--help"], ["--cfg", "job"], ["-m", "tp=1,2"], ["hydra.run.dir=x"], ["hydra/launcher=slurm"],
              ["+hydra.job.env_set.A=1"], ["--config-dir"], ["--config-dir=/no/such/folder"],
              ["-cd", folder, "-cd", folder], ["--config-name=train"], ["-cn", "train"], ["--info"])  # fmt: skip
    assert [argv for argv in others if hydra_compat.plain_overrides(argv) is not None] == []


def test_basic_sweeper_runs_the_batches_the_layout_sweeper_sets() -> None:
    sweeper = hydra_compat.basic_sweeper()(max_batch_size=None, params=None)
    parsed = OverridesParser.create().parse_overrides(["a=1,2", "b=3"])
    assert sweeper.split_arguments(parsed, None) == [[["a=1", "b=3"], ["a=2", "b=3"]]]
    sweeper.overrides = [[["a=1"], ["a=2"]], [["a=3"]]]
    sweeper.batch_index = 0
    assert sweeper.get_job_batch() == [["a=1"], ["a=2"]] and not sweeper.is_done()
    assert sweeper.get_job_batch() == [["a=3"]] and sweeper.is_done()
    assert list(inspect.signature(sweeper.validate_batch_is_legal).parameters) == ["batch"]


# --- submitit -----------------------------------------------------------------------------------------
def test_sbatch_script_takes_the_executor_parameters() -> None:
    text = hydra_compat.sbatch_script(
        command=f"{hydra_compat.SUBMITIT_COMMAND} <folder>",
        folder="/tmp/jobs/%j",
        job_name="train",
        map_count=None,
        additional_parameters={"requeue": True},
        nodes=2,
        ntasks_per_node=4,
        cpus_per_task=8,
        gpus_per_node=4,
        time=60,
        partition="gpu",
        account=None,
        signal_delay_s=120,
        setup=["export OMP_NUM_THREADS=8"],
    )
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --partition=gpu", "#SBATCH --requeue"):
        assert line in text
    assert "submitit.core._submit" in text and "export OMP_NUM_THREADS=8" in text


def test_submitit_command() -> None:
    from submitit.slurm.slurm import SlurmExecutor

    command = SlurmExecutor._submitit_command_str.fget(SimpleNamespace(python="python", folder="/jobs"))
    assert command == f"{hydra_compat.SUBMITIT_COMMAND} /jobs"


def test_submitit_requeues_on_the_signal_we_send(monkeypatch: pytest.MonkeyPatch) -> None:
    from submitit.core.job_environment import JobEnvironment, SignalHandler

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert hydra_compat.submitit_requeue_signal() is None
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    sig = hydra_compat.submitit_requeue_signal()
    assert sig is not None
    saved = {s: signal.getsignal(s) for s in (sig, signal.SIGTERM, signal.SIGCONT)}
    try:
        JobEnvironment()._handle_signals(None, None)  # what submitit does when a job starts
        handler = signal.getsignal(sig)
        assert getattr(handler, "__func__", None) is SignalHandler.checkpoint_and_try_requeue
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
