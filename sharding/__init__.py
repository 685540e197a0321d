"""Mesh construction and the whole logical→mesh sharding policy."""

from sharding.mesh import AXES, make_mesh, mesh_shape
from sharding.rules import (ACTIVATION_RULES, PARAM_RULES, batch_sharding, check_fits_mesh,
                            param_shardings, replicated)

__all__ = ['AXES', 'make_mesh', 'mesh_shape', 'ACTIVATION_RULES', 'PARAM_RULES', 'batch_sharding',
           'check_fits_mesh', 'param_shardings', 'replicated']
