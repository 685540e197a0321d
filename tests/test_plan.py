"""The AOT planner and the memory settings, from the compiled program's own memory analysis on
CPU: remat policies trade temporaries for recomputation, FSDP divides the state, the planner
reports what the compiler says, and a run that cannot fit stops before allocating."""

import json

import jax
import numpy as np
import pytest

from planning import gpus
from tests.conftest import tiny_config
from training import dry_run, layout, loop, settings
from training.programs import compile_and_plan
from sharding.hierarchical import PartitionConfig
from training.state import build


def planned(mesh=None, devices=None, **changes):
  """A 6-layer model's compiled plan; on one device unless `mesh` says otherwise."""
  if mesh is None:
    devices = jax.devices()[:1]
  config = tiny_config(**(mesh or {}))
  config.model.n_layers, config.seq_len, config.batch_size = 6, 128, 8
  for key, value in changes.items():
    target, name = (config.model, key[6:]) if key.startswith('model_') else (config, key)
    target[name] = value
  return compile_and_plan(build(settings.resolve(config, devices)))


@pytest.mark.integration
def test_temporaries_decrease_none_dots_full():
  temps = {policy: planned(model_remat_policy=policy)[1].temp_bytes
           for policy in ('none', 'dots', 'full')}
  assert temps['none'] > temps['dots'] > temps['full'], temps


@pytest.mark.integration
def test_fsdp_divides_the_arguments_by_the_devices():
  one = planned()[1].argument_bytes
  eight = planned(dict(fsdp=8))[1].argument_bytes
  assert abs(eight - one / 8) <= 0.15 * one / 8, (one, eight)


@pytest.mark.integration
@pytest.mark.parametrize('target', ['', 'H100'])
def test_dry_run_prints_the_compiled_figures_and_allocates_nothing(tmp_path, capsys, monkeypatch,
                                                                   target):
  """On the CPU devices here (XLA's own FLOP count included), and for 8 H100s compiled by the
  GPU compiler (which counts none): the figures printed are the compiled program's own."""
  config = tiny_config(fsdp=8)
  config.dry_run, config.workdir = True, str(tmp_path / 'run')
  config.plan.target, config.plan.memory_gb = target, 0 if target else 1.0
  with pytest.raises(ValueError, match=r'config.dry_run=True plans without training: run '
                                       r'train.py with it, or call training.dry_run.plan'):
    loop.run(config)  # training's loop trains, or says where plans are made
  programs = []  # the program the dry run compiled (a deviceless one is not cached: one compile)
  monkeypatch.setattr(dry_run, 'compile_and_plan',
                      lambda setup: programs.append(compile_and_plan(setup)) or programs[-1])
  dry_run.plan(config)
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  (compiled, _), = programs
  memory = compiled.memory_analysis()
  assert figures['argument_bytes'] == memory.argument_size_in_bytes
  assert figures['temp_bytes'] == memory.temp_size_in_bytes
  assert figures['output_bytes'] == memory.output_size_in_bytes
  assert figures['total_bytes'] == (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                    + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  assert figures['collectives']['all-gather']['count'] > 0  # FSDP gathers weights
  assert figures['fits'] is True and figures['deviceless'] is bool(target)
  if target:
    assert figures['compiled_for'] == gpus.GPUS['H100'].device_kind
    assert figures['memory_bytes'] == gpus.usable_memory_bytes(gpus.GPUS['H100'])
    assert figures['compiled_flops'] is None
  else:
    assert figures['compiled_for'] == 'cpu' and figures['memory_bytes'] == 10**9
    assert figures['compiled_flops'] == compiled.cost_analysis()['flops']
  assert not (tmp_path / 'run').exists()


def test_a_run_that_cannot_fit_stops_before_writing_anything_naming_the_settings(tmp_path):
  config = tiny_config(fsdp=8)
  config.workdir, config.plan.memory_gb = str(tmp_path / 'run'), 0.001
  with pytest.raises(ValueError, match=r'needs .* per device.*remat_policy=.*config.mesh.fsdp'
                                       r'.*config.microbatches'):
    loop.run(config)
  assert not (tmp_path / 'run').exists()  # refused before the workdir is made


@pytest.mark.integration
def test_offload_remat_policies_compile_and_move_activations_to_host():
  _, the_plan = planned(model_remat_policy='offload_dots')
  assert the_plan.temp_bytes < planned(model_remat_policy='none')[1].temp_bytes


@pytest.mark.integration
def test_optimizer_state_offloaded_to_host_memory_gives_the_same_step(small_corpus):
  from data import chat, tokens
  import sharding
  results = []
  for offload in (False, True):
    config = tiny_config(fsdp=8)
    config.optimizer.offload_state = offload
    run = settings.resolve(config)
    setup = build(run)
    state = setup.init_state()
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim}
    assert kinds == ({'pinned_host'} if offload else {'device'})
    compiled, _ = compile_and_plan(setup)
    documents = tokens.OnTheFly(small_corpus.train, 'text', chat.Encoder(run.tokenizer))
    batches = loop.train_batches(run, documents, sharding.batch_sharding(setup.mesh))
    state, _ = compiled(state, next(batches))
    batches.close()
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim} == kinds
    results.append(jax.tree.map(np.asarray, (state.params, state.opt_state)))
  for a, b in zip(*map(jax.tree.leaves, results)):
    np.testing.assert_array_equal(a, b)


