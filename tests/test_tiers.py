"""The optimizer state off the devices (training/tiers.py): a run with its master weights and
Adam's moments in host memory or in NVMe files equals the all-device run bit for bit, saves the
same checkpoints, resumes onto any placement, and refuses what it cannot do in one line."""

import contextlib
import errno
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import tiny_config
from tests.test_checkpoint import poison
from inference import sampling
from planning import offload
from planning.plan import readable_bytes
from runtime import faults
from runtime.checkpoint import Checkpointer, CheckpointWarning
import sharding
from training import loop, programs, settings, tiers
from training.state import build

STEPS = 20


def run_config(workdir, mesh=None, **optimizer):
  c = tiny_config(**(mesh or {'fsdp': 8}))
  c.workdir, c.eval_every, c.log_every, c.checkpoint_every = str(workdir), 0, 1, STEPS // 2
  c.train_steps = STEPS
  c.optimizer.update(optimizer)
  return c


def on_nvme(directory):
  return {name: f'nvme:{directory}' for name in ('master_tier', 'mu_tier', 'nu_tier')}


def final_state(workdir, config):
  step, state, _ = Checkpointer(workdir / 'checkpoints').restore_latest(
      build(settings.resolve(config)).checkpoint_state, config.model)
  assert step == config.train_steps
  return state


def assert_same_arrays(state, reference):
  paths = jax.tree_util.tree_flatten_with_path(reference)[0]
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  for (path, want), got in zip(paths, jax.tree.leaves(state)):
    assert np.array_equal(np.asarray(got), np.asarray(want)), jax.tree_util.keystr(path)


def losses(records):
  return [(r['step'], r['loss'], r['grad_norm']) for r in records if 'loss' in r]


@pytest.fixture(scope='module')
def all_device(tmp_path_factory):
  """The reference: STEPS steps with the whole state on the devices (checkpoints at 10, 20)."""
  workdir = tmp_path_factory.mktemp('all-device')
  config = run_config(workdir)
  return workdir, loop.run(config), final_state(workdir, config)


@pytest.fixture(scope='module')
def on_nvme_run(tmp_path_factory):
  workdir, nvme = tmp_path_factory.mktemp('nvme-run'), tmp_path_factory.mktemp('nvme')
  config = run_config(workdir, **on_nvme(nvme))
  return workdir, nvme, loop.run(config), final_state(workdir, config)


@pytest.mark.integration
def test_master_weights_and_both_moments_on_nvme_equal_the_all_device_run_bit_for_bit(
    all_device, on_nvme_run):
  _, records, reference = all_device
  _, nvme, tiered_records, state = on_nvme_run
  assert losses(tiered_records) == losses(records) and len(losses(records)) == STEPS
  assert_same_arrays(state, reference)  # parameters, both moments, the counts: the checkpoint
  assert list(nvme.iterdir()) == []  # the files were the run's scratch, removed at its end
  # sample.py and export.py read the run's fp32 master weights, whatever its tiers
  loaded = sampling.load(str(on_nvme_run[0]))
  for got, want in zip(jax.tree.leaves(nnx.state(loaded.model)), jax.tree.leaves(state.params)):
    assert np.array_equal(np.asarray(got), np.asarray(want))


PLACEMENTS = {'to the devices': {},
              'to host memory': {name: 'host' for name in tiers.SETTING.values()},
              'to other tiers past a damaged checkpoint': {'mu_tier': 'host'}}


