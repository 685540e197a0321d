"""Sharded training equals single-device training, and the shards and collectives are the ones
the rules imply (checked on the arrays and the compiled HLO, not on the requested specs)."""


import math
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from data import chat, pipeline, tokenizers, tokens
from sharding import collectives, hlo
import sharding
from tests.conftest import tiny_config
from training import loop, optimizer, programs
from training import settings
from training.state import build

MESHES = {
    'data=8': dict(data=8),
    'fsdp=8': dict(fsdp=8),
    'data=2×fsdp=2×tensor=2': dict(data=2, fsdp=2, tensor=2),
    'fsdp=4×tensor=2': dict(fsdp=4, tensor=2),
    'fsdp=4×sequence=2': dict(fsdp=4, sequence=2),
}
STEPS = 4


def train_losses(config, devices, corpus):
  run = settings.resolve(config, devices)
  setup = build(run)
  state = setup.init_state()
  step = programs.compile_train_step(setup, config.batch_size, config.seq_len, config.loss.z_loss)
  byte = tokenizers.ByteTokenizer()
  batches = loop.train_batches(run, tokens.OnTheFly(corpus.train, 'text', chat.Encoder(byte)),
                                   sharding.batch_sharding(setup.mesh))
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, next(batches))
    losses.append([float(metrics['loss']), float(metrics['grad_norm'])])
  return np.array(losses), state


@pytest.fixture(scope='module')
def single_device(small_corpus):
  return train_losses(tiny_config(), jax.devices()[:1], small_corpus)


@pytest.mark.integration
@pytest.mark.parametrize('name', list(MESHES))
def test_same_loss_curve_as_one_device(name, single_device, small_corpus):
  """fp32 compute: sharded reductions reorder sums, so equality is to rtol 2e-5, atol 1e-6."""
  ref_losses, ref_state = single_device
  losses, state = train_losses(tiny_config(**MESHES[name]), jax.devices(), small_corpus)
  assert ref_losses[-1, 0] < ref_losses[0, 0]  # it is learning, so the curve means something
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


MUON_CASES = {  # name: (layout, experts, mesh, other settings)
    'round_robin fsdp=4×tensor=2': ('round_robin', 0, dict(fsdp=4, tensor=2), {}),
    'as_params fsdp=4×tensor=2': ('as_params', 0, dict(fsdp=4, tensor=2), {}),
    'round_robin MoE fsdp=2×tensor=2×expert=2': ('round_robin', 4,
                                                  dict(fsdp=2, tensor=2, expert=2), {}),
    'round_robin stage=2×fsdp=2×tensor=2': ('round_robin', 0, dict(stage=2, fsdp=2, tensor=2),
                                            {'microbatches': 2, 'model.n_layers': 4}),
}


@pytest.mark.integration
@pytest.mark.parametrize('name', list(MUON_CASES))
def test_muon_trains_sharded_as_on_one_device_its_momentum_split_as_the_weights(name, small_corpus):
  """Muon's orthogonalised matrices (round_robin: each layer's, and each expert's, on one device,
  the 2 layers padded to 8 with zero matrices; under pipeline stages each stage's own; as_params:
  as XLA partitions them) and AdamW's rest over the mesh give one device's losses and parameters (Newton–Schulz in float32: bfloat16's
  rounding would differ with the sums' order); its momentum of each matrix lies where the matrix
  does."""
  layout, experts, mesh, other = MUON_CASES[name]
  def muon(sharded, **mesh):
    c = tiny_config(**mesh)
    c.optimizer.update(name='muon', muon_ns_dtype='float32', muon_layout=layout)
    if experts:
      c.model.update(experts=experts, experts_per_token=2, expert_d_ff=32)
    for key, value in other.items():
      if sharded or key != 'microbatches':  # pipeline stages take microbatches; one device not
        c.update_from_flattened_dict({key: value})
    return c
  ref_losses, ref_state = train_losses(muon(False), jax.devices()[:1], small_corpus)
  losses, state = train_losses(muon(True, **mesh), jax.devices(), small_corpus)
  assert ref_losses[-1, 0] < ref_losses[0, 0]
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  momentum = {jax.tree_util.keystr(path): x.sharding for path, x in
              jax.tree_util.tree_leaves_with_path(state.opt_state)
              if x.ndim == 4 and x.shape[1:] == (64, 4, 16)}  # Wq's [layers, D, N, H]
  assert momentum and all(s == state.params['blocks']['attn']['wq'][...].sharding
                          for s in momentum.values()), momentum


