"""Where a layout's ranks run: the rank at given coordinates, the rank that owns the output, the
DeviceMesh (and expert parallelism's), workers per node and threads per worker. torch is imported
inside the mesh builders only: `plan` imports this package on accelerator profiles.
"""

from __future__ import annotations

import os

from launcher.layout.core import MESH_DIMS, Layout


def rank_of(layout: Layout, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 0, cp: int = 0) -> int:
    """The rank at these coordinates (the order in launcher/layout/core.py)."""
    inner = cp + layout.cp * (dp_shard + layout.dp_shard * (dp_replicate + layout.dp_replicate * pp))
    return tp + layout.tp * inner


def owner_rank(layout: Layout) -> int:
    """Rank 0 of the last pipeline stage: it owns the user-facing output (pipeline rank 0 in a V)."""
    return rank_of(layout, pp=layout.last_rank)


def build_mesh(layout: Layout, device_type: str = "cpu"):  # -> DeviceMesh
    """The DeviceMesh of the layout, dimensions named pp, dp_replicate, dp_shard, cp, tp (row-major, so
    the mesh's rank order is exactly `rank_of`). The data-parallel rank is
    dp_replicate_rank * dp_shard + dp_shard_rank, as in `Layout.coordinates`."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    if layout.cp > 1:  # FSDP shards over dp_shard x cp (launcher/parallel/data.py)
        from launcher.compat.torch_compat import flatten_mesh

        flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
    return mesh


def expert_mesh(layout: Layout, device_type: str = "cpu"):  # -> DeviceMesh
    """The mesh expert parallelism runs on: dp_shard split into (edp, ep), ep inner, so the ranks are
    those of `build_mesh` (dims pp, dp_replicate, edp, ep, cp, tp). The experts are sharded over "ep", and
    FSDP-sharded over "edp" by the ranks holding the same ones (launcher/parallel/expert.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pp, layout.dp_replicate, layout.edp, layout.ep, layout.cp, layout.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "edp", "ep", "cp", "tp"))


def workers_per_node(world: int, nodes: int) -> int:
    return -(-world // nodes)


def worker_threads(threads: int | None, local_workers: int) -> int:
    """Intra-op threads per worker: `threads`, else this machine's cores shared by the local workers
    (the planner predicts with the same count the workers run with)."""
    return threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))