@pytest.mark.integration
@pytest.mark.parametrize('placement', PLACEMENTS)
def test_a_checkpoint_resumes_onto_another_placement_exactly(all_device, on_nvme_run, tmp_path,
                                                             placement):
  """A tiered run's checkpoint resumed with the state on the devices, an all-device run's with it
  in host memory, and a tiered run's with Adam's first moment alone in host memory after a bit of
  its newest checkpoint's pieces flipped (set aside by its checksums): steps 11-20 as the
  all-device run took them."""
  source = all_device[0] if placement == 'to host memory' else on_nvme_run[0]
  workdir = tmp_path / 'resumed'
  shutil.copytree(source, workdir)
  newest = workdir / 'checkpoints' / str(STEPS)
  damaged = placement.endswith('damaged checkpoint')
  if damaged:  # a bit of the largest chunk of Adam's first moment
    flip_a_bit(max((f for f in (newest / 'pieces').rglob('*') if f.is_file() and '.mu.' in str(f)),
                   key=lambda f: f.stat().st_size))
  else:
    shutil.rmtree(newest)  # back to step 10
  config = run_config(workdir, **PLACEMENTS[placement])
  with pytest.warns(CheckpointWarning, match='arrays differ from their checksums: opt_state') \
      if damaged else contextlib.nullcontext():
    records = loop.run(config)
  assert losses(records) == losses(all_device[1])[STEPS // 2:]
  assert_same_arrays(final_state(workdir, config), all_device[2])


def flip_a_bit(victim):
  """One bit in the middle of a file, as a disk or another program could."""
  with open(victim, 'r+b') as f:
    f.seek(victim.stat().st_size // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.integration
def test_a_tier_file_damaged_between_steps_stops_the_run_before_anything_made_from_it_is_saved(
    all_device, tmp_path, monkeypatch):
  """A bit of Adam's second moment flipped on disk after step 12, read back at step 13: one line
  naming the file, no checkpoint made from it, the tier's files gone; run again, it resumes from
  step 10 exactly. (A checkpoint taking a damaged file: the groups' test below.)"""
  after, kept = 12, [10]
  workdir, nvme = tmp_path / 'w', tmp_path / 'nvme'
  config = run_config(workdir, **on_nvme(nvme))
  update = tiers.Engine.__call__

  def damaging(engine, state, batch):
    out = update(engine, state, batch)
    if engine.count == after:
      flip_a_bit(max(nvme.glob('meshlm-*/process-0/nu/nu-*.bin'), key=lambda f: f.stat().st_size))
    return out
  monkeypatch.setattr(tiers.Engine, '__call__', damaging)
  with pytest.raises(faults.Fault, match=r'config\.optimizer\.nu_tier: \S+/nu-\d+\.bin changed on '
                                          'disk since this run wrote it .* resume from the newest'):
    loop.run(config)
  assert sorted(int(c.name) for c in (workdir / 'checkpoints').iterdir()) == kept
  assert list(nvme.iterdir()) == []
  monkeypatch.undo()
  records = loop.run(config)
  assert losses(records) == losses(all_device[1])[kept[0]:]
  assert_same_arrays(final_state(workdir, config), all_device[2])


@pytest.mark.integration
def test_groups_that_cut_parameters_into_rows_over_data_replicas_and_tensor_splits_update_as_one(
    tmp_path, monkeypatch):
  """Groups of 3 kB (a stacked parameter's shard cut into slices of rows, one parameter alone in
  a group) on data=2 × fsdp=2 × tensor=2, where each distinct shard is updated on one device and
  copied to its replica, two microbatches a step: three steps equal the compiled all-device
  step's, state and all."""
  mesh = {'data': 2, 'fsdp': 2, 'tensor': 2}
  reference = build(settings.resolve(run_config(tmp_path / 'device', mesh)))
  B, L = 8, 32
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, 259, (B, L)).astype(np.int32)
  batch = jax.device_put({'inputs': inputs, 'targets': np.roll(inputs, -1, 1),
                          'positions': np.tile(np.arange(L, dtype=np.int32), (B, 1)),
                          'segment_ids': np.ones((B, L), np.int32),
                          'weights': np.ones((B, L), np.float32)},
                         sharding.batch_sharding(reference.mesh))
  step = programs.compile_train_step(reference, B, L, 1e-4, microbatches=2)
  reference_state = reference.init_state()
  for _ in range(3):
    reference_state, _ = step(reference_state, batch)

  monkeypatch.setattr(tiers, 'GROUP_BYTES', 3000)
  setup = build(settings.resolve(run_config(
      tmp_path / 'tiered', mesh, master_tier=f'nvme:{tmp_path}/nvme', mu_tier='host')))
  engine = tiers.Engine(setup, programs.compile_gradient_step(setup, B, L, 1e-4, microbatches=2))
  shards = engine.shards
  assert any(len(s.devices) > 1 for s in shards)  # replicas over data: copied, not updated twice
  cut = {p.shard for group in engine.groups for p in group
         if (p.start, p.stop) != (0, shards[p.shard].rows)}
  assert cut and any(len(group) == 1 for group in engine.groups)
  try:
    tiered = engine.load(setup.init_state())
    for _ in range(3):
      before, (tiered, _) = tiered, engine(tiered, batch)
      # the devices' copy of the master weights: freed before the update made the new one
      assert all(x.is_deleted() for x in jax.tree.leaves(before.params))
    # its checkpoint, read off the tiers a chunk at a time, is the all-device run's state
    checkpointer = Checkpointer(tmp_path / 'checkpoints')
    state, pieces, read_out = engine.saving(tiered)
    checkpointer.save(3, state, {}, {}, pieces, read_out)
    checkpointer.close()
    assert sorted(p.name for p in (tmp_path / 'checkpoints/3/pieces').glob('*.json')) == [
        'arrays.json', 'checksums-0.json']
    restored = Checkpointer(tmp_path / 'checkpoints').restore_latest(
        reference.checkpoint_state, reference.run.model)
    assert restored[0] == 3
    assert_same_arrays(restored[1], reference_state)
    flip_a_bit(max((tmp_path / 'nvme').glob('meshlm-*/process-0/master/*.bin'),
                   key=lambda f: f.stat().st_size))  # damaged: no checkpoint may take it
    checkpointer = Checkpointer(tmp_path / 'checkpoints')
    damaged = r'^config.optimizer.master_tier: \S+/master-\d+\.bin changed on disk'
    with pytest.raises(faults.Fault, match=damaged):
      state, pieces, read_out = engine.saving(tiered)
      checkpointer.save(4, state, {}, {}, pieces, read_out)
      checkpointer.close()
    assert Checkpointer(tmp_path / 'checkpoints', read_only=True).steps() == [3]
  finally:
    engine.close()


@pytest.mark.parametrize('setting, value, expected', [
    ('mu_tier', 'nvme:relative/dir', 'give the NVMe directory as an absolute path'),
    ('nu_tier', 'disk', "config.optimizer.nu_tier='disk' is not a tier"),
    ('offload_state', True, 'use one'),
])
def test_a_tier_setting_it_cannot_use_is_named_before_anything_is_built(tmp_path, setting,
                                                                        value, expected):
  config = run_config(tmp_path / 'w', mu_tier='host')
  config.optimizer[setting] = value
  with pytest.raises(ValueError, match=expected):
    settings.resolve(config)
  assert not (tmp_path / 'w').exists()


def test_what_tiers_do_not_run_with_yet_and_a_directory_they_cannot_write_are_refused(tmp_path):
  config = run_config(tmp_path / 'w', mu_tier='host')
  config.model.lora_rank, config.init_from = 4, 'random'
  with pytest.raises(ValueError, match='lora_rank=4 .* do not run with yet'):
    loop.run(config)
  blocked = tmp_path / 'a-file'
  blocked.write_text('mine')
  config = run_config(tmp_path / 'w', mu_tier=f'nvme:{blocked}/state')
  with pytest.raises(ValueError, match='cannot be written here'):
    loop.run(config)
  assert blocked.read_text() == 'mine' and not (tmp_path / 'w').exists()


def test_a_host_tier_larger_than_the_hosts_memory_is_refused_in_one_line(tmp_path, monkeypatch):
  setup = build(settings.resolve(run_config(tmp_path / 'w', mu_tier='host', nu_tier='host')))
  need = 2 * sum(shard.nbytes for shard in tiers.shards(setup))  # both moments
  monkeypatch.setattr(faults, 'available_host_memory', lambda: need)
  tiers.check_room(setup)  # room enough
  monkeypatch.setattr(faults, 'available_host_memory', lambda: need - 1)
  with pytest.raises(ValueError, match=f'the host tier holds {readable_bytes(need)} of the state '
                                       'on this node, .* put some of it on NVMe'):
    tiers.check_room(setup)


def test_a_disk_that_refuses_the_tier_files_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
  setup = build(settings.resolve(run_config(tmp_path / 'w', **on_nvme(tmp_path / 'nvme'))))
  share = tiers.shards(setup)
  need = 3 * sum(shard.nbytes for shard in share)  # master weights and both moments
  monkeypatch.setattr(shutil, 'disk_usage', lambda path: shutil._ntuple_diskusage(
      need, need - 1, 1))  # one byte short: refused before anything is made
  with pytest.raises(ValueError, match=f"has 0.00 MiB free, .* needs {readable_bytes(need)}"):
    tiers.check_room(setup)
  monkeypatch.undo()

  def full(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(os, 'posix_fallocate', full)
  with pytest.raises(faults.Fault, match=r'config\.optimizer\.master_tier: writing the NVMe '
                                          r"tier's .*No space left on device; free space"):
    tiers.Engine(setup, None)
  assert list((tmp_path / 'nvme').iterdir()) == []


def test_the_plan_counts_the_shards_the_engine_updates_and_charges_their_streams(tmp_path):
  """Each device updates the distinct shards it is the first to hold (replicas over data: the
  first's); the plan's bytes are those, its devices hold no optimizer state, and the update after
  the step is a part of its predicted time where one is predicted."""
  config = run_config(tmp_path / 'w', {'data': 2, 'fsdp': 4},
                      master_tier=f'nvme:{tmp_path}/nvme', mu_tier='host')
  setup = build(settings.resolve(config))
  engine_owned = dict.fromkeys(range(8), 0)
  position = {d: i for i, d in enumerate(setup.mesh.devices.flat)}
  for shard in tiers.shards(setup):
    engine_owned[position[shard.devices[0]]] += shard.nbytes
  assert offload.owned_bytes(setup.checkpoint_state.params, list(setup.mesh.devices.flat),
                             8) == engine_owned
  assert 0 in engine_owned.values()  # data's second replica updates nothing: it is copied to
  _, plan = programs.compile_and_plan(setup)
  state_bytes = sum(engine_owned.values())
  assert plan.optimizer_bytes == 0 and plan.tiers['placement']['nu'] == 'device'
  assert plan.tiers['nvme_bytes_per_node'] == state_bytes  # the master weights, one kind
  assert plan.tiers['host_bytes_per_node'] == state_bytes  # mu
  assert plan.tiers['pcie_bytes'] == 2 * max(engine_owned.values())
  groups = int(3 * plan.tiers['group_bytes'] * plan.tiers['owned_bytes'] / plan.tiers['node_bytes'])
  # the master weights off the devices: the update's new copy takes the place of the old
  assert plan.update_bytes == plan.argument_bytes + plan.output_bytes + groups


@pytest.mark.integration
def test_in_bf16_the_devices_hold_a_bf16_copy_of_master_weights_kept_off_them(tmp_path):
  """bf16 compute: with the moments alone off the devices the run is the all-device run's, bit
  for bit; with the master weights off them too, the devices hold a bf16 copy (what the step
  reads: the norm scales rounded too, Megatron's mixed precision) and the checkpoint the fp32
  master weights, and the losses stay within 0.1% of the all-device run's over 20 steps."""
  def run(name, **optimizer):
    config = run_config(tmp_path / name, **optimizer)
    config.model.compute_dtype, config.checkpoint_every = 'bfloat16', STEPS
    return config, [loss for _, loss, _ in losses(loop.run(config))]
  _, reference = run('device')
  assert run('moments', mu_tier='host', nu_tier='host')[1] == reference
  config, copied = run('master', master_tier='host', mu_tier='host', nu_tier='host')
  np.testing.assert_allclose(copied, reference, rtol=1e-3)
  assert copied != reference  # the copy is what the step read
  setup = build(settings.resolve(config))
  assert {x.dtype for x in jax.tree.leaves(setup.abstract_state.params)} == {np.dtype('bfloat16')}
  saved = final_state(tmp_path / 'master', config)
  assert {x.dtype for x in jax.tree.leaves(saved.params)} == {np.dtype('float32')}


@pytest.mark.integration
def test_a_non_finite_step_is_skipped_on_the_tiers_as_on_the_devices(tmp_path, monkeypatch):
  """A step whose loss is NaN (step 3 of 6) updates nothing on the tiers either: the bad-step
  count, the losses and the final checkpoint (AdamW's count one short) are the all-device run's."""
  monkeypatch.setattr(loop.pipeline, 'train_batches', poison({3}))
  runs = []
  for name, optimizer in (('device', {}), ('tiered', on_nvme(tmp_path / 'nvme'))):
    config = run_config(tmp_path / name, **optimizer)
    config.train_steps, config.checkpoint_every, config.max_bad_steps = 6, 6, 2
    with pytest.warns(RuntimeWarning, match='step 3: the loss or gradient is not finite'):
      records = loop.run(config)
    runs.append((records, final_state(tmp_path / name, config)))
  (records, reference), (tiered_records, state) = runs
  assert [r['bad_steps'] for r in tiered_records] == [0, 0, 1, 1, 1, 1]
  assert np.isnan(tiered_records[2]['loss'])
  assert [r['loss'] for r in tiered_records if r['step'] != 3] == [
      r['loss'] for r in records if r['step'] != 3]
  assert_same_arrays(state, reference)