def test_auto_layout_drops_a_mesh_whose_state_cannot_fit_before_compiling_it(monkeypatch):
  """Replicas over `data` hold the whole state; FSDP about half of it each: with memory for
  three quarters of the state, only the FSDP mesh is compiled."""
  from types import SimpleNamespace
  from training import layout
  one = dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1)
  monkeypatch.setattr(layout, 'meshes', lambda n: iter([{**one, 'data': n}, {**one, 'fsdp': n}]))
  compiled = []

  def compile_and_plan(setup):  # records the mesh; fits nothing
    compiled.append(dict(setup.mesh.shape))
    return None, SimpleNamespace(fits=False, argument_bytes=1, total_bytes=1, memory_bytes=0)

  monkeypatch.setattr(layout, 'compile_and_plan', compile_and_plan)
  config = tiny_config()
  devices = jax.devices()[:2]
  state = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(
      build(settings.resolve(config, devices[:1])).abstract_state))
  config.plan.memory_gb = 0.75 * state / 2**30
  assert layout.search(settings.resolve(config, devices), log=lambda *_: None) == []
  assert compiled == [{**one, 'fsdp': 2}]


def test_auto_layout_stops_doubling_microbatches_where_none_can_fit(monkeypatch):
  """Memory c + a/M: from 100 at one microbatch and 90 at two, no number of them goes below 80,
  so with 70 the search stops after two compiles (of 8 rows it could split 8 ways); with 85 it
  goes on, and four fit."""
  from types import SimpleNamespace
  from training import layout
  one = dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1)
  monkeypatch.setattr(layout, 'meshes', lambda n: iter([one]))
  monkeypatch.setattr(layout, 'POLICIES', ('full',))
  monkeypatch.setattr(layout, '_state_fits', lambda *_: True)
  monkeypatch.setattr(layout.timing, 'predict', lambda *_: SimpleNamespace(seconds=1.0))
  for memory, expected in ((70, [1, 2]), (85, [1, 2, 4])):
    compiled = []

    def compile_and_plan(setup):
      compiled.append(setup.run.microbatches)
      total = 80 + 20 / setup.run.microbatches
      return (SimpleNamespace(as_text=str), SimpleNamespace(
          fits=total <= memory, argument_bytes=1, total_bytes=total, memory_bytes=memory))

    monkeypatch.setattr(layout, 'compile_and_plan', compile_and_plan)
    config = tiny_config()
    config.plan.memory_gb = 1.0
    layout.search(settings.resolve(config, jax.devices()[:1]), log=lambda *_: None)
    assert compiled == expected


