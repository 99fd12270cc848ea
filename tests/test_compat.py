"""The private PyTorch APIs in launcher/compat.py still behave as the project relies on: these fail
loudly on a torch upgrade that changes them."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from launcher.compat import SafeFileSystemReader, dcp_file_extents, load_dcp_metadata
from launcher.train.checkpoint import Checkpointer, Stateful
from launcher.train.loop import build_model
from launcher.train.optim import build_optimizer
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of the tiny model and its AdamW state (tensors and non-tensor values)."""
    tmp = tmp_path_factory.mktemp("compat")
    cfg = tiny_config(tmp)
    model = build_model(cfg, torch.device("cpu"))
    optimizer, _ = build_optimizer([model], cfg.optim, 4)
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    optimizer.step()
    Checkpointer(cfg.checkpoint, tmp / "checkpoints", 0).save([model], optimizer, Stateful(1, {}))
    return tmp / "checkpoints" / "step_00000001"


def test_restricted_unpickler_reads_what_the_full_one_reads(checkpoint: Path) -> None:
    raw = (checkpoint / ".metadata").read_bytes()
    restricted = load_dcp_metadata(io.BytesIO(raw))  # an unlisted class here: torch changed the format
    assert restricted == pickle.loads(raw)
    assert any(key.startswith("model.") for key in restricted.state_dict_metadata)
    assert SafeFileSystemReader(str(checkpoint)).read_metadata().storage_meta is not None


def test_restricted_unpickler_refuses_other_objects() -> None:
    class Call:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(pickle.UnpicklingError, match=r"unexpected object builtins.print in .metadata"):
        load_dcp_metadata(io.BytesIO(pickle.dumps(Call())))
    with pytest.raises(pickle.UnpicklingError, match=r"unexpected object dict in .metadata"):
        load_dcp_metadata(io.BytesIO(pickle.dumps({"a": 1})))


def test_storage_extents_cover_the_shard_files(checkpoint: Path) -> None:
    extents = dcp_file_extents(SafeFileSystemReader(str(checkpoint)).read_metadata())
    assert extents and all((checkpoint / name).stat().st_size >= end > 0 for name, end in extents.items())
