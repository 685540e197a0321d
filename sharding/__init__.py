"""Mesh construction and the whole logical→mesh sharding policy."""

from sharding.mesh import (AXES, MeshMismatch, check_mesh_config, describe, local_device, make_mesh,
                           mesh_shape)
from sharding.per_shard import mesh_axis, partitioned, per_shard, scatter_names
from sharding.rules import (ACTIVATION_RULES, PARAM_RULES, batch_sharding, check_fits_mesh,
                            param_shardings, replicated)

__all__ = ['AXES', 'MeshMismatch', 'check_mesh_config', 'describe', 'local_device', 'make_mesh', 'mesh_shape', 'mesh_axis', 'partitioned', 'per_shard', 'scatter_names', 'ACTIVATION_RULES',
           'PARAM_RULES', 'batch_sharding', 'check_fits_mesh', 'param_shardings', 'replicated']