def test_auto_layout_puts_the_state_in_host_memory_where_nothing_fits_on_the_devices(monkeypatch):
  """Adam's moments first (no number changes), then the master weights too; a run that places
  its state itself is told nothing fits, with no second search."""
  from types import SimpleNamespace
  from training import layout
  one = dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1)
  monkeypatch.setattr(layout, 'meshes', lambda n: iter([one]))
  monkeypatch.setattr(layout, 'POLICIES', ('full',))
  monkeypatch.setattr(layout, '_state_fits', lambda *_: True)
  parts = dict.fromkeys(('gemm', 'attention', 'fusion', 'other', 'launch', 'communication'), 0.0)
  monkeypatch.setattr(layout.timing, 'predict',
                      lambda *_: SimpleNamespace(seconds=1.0, breakdown=parts))
  config = tiny_config()
  config.plan.memory_gb = 1.0
  run = settings.resolve(config, jax.devices()[:1])
  placed = lambda r: (r.optimizer.master_tier, r.optimizer.mu_tier, r.optimizer.nu_tier)
  for fitting, expected in ((('device', 'host', 'host'), ('device', 'host', 'host')),
                            (('host', 'host', 'host'), ('host', 'host', 'host'))):
    tried = []

    def compile_and_plan(setup, fitting=fitting):  # fits only with the state placed so
      tried.append(placed(setup.run))
      return (SimpleNamespace(as_text=str), SimpleNamespace(
          fits=placed(setup.run) == fitting, argument_bytes=1, total_bytes=100, memory_bytes=50))

    monkeypatch.setattr(layout, 'compile_and_plan', compile_and_plan)
    logged = []
    chosen, ranked = layout.choose(run, log=logged.append)
    assert placed(chosen) == expected and len(ranked) == 1
    assert tried[0] == ('device',) * 3 and tried[-1] == expected
    assert any('again with config.optimizer.mu_tier=host' in line for line in logged)
  tried.clear()
  with pytest.raises(ValueError, match=r'fits; use more devices'):  # its own placement: kept
    layout.choose(run.replace(optimizer={'nu_tier': 'host'}), log=lambda *_: None)
  assert set(tried) == {('device', 'device', 'host')}