@pytest.mark.integration
def test_qk_clip_trains_sharded_and_microbatched_as_on_one_device(small_corpus):
  """QK-clip at τ = 5 (it scales heads from the first step) with our kernel over data=2 × fsdp=2
  × tensor=2 (the data replicas apart: each one's measure, the largest taken) in 2 microbatches
  (their measures' largest) gives one device's XLA-path losses and parameters."""
  def clipped(attention, microbatches=1, **mesh):
    c = tiny_config(**mesh)
    c.model.update(qk_clip=5.0, attention=attention)
    c.microbatches = microbatches
    return c
  ref_losses, ref_state = train_losses(clipped('xla'), jax.devices()[:1], small_corpus)
  losses, state = train_losses(clipped('pallas', 2, data=2, fsdp=2, tensor=2), jax.devices(),
                               small_corpus)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  plain = train_losses(tiny_config(), jax.devices()[:1], small_corpus)[1]
  wq = lambda s: np.asarray(s.params['blocks']['attn']['wq'][...])
  assert not np.allclose(wq(ref_state), wq(plain), rtol=1e-3)  # the clip changed the weights


def muon_update_hlo(layout: str, layers: int, **mesh) -> str:
  """The compiled program of Muon's update alone (tx.update) of a tiny model with `layers`
  layers over `mesh`, with its state's and parameters' own shardings."""
  c = tiny_config(**mesh)
  c.model.n_layers = layers
  c.optimizer.update(name='muon', muon_layout=layout)
  setup = build(settings.resolve(c))
  params = optimizer.trained(setup.model_cfg, setup.abstract_state.params)[0]
  where = optimizer.trained(setup.model_cfg, setup.state_shardings.params)[0]
  opt = setup.state_shardings.opt_state
  with jax.set_mesh(setup.mesh):
    update = jax.jit(setup.tx.update, in_shardings=(where, opt, where), out_shardings=(where, opt))
    return update.lower(params, setup.abstract_state.opt_state, params).compile().as_text()


def dot_flops(hlo_text: str) -> int:
  """2 · output elements · contracted size, summed over every dot one device runs."""
  computations, times, _ = hlo.runs(hlo_text)
  total = 0
  for name, lines in computations.items():
    shapes = {i.name: i.arrays[0][1] for line in lines if (i := hlo.instruction(line))}
    for line in lines:
      if (i := hlo.instruction(line)) and i.opcode == 'dot':
        contracting = map(int, re.search(r'lhs_contracting_dims=\{([\d,]*)\}', line)[1].split(','))
        k = math.prod(shapes[i.operands[0]][d] for d in contracting)
        total += 2 * math.prod(i.arrays[0][1]) * k * times[name]
  return total


def newton_schulz_flops(m: int, n: int, steps: int = 5) -> int:
  """One matrix's: each iteration X·Xᵀ, A·A and B·X on its wide side (m ≤ n)."""
  m, n = min(m, n), max(m, n)
  return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


@pytest.mark.integration
def test_round_robin_muon_orthogonalises_each_matrix_once_moved_by_all_to_alls_only():
  """8 layers over fsdp=4 × tensor=2: round_robin's devices each run Newton–Schulz's dots on one
  layer's matrices, exactly the whole model's count / 8, and its matrices move by all-to-all
  alone (stacks alike moved together), never gathered or summed (in bf16 on GPUs:
  benchmarks/muon.py; the CPU's XLA carries bf16 collectives as f32); as_params partitions the iterations' matmuls, which
  exchange partial sums (all-reduces) and gather operands within each iteration."""
  cfg = tiny_config().model
  D, F, N, K, H = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  per_layer = (2 * newton_schulz_flops(D, N * H) + 2 * newton_schulz_flops(D, K * H)
               + 3 * newton_schulz_flops(D, F))
  round_robin = muon_update_hlo('round_robin', 8, fsdp=4, tensor=2)
  assert dot_flops(round_robin) == 8 * per_layer // 8
  ops = collectives.summary(round_robin)
  # each stack's two axes, out and back: Wq, Wk with Wv, Wo, W_gate with W_up, W_down
  assert ops['all-to-all']['count'] == 4 * 5, ops
  assert 'all-gather' not in ops and ops['all-reduce']['bytes'] < 1024, ops  # a few scalars
  as_params = collectives.summary(muon_update_hlo('as_params', 8, fsdp=4, tensor=2))
  assert as_params['all-reduce']['count'] >= 7 * 5 and as_params['all-gather']['count'], as_params


