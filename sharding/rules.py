"""The whole sharding policy: two tables mapping logical axis names onto mesh axes.

PARAM_RULES say where parameters (and so their gradients and Adam moments) live;
ACTIVATION_RULES say how the computation is split. Keeping them apart makes each strategy one rule:
  - FSDP (ZeRO-3): 'embed' → fsdp in PARAM_RULES (weights are gathered per layer for compute),
    with 'batch' → (data, fsdp) in ACTIVATION_RULES.
  - Tensor (Megatron): 'heads', 'kv_heads', 'mlp', 'vocab' → tensor in both tables
    (column-parallel Wq/Wk/Wv/Wgate/Wup, row-parallel Wo/Wdown).
  - Sequence: 'length' → sequence for activations. XLA's attention gathers keys and values
    ('kv_length'); our kernel moves them itself (all-gather or ring, kernels/context_parallel.py).
    Parameters are also split over sequence along 'embed' so that axis holds no replicas.
  - Data: 'batch' → data; parameters are replicated over it, or with
    config.partition.hierarchical split over it too, along a dimension no rule here splits
    (sharding/hierarchical.py: the axis between nodes).
  - Expert: 'experts' → expert in both tables: each device holds E/expert of an MoE layer's
    experts, and the tokens travel to them by all-to-all (model/moe.py). Everywhere else the
    axis is one more FSDP axis: 'batch' and the dense weights' 'embed' are split over it too, so
    an expert's own model dimension has a name of its own, 'expert_embed'. W_down's FSDP share
    falls on its width instead ('expert_mlp', after tensor's split; its model dimension
    'expert_out' whole): gathered and reduce-scattered along the major dimension of a layer's
    slice, XLA needs no transposed fp32 copy of the whole stack (3.5 GiB a GPU for Mixtral).
  - Pipeline: 'layers' → stage in both tables. Each stage holds its consecutive layers of every
    stacked parameter; the model finds the axis (sharding.mesh_axis('layers')) and runs its
    schedule over it (model/pipeline.py). Embedding and head are replicated over stages. With
    virtual stages the stacked parameters are [virtual, layers, ...]: stage s holds, in each of
    the V rows, its consecutive share, so its chunks are s, s+P, … of the execution order.
Sharded shapes, in scaling-book notation: Wq[layers_stage, D_(fsdp,sequence,expert), N_tensor, H]
(or Wq[virtual, layers_stage, …]), Wgate[D_(fsdp,sequence,expert), F_tensor],
x[B_(data,fsdp,expert), L_sequence, D]; an MoE layer's experts
W_gate[E_expert, D_(fsdp,sequence), F_tensor], W_down[E_expert, F_(tensor,fsdp,sequence), D]
(model/moe.py).
"""

import math

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.mesh import MeshMismatch

PARAM_RULES = (
    ('virtual', None),  # a stage's chunks, with model.virtual_stages > 1
    ('layers', 'stage'),
    ('vocab', 'tensor'),
    ('embed', ('fsdp', 'sequence', 'expert')),  # outside the experts `expert` is FSDP's too
    ('expert_embed', ('fsdp', 'sequence')),  # an expert's model dimension: `expert` splits E
    ('expert_mlp', ('tensor', 'fsdp', 'sequence')),  # W_down's width: FSDP's share within tensor's
    ('expert_out', None),  # W_down's model dimension
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('experts', 'expert'),
    ('expert_scores', None),  # the router's: every token's device scores every expert
    ('norm', None),
    ('lora', None),  # an adapter's rank (model/layers.py: Adapter): its other names are its weight's
    ('draft', None),  # which draft head (model/draft.py)
)

ACTIVATION_RULES = (
    ('virtual', None),
    ('layers', 'stage'),  # the pipeline's axis (model/pipeline.py), found by sharding.mesh_axis
    ('batch', ('data', 'fsdp', 'expert')),
    ('length', 'sequence'),
    ('kv_length', None),
    ('embed', None),
    ('expert_embed', None),
    ('expert_mlp', 'tensor'),
    ('expert_out', None),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('experts', 'expert'),  # an expert's weights stay on its devices; the tokens travel
    ('expert_scores', None),
    ('vocab', 'tensor'),
    ('lora', None),
    ('draft', None),
)