@pytest.mark.integration
def test_auto_layout_keeps_what_fits_fewest_microbatches_ranked_by_the_model(monkeypatch, capsys):
  """Ranked by the time model of each candidate's program; on CPU devices (no GPU of
  planning/gpus.py) against its nominal device, which the ranking says."""
  from training import layout
  # Two meshes and two policies show it, in fewer compiles.
  monkeypatch.setattr(layout, 'POLICIES', ('full', 'none'))
  one = dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1)
  monkeypatch.setattr(layout, 'meshes', lambda n: iter([{**one, 'data': n}, {**one, 'fsdp': n}]))
  config = tiny_config()
  config.plan.memory_gb = 0.003  # some layouts fit as they are, some split, some not at all
  devices = jax.devices()[:2]
  run = settings.resolve(config, devices)
  chosen, ranked = layout.choose(run, log=lambda *_: None)
  assert ranked and all(c.plan.fits for c in ranked)
  assert [c.step_s for c in ranked] == sorted(c.step_s for c in ranked)
  assert all(c.gpu is gpus.NOMINAL and c.plan.time is None for c in ranked)
  assert 'for ranking only' in capsys.readouterr().out
  split = next(c for c in ranked if c.microbatches > 1)  # this memory makes some layouts split
  fewer = layout.with_layout(run, split.mesh, split.context_parallel,
                             split.remat_policy, split.microbatches // 2)
  assert not compile_and_plan(build(fewer))[1].fits
  best = ranked[0]
  assert chosen.mesh.sizes == best.mesh and not chosen.mesh.auto
  assert (chosen.model.remat_policy, chosen.microbatches) == (best.remat_policy, best.microbatches)


def test_auto_layout_ranks_plain_replicas_against_the_configs_hierarchical_partition(
    monkeypatch):
  """With config.partition.hierarchical, a mesh with data replicas is tried both ways and the
  time model ranks them; one without replicas only plain."""
  from types import SimpleNamespace
  from training import layout
  one = dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1)
  monkeypatch.setattr(layout, 'meshes', lambda n: iter([{**one, 'data': 2, 'fsdp': n // 2},
                                                        {**one, 'fsdp': n}]))
  monkeypatch.setattr(layout, 'POLICIES', ('full',))
  monkeypatch.setattr(layout, '_state_fits', lambda *_: True)
  compiled = []

  def compile_and_plan(setup):
    weights = setup.run.partition.weights
    compiled.append((setup.mesh.shape['data'], weights))
    return SimpleNamespace(as_text=lambda: weights), SimpleNamespace(
        fits=True, argument_bytes=1, total_bytes=1, memory_bytes=2)

  monkeypatch.setattr(layout, 'compile_and_plan', compile_and_plan)
  monkeypatch.setattr(layout.timing, 'predict', lambda hlo, gpu: SimpleNamespace(
      seconds={'int8': 1.0, 'exact': 2.0}[hlo]))
  config = tiny_config(data=2, fsdp=2)
  config.plan.memory_gb = 1.0
  config.partition.update(hierarchical=True, weights='int8')
  run = settings.resolve(config, jax.devices()[:4]).replace(mesh={'auto': True})
  ranked = layout.search(run, log=lambda *_: None)
  assert sorted(compiled) == [(1, 'exact'), (2, 'exact'), (2, 'int8')]
  assert ranked[0].partition == PartitionConfig(hierarchical=True, weights='int8',
                                                gradients='exact')
  assert ranked[0].mesh['data'] == 2
  chosen = layout.with_layout(run, ranked[0].mesh, ranked[0].context_parallel,
                              ranked[0].remat_policy, ranked[0].microbatches, ranked[0].partition)
  assert chosen.partition.hierarchical and chosen.partition.weights == 'int8'


def test_auto_layout_gathers_weights_a_layer_early_where_the_model_predicts_it_pays(monkeypatch):
  """Where FSDP's gathers cross nodes on GPUs the search compiles each mesh both ways
  (config.model.prefetch_weights) and the time model picks; elsewhere the run's own."""
  import dataclasses
  from types import SimpleNamespace
  from training import layout
  run = settings.resolve(tiny_config(fsdp=4), jax.devices()[:4])
  mesh = dict(run.mesh.sizes, fsdp=4)
  on_gpus = lambda per_node: dataclasses.replace(
      run, target=SimpleNamespace(on_gpu=True, gpus_per_node=per_node))
  assert layout.prefetch_choices(on_gpus(2), mesh) == (False, True)  # two nodes of 2
  assert layout.prefetch_choices(on_gpus(4), mesh) == (False,)  # one node
  assert layout.prefetch_choices(run, mesh) == (False,)  # a CPU's
  monkeypatch.setattr(layout, 'meshes', lambda n: iter([mesh]))
  monkeypatch.setattr(layout, 'POLICIES', ('full',))
  monkeypatch.setattr(layout, '_state_fits', lambda *_: True)
  monkeypatch.setattr(layout, 'prefetch_choices', lambda run, mesh: (False, True))
  compiled = []

  def compile_and_plan(setup):
    early = setup.model_cfg.prefetch_weights
    compiled.append(early)
    return SimpleNamespace(as_text=lambda: early), SimpleNamespace(
        fits=True, argument_bytes=1, total_bytes=1, memory_bytes=2, flops=1.0)

  monkeypatch.setattr(layout, 'compile_and_plan', compile_and_plan)
  monkeypatch.setattr(layout.timing, 'predict', lambda early, gpu: SimpleNamespace(
      seconds=1.0 if early else 2.0, breakdown=dict.fromkeys(
          ('gemm', 'attention', 'fusion', 'other', 'launch', 'communication'), 0.0)))
  config = tiny_config(fsdp=4)
  config.plan.memory_gb = 1.0
  run = settings.resolve(config, jax.devices()[:4]).replace(mesh={'auto': True})
  chosen, ranked = layout.choose(run)
  assert sorted(compiled) == [False, True] and ranked[0].prefetch_weights
  assert chosen.model.prefetch_weights and not chosen.mesh.auto


def test_layout_tries_both_context_choices_where_the_kernel_meets_a_sequence_split():
  from training import layout
  run = settings.resolve(tiny_config()).replace(model={'attention': 'auto'})
  split, whole = dict(run.mesh.sizes, sequence=2), run.mesh.sizes
  assert layout.context_choices(run, split) == ('all_gather', 'ring')  # auto: ours there
  xla, pallas = (run.replace(model={'attention': kernel}) for kernel in ('xla', 'pallas'))
  assert layout.context_choices(xla, split) == ('all_gather',)  # GSPMD's
  assert layout.context_choices(pallas, split) == ('all_gather', 'ring')
  assert layout.context_choices(pallas, whole) == ('all_gather',)


def test_auto_attention_is_xla_on_cpus_and_the_time_models_fastest_that_runs_on_gpus():
  config = tiny_config()
  assert config.model.attention == 'auto'  # the default
  assert settings.resolve(config).model.attention == 'xla'  # these CPU devices
  ring = config.copy_and_resolve_references()
  ring.model.context_parallel = 'ring'
  assert settings.resolve(ring).model.attention == 'pallas'  # ours alone runs the ring
  config.plan.target, config.dry_run = 'H100', True
  config.model.compute_dtype = 'bfloat16'  # tiny_config's float32 is ours alone
  assert settings.resolve(config).model.attention == 'cudnn'
  assert layout.attention_choice(settings.resolve(config), gpus.GPUS['H100'])[1][0] == 'pallas'
  for field, value in [('mesh.sequence', 2), ('model.context_parallel', 'ring'),
                       ('model.compute_dtype', 'float32'), ('model.head_dim', 256)]:
    changed = config.copy_and_resolve_references()
    section, name = field.split('.')
    changed[section][name] = value
    assert settings.resolve(changed).model.attention == 'pallas', field  # cuDNN cannot
  config.model.attention = 'xla'  # named: kept
  run = settings.resolve(config)
  assert run.model.attention == 'xla'
  searched = run.replace(model={'attention': 'auto'}, mesh={'auto': True})
  assert layout.with_attention(searched).model.attention == 'auto'  # chosen per candidate
  laid_out = layout.with_layout(searched, run.mesh.sizes, 'all_gather', 'full', 1)
  assert laid_out.model.attention == 'cudnn' and not laid_out.mesh.auto


@pytest.mark.integration
@pytest.mark.parametrize('policy', ['none', 'full'])
def test_compiled_matmul_flops_are_the_formula_plus_what_remat_recomputes(policy):
  """Without remat, every dot of the step (xla attention's too, whole [L, S]) is the FLOP
  formula's, not halved for causality, but for the head's: the chunked head and loss multiply
  the last chunk's padding rows too (their gradient, made in the same pass, recomputes no logits:
  model/head.py). `full`
  adds each layer's forward again, less its last projection (nothing in the backward reads the
  layer's output)."""
  from planning import flops
  config = tiny_config()
  config.model.remat_policy = policy
  config = settings.resolve(config, jax.devices()[:1])
  setup = build(config)
  the_plan = compile_and_plan(setup)[1]
  cfg, tokens = setup.model_cfg, config.batch_size * config.seq_len
  without_remat = flops.flops_per_token(cfg, config.seq_len, causal=False) * tokens
  forward_again = (2 * (flops.matmul_params_per_layer(cfg) - cfg.d_model * cfg.d_ff)
                   + flops.attention_flops_per_token(cfg, config.seq_len, causal=False) / 3
                   / cfg.n_layers) * cfg.n_layers * tokens
  # The head's three matmuls a token (logits, dx, dW), on whole chunks.
  padded = -(-tokens // cfg.head_chunk) * cfg.head_chunk
  head = 2 * cfg.d_model * cfg.vocab_size
  expected = (without_remat + head * 3 * (padded - tokens)
              + (forward_again if policy == 'full' else 0))
  assert the_plan.matmul_flops == pytest.approx(expected, rel=1e-9)


def test_a_typo_is_named_not_swallowed_by_the_layout_search(tmp_path):
  """The search skips the mesh shapes the model does not divide (sharding.MeshMismatch), nothing
  else: a misspelt setting is named, not reported as "no mesh shape fits"."""
  config = tiny_config()
  config.mesh.auto, config.dry_run, config.plan.memory_gb = True, True, 1.0
  config.model.attention, config.workdir = 'flsh', str(tmp_path)
  with pytest.raises(ValueError, match=r"config.model.attention='flsh' is not one of"):
    dry_run.plan(config)