def test_whole_layout_moves_one_mesh_axis_at_a_time_onto_the_stack_padding_it_where_needed():
  """A stacked Wq [L, D, N, H] split D over fsdp and N over tensor goes to [L over (fsdp, tensor)]
  in two moves; 36 layers over fsdp=8 are padded to 40; an MoE's experts keep their axis and
  the layers take the rest; a pipeline's stage on the layers keeps them unpadded."""
  devices = jax.devices()
  mesh = sharding.make_mesh(dict(data=1, stage=1, fsdp=4, expert=1, tensor=2, sequence=1), devices)
  dims = optax.contrib.MuonDimensionNumbers((1,), (2, 3))
  wq = NamedSharding(mesh, P(None, ('fsdp', 'sequence', 'expert'), 'tensor', None))
  steps, pads = optimizer.whole_layout((32, 64, 4, 16), dims, wq)
  rest = ('sequence', 'expert')  # one device each: they stay
  assert [s.spec for s in steps] == [P('fsdp', rest, 'tensor', None),
                                     P(('fsdp', 'tensor'), rest, None, None)]
  assert pads == [(0, 0)] * 4
  mesh8 = sharding.make_mesh(dict(data=1, stage=1, fsdp=8, expert=1, tensor=1, sequence=1), devices)
  steps, pads = optimizer.whole_layout((36, 64, 4, 16), dims,
                                       NamedSharding(mesh8, P('stage', 'fsdp')))  # stage: 1
  assert [s.spec for s in steps] == [P(('stage', 'fsdp'), None, None, None)]
  assert pads[0] == (0, 4)
  moe = sharding.make_mesh(dict(data=1, stage=1, fsdp=2, expert=4, tensor=1, sequence=1), devices)
  gate = NamedSharding(moe, P(None, 'expert', 'fsdp', None))  # [L, E, D, F]
  steps, pads = optimizer.whole_layout((6, 4, 64, 32), optax.contrib.MuonDimensionNumbers(
      (2,), (3,)), gate)
  assert [s.spec for s in steps] == [P('fsdp', 'expert', None, None)] and pads == [(0, 0)] * 4
  staged = sharding.make_mesh(dict(data=1, stage=2, fsdp=4, expert=1, tensor=1, sequence=1), devices)
  steps, pads = optimizer.whole_layout((6, 64, 4, 16), dims, NamedSharding(staged, P('stage', 'fsdp')))
  assert steps == [] and pads == [(0, 0)] * 4  # 3 layers a stage: fsdp's 4 devices repeat them


