"""Mesh construction and the whole logical→mesh sharding policy."""

from sharding.layouts import row_major
from sharding.mesh import (AXES, MeshMismatch, describe, local_device, make_mesh,
                           mesh_shape)
from sharding.per_shard import (Params, axes_size, mesh_axes, mesh_axis, partitioned, per_shard,
                                per_stage, token_gradient_axes, varying_like)
from sharding.rules import (ACTIVATION_RULES, PARAM_RULES, activation_rules, batch_sharding,
                            check_fits_mesh,
                            param_shardings, replicated)

__all__ = ['AXES', 'MeshMismatch', 'describe', 'local_device', 'make_mesh', 'mesh_shape', 'mesh_axis', 'mesh_axes', 'axes_size', 'Params', 'partitioned', 'per_shard', 'per_stage', 'token_gradient_axes', 'varying_like', 'ACTIVATION_RULES', 'activation_rules',
           'PARAM_RULES', 'batch_sharding', 'check_fits_mesh', 'param_shardings', 'replicated', 'row_major']