def activation_rules() -> tuple:
  """ACTIVATION_RULES less the mesh axes the current trace is manual over (a region that runs
  each data replica apart, sharding/hierarchical.py's apart): constraints name only the rest."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if not manual:
    return ACTIVATION_RULES
  def keep(axes):
    if isinstance(axes, str) or axes is None:
      return None if axes in manual else axes
    return tuple(a for a in axes if a not in manual) or None
  return tuple((name, keep(axes)) for name, axes in ACTIVATION_RULES)


BATCH_SPEC = P(('data', 'fsdp', 'expert'), 'sequence')  # every [B, L] array of the batch


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, BATCH_SPEC)


def param_shardings(abstract_state, mesh):
  """NamedShardings for a model state (same tree), from its logical names and PARAM_RULES.

  Works on an abstract state (`nnx.eval_shape`), so no full-size array is ever built; raises
  naming the parameter if a sharded dimension does not divide by its mesh axes.
  """
  with nnx.logical_axis_rules(PARAM_RULES):
    specs = nnx.get_partition_spec(abstract_state)
  specs_by_path = dict(nnx.to_flat_state(specs))
  for path, var in nnx.to_flat_state(abstract_state):
    _check_param('.'.join(map(str, path)), var, specs_by_path[path].get_value(), mesh)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def _check_param(name, var, spec, mesh):
  """Every logical name is mapped, and every sharded dimension divides by its mesh axes."""
  if unknown := set(var.out_sharding or ()) - {logical for logical, _ in PARAM_RULES}:
    raise ValueError(f'parameter {name} names logical axes {sorted(unknown)} that '
                     'sharding/rules.py PARAM_RULES does not map')
  for dim, (size, axes) in enumerate(zip(var.shape, spec)):
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    parts = math.prod(mesh.shape[a] for a in axes)
    if size % parts:
      raise ValueError(
          f'parameter {name} dimension {dim} (logical {var.out_sharding[dim]!r}, size {size}) '
          f'does not divide by mesh axes {axes} (size {parts}); change config.model or '
          'config.mesh')


def check_fits_mesh(model_cfg, batch_size: int, seq_len: int, mesh_sizes: dict,
                    microbatches: int = 1, length_tile: int = 1) -> None:
  """The model and batch against the mesh's axis sizes, before anything is built: MeshMismatch
  naming the fields to change. `length_tile`: the positions each attention call takes in whole
  blocks of (kernels/attention.py: length_tile)."""
  t, e = mesh_sizes['tensor'], mesh_sizes['expert']
  dp = mesh_sizes['data'] * mesh_sizes['fsdp'] * e
  for field in ('n_heads', 'n_kv_heads', 'd_ff', 'vocab_size'):
    if getattr(model_cfg, field) % t:
      raise MeshMismatch(f'config.model.{field}={getattr(model_cfg, field)} is not divisible '
                         f'by config.mesh.tensor={t}; tensor parallelism splits it {t} ways')
  if model_cfg.experts and (model_cfg.expert_width % t or
                            (model_cfg.expert_matmul == 'pallas' and
                             (model_cfg.expert_width // t) % 16)):
    raise MeshMismatch(f'the expert width {model_cfg.expert_width} (config.model.expert_d_ff, or '
                       f'd_ff) must split into config.mesh.tensor={t} shares, each a multiple '
                       'of 16 for the grouped-matmul kernel')
  if e > 1 and not model_cfg.experts:
    raise MeshMismatch(f'config.mesh.expert={e} splits the experts of an MoE model, and '
                       'config.model.experts=0; use config.mesh.fsdp for a dense model')
  if e > 1 and model_cfg.experts % e:
    raise MeshMismatch(f'config.model.experts={model_cfg.experts} is not divisible by '
                       f'config.mesh.expert={e}; each device of that axis holds an equal share')
  shard = mesh_sizes['fsdp'] * mesh_sizes['sequence'] * e
  if model_cfg.d_model % shard:
    raise MeshMismatch(f'config.model.d_model={model_cfg.d_model} is not divisible by '
                       f'config.mesh.fsdp×sequence×expert={shard}, which shard parameters')
  if batch_size % dp:
    raise MeshMismatch(f'config.batch_size={batch_size} is not divisible by config.mesh.data×'
                       f'fsdp×expert={dp}; each of those shards takes an equal slice')
  if batch_size % (dp * microbatches):
    raise MeshMismatch(f'config.batch_size={batch_size} is not divisible by '
                       f'config.microbatches={microbatches} × config.mesh.data×fsdp×expert='
                       f'{dp}; every device takes an equal share of each microbatch')
  stages, loops = mesh_sizes['stage'], model_cfg.virtual_stages
  if model_cfg.n_layers % (stages * loops):
    raise MeshMismatch(f'config.model.n_layers={model_cfg.n_layers} is not divisible by '
                       f'config.mesh.stage={stages} × config.model.virtual_stages={loops}; each '
                       'pipeline stage holds an equal share of every chunk of layers')
  if microbatches < stages:
    raise MeshMismatch(f'config.microbatches={microbatches} is fewer than config.mesh.stage='
                       f'{stages}: the pipeline needs a microbatch for every stage to be busy; '
                       f'set --config.microbatches={2 * stages} or more (bubble (P-1)/(V·M+P-1))')
  if seq_len % mesh_sizes['sequence']:
    raise MeshMismatch(f'config.seq_len={seq_len} is not divisible by '
                       f'config.mesh.sequence={mesh_sizes["sequence"]}')
  if model_cfg.context_parallel == 'ring' and seq_len % (2 * mesh_sizes['sequence']):
    raise MeshMismatch(f"config.seq_len={seq_len} is not divisible by 2×config.mesh.sequence="
                       f"{2 * mesh_sizes['sequence']}: context_parallel='ring' splits each row "
                       'into two chunks per device (zigzag, for equal causal work)')
  # the ring's zigzag halves a device's share; without a sequence split either way runs whole rows
  ring = model_cfg.context_parallel == 'ring' and mesh_sizes['sequence'] > 1
  split = mesh_sizes['sequence'] * (2 if ring else 1)
  if (tile := length_tile) > 1 and (per_call := seq_len // split) % tile:
    # A key block the user chose names itself, and a smaller one that fits is the first fix.
    chosen = model_cfg.attention_block_k
    smaller = next((k for k in (128, 64) if k < tile and per_call % k == 0), None)
    raise MeshMismatch(
        f"config.model.attention={model_cfg.attention!r} takes whole blocks of {tile} positions "
        f"(its key block{f', config.model.attention_block_k={chosen}' if chosen else ''}; it "
        f'masks no padding), and config.seq_len={seq_len} gives each call {per_call}: '
        + (f'set --config.model.attention_block_k={smaller}, ' if smaller else '')
        + f'set seq_len to a multiple of {split * tile}, or --config.model.attention=pallas')
  if model_cfg.attention in ('pallas', 'hopper') and mesh_sizes['sequence'] > 1 and stages > 1:
    raise MeshMismatch(f"config.model.attention={model_cfg.attention!r} cannot yet run with both "
                       f"config.mesh.stage={stages} and config.mesh.sequence="
                       f"{mesh_sizes['sequence']}: inside a pipeline stage our kernel's "
                       "gradients lose the stage's type; use config.mesh.stage=1 or "
                       "config.mesh.sequence=1, or --config.model.attention=xla")
  if model_cfg.attention == 'cudnn' and mesh_sizes['sequence'] > 1:
    raise MeshMismatch(f"config.model.attention='cudnn' cannot run with config.mesh.sequence="
                       f"{mesh_sizes['sequence']}: cuDNN's partitioner needs queries, keys and "
                       'values split alike, and sequence parallelism splits only the queries; use '
                       '--config.model.attention=pallas, or config.mesh.sequence=1')
