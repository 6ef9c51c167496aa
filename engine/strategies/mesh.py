"""How strategies compose: one device mesh with named dimensions, as torchtitan lays out its
parallelisms. The ranks form (replicas x inner) with contiguous inner blocks: rank = replica x
inner + inner rank. DiLoCo's workers are the replicas of an FSDP2 group ("shard"), the
pipeline's data-parallel copies are the replicas of a pipeline ("pp"); each strategy takes its
groups from the mesh by name.
"""

from __future__ import annotations

from engine.process.distributed import Dist


def replica_mesh(d: Dist, inner: int, inner_name: str):
    """The (replica, `inner_name`) mesh over all ranks, `inner` ranks per replica (a
    collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    if d.world_size % inner:
        raise ValueError(f"{d.world_size} ranks do not split into groups of {inner}")
    return init_device_mesh(d.device.type, (d.world_size // inner, inner),
                            mesh_dim_names=("replica", inner_name))