def test_fsdp_splits_every_large_parameter_and_its_adam_moments_8_ways():
  setup = build(settings.resolve(tiny_config(fsdp=8)))
  state = setup.init_state()
  mu, nu = state.opt_state[1][0].mu, state.opt_state[1][0].nu  # chain(clip, adamw) → adam state
  checked = 0
  for tree in (state.params, mu, nu):
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
      if x.size < 1024:  # norm scales are replicated by design
        continue
      shards = x.addressable_shards
      assert len({s.device for s in shards}) == 8
      assert sum(s.data.size for s in shards) == x.size, jax.tree_util.keystr(path)
      assert all(s.data.size == x.size // 8 for s in shards), jax.tree_util.keystr(path)
      assert len({repr(s.index) for s in shards}) == 8  # eight different pieces, no replicas
      checked += 1
  assert checked == 3 * 9  # embed, unembed and the 7 stacked block matrices


def compiled_hlo(mesh_axes, **model):
  config = tiny_config(**mesh_axes)
  config.model.update(model)
  setup = build(settings.resolve(config))
  compiled = programs.compile_train_step(setup, config.batch_size, config.seq_len, 0.0)
  return compiled.as_text(), setup


def weight_shapes(setup):
  """Full shapes of the weight matrices: stacked arrays and one layer's slice (not the norm
  scales, [layers, D]: replicated, so their gradients are summed whole in any layout)."""
  shapes = set()
  for path, x in jax.tree_util.tree_leaves_with_path(setup.abstract_state.params):
    if x.ndim >= 2 and 'norm' not in jax.tree_util.keystr(path):
      shapes |= {x.shape, x.shape[1:]} if x.ndim >= 3 else {x.shape}
  return shapes


def test_tensor_parallel_hlo_has_row_parallel_all_reduce_and_no_full_weight_collective():
  """data=4 × tensor=2: Megatron layout. Activations are all-reduced after the row-parallel Wo
  and Wdown; weights are never gathered, and their gradients are reduced over `data` in their
  tensor-split shapes, never as full matrices (once a step: sharding/hierarchical.py's apart). (MHA, so no full weight has a split one's shape.)"""
  hlo, setup = compiled_hlo(dict(data=4, tensor=2), n_kv_heads=4)
  config = tiny_config()
  local_activation = (config.batch_size // 4, config.seq_len, config.model.d_model)
  reduced = collectives.shapes(hlo, 'all-reduce')
  assert local_activation in reduced, 'row-parallel Wo/Wdown outputs must be all-reduced'
  assert not collectives.shapes(hlo, 'all-gather'), 'tensor parallelism gathers nothing here'
  full = weight_shapes(setup)
  assert not set(reduced) & full, f'full weights in all-reduce: {set(reduced) & full}'
  wq = setup.abstract_state.params['blocks']['attn']['wq']
  # Wq's gradient, heads split, summed over data once a step for the whole stack of layers
  assert (wq.shape[0], wq.shape[1], wq.shape[2] // 2, wq.shape[3]) in reduced


def test_fsdp_hlo_gathers_each_layers_weights_inside_the_scan():
  """fsdp=8: each layer's weights are all-gathered one layer at a time (ZeRO-3), never the whole
  stack; gradients are reduced (reduce-scatter on GPU; all-reduce + slice on the CPU backend)."""
  hlo, setup = compiled_hlo(dict(fsdp=8))
  blocks = setup.abstract_state.params['blocks']
  gathered = set(collectives.shapes(hlo, 'all-gather'))
  for name in ('wq', 'wk', 'wv', 'wo'):
    w = blocks['attn'][name]
    assert w.shape[1:] in gathered and w.shape not in gathered, name
  reduced = set(collectives.shapes(hlo, 'all-reduce')) | set(collectives.shapes(hlo,
                                                                             'reduce-scatter'))
  assert blocks['mlp']['w_gate'].shape[1:] in reduced or any(
      s[-2:] == (blocks['mlp']['w_gate'].shape[1], blocks['mlp']['w_gate'].shape[2] // 8)
      for s in reduced)


def test_batch_is_split_over_data_and_fsdp_and_length_over_sequence():
  from tests.test_data import Arrays
  setup = build(settings.resolve(tiny_config(data=2, fsdp=2, sequence=2)))
  docs = pipeline.documents(Arrays([np.arange(1000, dtype=np.int32)]), seed=None)
  batches = pipeline.Batches(docs, batch_sharding=sharding.batch_sharding(setup.mesh),
                             batch_size=8, seq_len=32, pad_id=-1)
  local = batches.next_local()
  batch = batches.to_global(local)
  shards = batch['inputs'].addressable_shards
  assert {s.data.shape for s in shards} == {(2, 16)}
  assert len({repr(s.index) for s in shards}) == 8
  for s in shards:  # each device holds exactly its slice of the rows the pipeline built
    np.testing.assert_array_equal(s.data, local['inputs'][s.index])


@pytest.mark.parametrize('mesh,n,expected', [
    (dict(data=1, stage=1, fsdp=-1, expert=1, tensor=2, sequence=1), 8,
     dict(data=1, stage=1, fsdp=4, expert=1, tensor=2, sequence=1)),
    (dict(data=2, stage=1, fsdp=1, expert=1, tensor=1, sequence=-1), 8,
     dict(data=2, stage=1, fsdp=1, expert=1, tensor=1, sequence=4)),
    (dict(data=1, stage=2, fsdp=-1, expert=1, tensor=1, sequence=1), 2,
     dict(data=1, stage=2, fsdp=1, expert=1, tensor=1, sequence=1)),
])
def test_mesh_shape_resolves_minus_one(mesh, n, expected):
  assert sharding.mesh_shape(mesh, n) == expected


LOOP_HLO = """HloModule step, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[16,4])) -> (s32[], bf16[16,4]) {
  %p = (s32[], bf16[16,4]) parameter(0)
  %w = bf16[2,4]{1,0} get-tuple-element(%p), index=1
  %all-gather-start = (bf16[2,4]{1,0}, bf16[16,4]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, dimensions={0}
  %scaled = bf16[2,4]{1,0} fusion(%w), kind=kLoop, calls=%add
  %all-gather-done = bf16[16,4]{1,0} all-gather-done(%all-gather-start)
  ROOT %t = (s32[], bf16[16,4]) tuple(%i, %all-gather-done)
}

%cond (p: (s32[], bf16[16,4])) -> pred[] {
  %p = (s32[], bf16[16,4]) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,4]) -> f32[2,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %while = (s32[], bf16[16,4]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %rs = f32[2,4]{1,0} reduce-scatter(%x), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  ROOT %ar = f32[2,4]{1,0} all-reduce(%rs), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}
"""


def test_collectives_count_every_run_and_the_bytes_each_device_sends():
  """A loop body's collective runs trip-count times; an async pair counts once, with its result
  (not the -start's operand-and-result tuple) and the groups written on its -start, and is
  overlapped when compute is scheduled inside it; each replica group format gives its size; bytes
  follow the ring model."""
  found = {c.op: c for c in collectives.executed(LOOP_HLO)}
  gather, scatter, reduce = found['all-gather'], found['reduce-scatter'], found['all-reduce']
  assert (gather.executions, gather.group, gather.arrays) == (6, 8, (('bf16', (16, 4)),))
  assert (scatter.executions, scatter.group, reduce.group) == (1, 4, 2)
  assert gather.sent_bytes == 16 * 4 * 2 * 7 / 8
  assert scatter.sent_bytes == 2 * 4 * 4 * 3  # its operand is 4 results; 3 of them leave
  assert reduce.sent_bytes == 2 * (2 * 4 * 4) / 2
  assert gather.overlapped and not scatter.overlapped  # a fusion runs while the gather is out
  summary = collectives.summary(LOOP_HLO)
  assert summary['all-gather'] == {'count': 6, 'bytes': 6 * 112, 'overlapped_bytes': 672,
                                   'by_dtype': {'bf16': 672}}
  assert collectives.shapes(LOOP_HLO, 'all-gather') == [(16, 4)]


GROUPS_HLO = """HloModule groups, num_partitions=8

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %a = f32[4]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %b = f32[4]{0} all-gather(%a), channel_id=2, replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}
  %c = f32[4]{0} reduce-scatter(%b), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %d = f32[4]{0} collective-permute(%c), channel_id=4, source_target_pairs={{0,4},{5,1}}
}
"""


def test_collectives_know_their_device_groups_in_every_format():
  """Each replica-group format XLA writes gives the devices of each group, so a test or a plan
  can ask whether a collective crosses stages or nodes."""
  found = {c.op: c for c in collectives.executed(GROUPS_HLO)}
  # mesh [2, 4] over devices [2,4]T(1,0) = 0,4,1,5,2,6,3,7, so [[0,4,1,5],[2,6,3,7]]; groups
  # along axis_0 are its columns
  assert found['all-reduce'].devices == ((0, 2), (4, 6), (1, 3), (5, 7))
  assert found['all-reduce'].group == 2
  assert found['all-gather'].devices == ((0, 2), (1, 3), (4, 6), (5, 7))
  assert found['reduce-scatter'].devices == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert found['collective-permute'].devices == ((0, 4), (5, 1))
  half = lambda device: device // 4
  assert [op for op, c in found.items() if c.crosses(half)] == ['collective-permute']
