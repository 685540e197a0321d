"""The optimizer state off the devices (config.optimizer.master_tier, mu_tier, nu_tier: 'host' or
'nvme:DIR'; ZeRO-Offload's and ZeRO-Infinity's tiers). The compiled program computes a step's
gradients and their global norm (training/programs.py: compile_gradient_step); `Engine` then
updates the state a group at a time (GROUP_BYTES of it: whole parameters, or a slice of a stacked
one's layers): the group read from its tier and brought to the device that owns each shard,
clipped and updated there by the same optax AdamW as the all-device step's (elementwise, so a
group's update is the whole one's, bit for bit), and written back, the next group's read and the
last one's write in flight meanwhile. Each process keeps one copy of each distinct shard its
devices hold, updated on the first of them and copied to the rest.

The devices keep the parameters the step reads (the master weights, or with them off the devices
a copy in the compute dtype) and the step count. Checkpoints hold the arrays an all-device run's
does, by the same names, so a run resumes onto any placement: what a host or NVMe tier holds is
read off it a chunk at a time as the checkpoint's pieces (`Engine.saving`, runtime/pieces.py),
and read back into the tiers the same way (`Engine.restoring`), never whole in memory. The files
under nvme:DIR are the run's scratch, never its record: a run starts them from its checkpoint
(or its fresh state) and removes them when it ends.

  engine = Engine(setup, compiled_gradients)   # programs.compile_gradient_step's
  step, state, data = state_lib.initial_state(setup, checkpointer, log, engine.restoring())
  state = engine.load(state)                   # the rest of the state: it leaves the devices
  state, metrics = engine(state, batch)        # a step, as the compiled train step's
  kept, pieces, read_out = engine.saving(state)   # what a checkpoint saves of it
  checkpointer.save(step, kept, data, config, pieces, read_out)
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import os
import pathlib
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from planning import offload
from planning.plan import readable_bytes
from runtime import checkpoint, faults
from runtime.pieces import Pieces
from training import optimizer
from configs.base import HOST, NVME
from training.optimizer import trained
from training.state import Setup

GROUP_BYTES = offload.GROUP_BYTES  # the state a group holds (planning/offload.py says why)
KINDS = ('master', 'mu', 'nu')  # what a tier holds, by the setting that places it
SETTING = {'master': 'master_tier', 'mu': 'mu_tier', 'nu': 'nu_tier'}


def check_room(setup: Setup) -> None:
  """Each NVMe directory can be made here and has room for this process's share of what it
  holds, and the host's memory for what the host tier holds of this node's: ValueError naming it
  otherwise (training only: a plan allocates nothing)."""
  need, host, share = {}, 0, _process_bytes(setup)  # each kind's: the same bytes
  for kind, (tier, directory) in setup.run.optimizer.placements.items():
    if tier == NVME:
      need[directory] = need.get(directory, 0) + share
    elif tier == HOST:
      host += share
  for directory, size in need.items():
    _check_directory(directory, size)
  if host:
    _check_host_memory(host, _processes_on_this_node(setup))


def _processes_on_this_node(setup: Setup) -> int:
  """On GPUs, a node's GPUs over this process's (scripts/slurm: a process a GPU); else 1."""
  target = setup.run.target
  return max(1, target.gpus_per_node // jax.local_device_count()) if target.on_gpu else 1


def _check_host_memory(share: int, processes: int) -> None:
  available = faults.available_host_memory()
  if share * processes > available:
    each = f' ({processes} processes, {readable_bytes(share)} each)' if processes > 1 else ''
    raise ValueError(f"config.optimizer: the host tier holds {readable_bytes(share * processes)} "
                     f"of the state on this node{each}, and its memory has "
                     f"{readable_bytes(available)} available; put some of it on NVMe "
                     "('nvme:DIR' in config.optimizer.master_tier, mu_tier or nu_tier), or use "
                     'more nodes')


def _check_directory(directory: pathlib.Path, size: int) -> None:
  where = directory
  while not where.exists():  # its nearest existing parent decides whether it can be made
    where = where.parent
  if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
    raise ValueError(f"config.optimizer: the NVMe tier's directory {directory} cannot be written "
                     f'here ({where} is not a writable directory); name one this user can write')
  free = shutil.disk_usage(where).free
  if free < size:
    raise ValueError(f"config.optimizer: the NVMe tier's directory {directory} has "
                     f'{readable_bytes(free)} free, and this process\'s share of the state there '
                     f'needs {readable_bytes(size)}; free some, or name a larger disk')


def _process_bytes(setup: Setup) -> int:
  """The bytes of one kind of state (master weights or a moment) this process keeps."""
  return sum(shard.nbytes for shard in shards(setup))


@dataclasses.dataclass(frozen=True)
class Shard:
  """One distinct shard of a trained parameter among this process's devices."""
  leaf: int  # the parameter's place among the trained ones, in jax.tree order
  index: tuple  # its slices of the parameter
  devices: tuple  # the devices holding it: the first updates it, the rest get copies
  shape: tuple
  dtype: np.dtype

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

  @property
  def rows(self) -> int:
    return self.shape[0] if self.shape else 1


def _key(index) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def shards(setup: Setup) -> list[Shard]:
  """Every distinct shard of the trained parameters on this process's devices, leaf by leaf."""
  params = trained(setup.model_cfg, setup.checkpoint_state.params)[0]  # the master weights
  order = {d: i for i, d in enumerate(setup.mesh.devices.flat)}  # the first in the mesh updates
  out = []
  for leaf, p in enumerate(jax.tree.leaves(params)):
    for index, holders in offload.distinct_shards(
        p.sharding.addressable_devices_indices_map(p.shape), order):
      shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, p.shape))
      out.append(Shard(leaf, index, holders, shape, p.dtype))
  return out


@dataclasses.dataclass(frozen=True)
class Part:
  """Rows [start, stop) of a shard (all of a scalar's): what a group updates of it."""
  shard: int
  start: int
  stop: int


def groups(shards: list[Shard], group_bytes: int) -> list[list[Part]]:
  """The shards cut into groups of about `group_bytes` of state (three copies: master weights
  and both moments), a stacked leaf's rows split where one shard holds more."""
  out, group, size = [], [], 0
  for i, shard in enumerate(shards):
    row = 3 * shard.nbytes // shard.rows
    step = max(1, group_bytes // max(row, 1))
    for start in range(0, shard.rows, step):
      stop = min(shard.rows, start + step)
      if group and size + (stop - start) * row > group_bytes:
        out.append(group)
        group, size = [], 0
      group.append(Part(i, start, stop))
      size += (stop - start) * row
  return out + ([group] if group else [])


def _rows(x, part: Part, shard: Shard):
  return x if not shard.shape or (part.start, part.stop) == (0, shard.rows) else \
      x[part.start:part.stop]


class DeviceTier:
  """A kind of state on the devices: each shard on the device that updates it."""

  def __init__(self, shards):
    self.shards, self.arrays, self.pending = shards, {}, {}

  def put(self, i: int, data) -> None:
    self.arrays[i] = jax.device_put(data, self.shards[i].devices[0], may_alias=False)

  def zero(self, i: int) -> None:
    shard = self.shards[i]
    self.arrays[i] = jnp.zeros(shard.shape, shard.dtype, device=shard.devices[0])

  def read(self, part: Part):
    return _rows(self.arrays[part.shard], part, self.shards[part.shard])

  def write(self, part: Part, value) -> None:
    self.pending.setdefault(part.shard, []).append(value)

  def commit(self) -> None:
    """The written parts made the shards (after every group: a part read is never overwritten
    before its group has read it)."""
    for i, parts in self.pending.items():
      self.arrays[i] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    self.pending = {}

  def full(self, i: int):
    return self.arrays[i]

  def close(self) -> None:
    self.arrays = {}


class HostTier(DeviceTier):
  """A kind of state in this process's memory, one numpy array a shard."""

  def put(self, i: int, data) -> None:
    self.arrays[i] = np.array(data, dtype=self.shards[i].dtype)

  def zero(self, i: int) -> None:
    self.arrays[i] = np.zeros(self.shards[i].shape, self.shards[i].dtype)

  def put_rows(self, i: int, start: int, rows) -> None:
    """Rows [start, start + len(rows)) of shard i (a checkpoint's, read a chunk at a time)."""
    if i not in self.arrays:
      self.arrays[i] = np.empty(self.shards[i].shape, self.shards[i].dtype)
    if self.shards[i].shape:
      self.arrays[i][start:start + len(rows)] = rows
    else:
      self.arrays[i][...] = rows

  def seal(self, i: int) -> None:
    """Shard i is whole (put_rows has written all of it)."""

  def read(self, part: Part):
    return jax.device_put(_rows(self.arrays[part.shard], part, self.shards[part.shard]),
                          self.shards[part.shard].devices[0])

  def write(self, part: Part, value) -> None:
    _rows(self.arrays[part.shard], part, self.shards[part.shard])[...] = np.asarray(value)

  def commit(self) -> None:
    pass


def _words(x):
  """An array's items as flat uint32 words (narrower ones widened, 8-byte ones split)."""
  size = np.dtype(x.dtype).itemsize
  flat = x.reshape(-1)
  if size < 4:
    return jax.lax.bitcast_convert_type(flat, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(
        jnp.uint32)
  return jax.lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)


@jax.jit
def fingerprint(x):
  """Two sums of a part's words modulo 2³², the second weighting each by its place (so a swap
  shows), on the part's device: a pass over it at the device's memory bandwidth."""
  words = _words(x)
  places = jnp.arange(1, words.size + 1, dtype=jnp.uint32)
  return jnp.stack([words.sum(dtype=jnp.uint32), (words * places).sum(dtype=jnp.uint32)])


def will_need(fd: int, offset: int, size: int) -> None:
  """Asks the kernel to read a file's range now (POSIX_FADV_WILLNEED): all of it queued at once,
  where touching it through a memory map faults it in a readahead window at a time, which read
  an H100 machine's disk onto its GPU at 58% of dd's rate (benchmarks/results/nvme-h100-machine
  .json). On this project's 2-core VM it took a group's reads from 1.17 to 1.34 GB/s (medians of
  five)."""
  if size and hasattr(os, 'posix_fadvise'):  # not on macOS: the map's faults read it there
    os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)


class NvmeTier(HostTier):
  """A kind of state in files under an NVMe directory: one a parameter, its distinct shards on
  this process one after another (a shard's rows contiguous), read and written through numpy's
  memory maps, a part's range asked of the disk whole before it is read (`will_need`). The
  files' blocks are allocated when made, so a full disk is an error there, never a fault of a
  write through the map.

  A file is the run's only copy of its state between checkpoints, and nothing else guards it, so
  each part carries a fingerprint of what was last written (computed on the device, where the
  part is anyway): a part that reads back otherwise (`verify`, after each update, and before a
  checkpoint takes a shard) stops the run with a Fault naming the file, before anything made
  from it is saved."""

  def __init__(self, shards, directory: pathlib.Path, kind: str, parts=()):
    super().__init__(shards)
    self.kind, self.parts, self.expected, self.checks = kind, {}, {}, []
    for part in parts:  # the engine's groups cut each shard so
      self.parts.setdefault(part.shard, []).append(part)
    try:
      self._make(shards, directory, kind)
    except OSError as e:  # the disk refused (full, read-only, not ours): one line naming it
      self.close()
      raise faults.on_disk(e, f"config.optimizer.{SETTING[kind]}: writing the NVMe tier's "
                              f'{directory}') or e from None

  def _make(self, shards, directory: pathlib.Path, kind: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    by_leaf = {}
    for i, shard in enumerate(shards):
      by_leaf.setdefault(shard.leaf, []).append(i)
    self.files, self.fds, self.where = [], [], {}
    for leaf, members in by_leaf.items():
      shape = (len(members), *shards[members[0]].shape)
      path = directory / f'{kind}-{leaf:04d}.bin'
      size = int(np.prod(shape)) * np.dtype(shards[members[0]].dtype).itemsize
      with open(path, 'wb') as f:
        if size:
          os.posix_fallocate(f.fileno(), 0, size)
      stack = np.memmap(path, dtype=shards[members[0]].dtype, mode='r+', shape=shape)
      self.files.append(stack)
      self.fds.append(os.open(path, os.O_RDONLY))
      for j, i in enumerate(members):
        self.arrays[i] = stack[j]
        self.where[i] = (self.fds[-1], j * shards[i].nbytes, path)  # its file and first byte

  def read(self, part: Part):
    fd, offset, _ = self.where[part.shard]
    row = self.shards[part.shard].nbytes // self.shards[part.shard].rows
    will_need(fd, offset + part.start * row, (part.stop - part.start) * row)
    value = super().read(part)
    if part in self.expected:
      self.checks.append((part, jnp.array_equal(fingerprint(value), self.expected[part])))
    return value

  def write(self, part: Part, value) -> None:
    self.expected[part] = fingerprint(value)
    super().write(part, value)

  def put(self, i: int, data) -> None:
    data = np.asarray(data)
    self.arrays[i][...] = data
    for part in self.parts.get(i, ()):
      self.expected[part] = self._fingerprint(part, data)

  def zero(self, i: int) -> None:
    for part in self.parts.get(i, ()):  # the files were made anew: allocated blocks read as zeros
      self.expected[part] = np.zeros(2, np.uint32)

  def seal(self, i: int) -> None:
    for part in self.parts.get(i, ()):  # what the file holds now is what this run wrote
      self.expected[part] = self._fingerprint(part, self.arrays[i])

  def verify(self) -> None:
    """Every part read since the last call read back as it was written: a Fault naming the file
    otherwise."""
    checks, self.checks = self.checks, []
    for part, same in checks:
      if not bool(same):
        self._damaged(part)

  def full(self, i: int):
    for part in self.parts.get(i, ()):  # what a checkpoint takes is what this run wrote
      if not jnp.array_equal(self._fingerprint(part, self.arrays[i]), self.expected[part]):
        self._damaged(part)
    return self.arrays[i]

  def _fingerprint(self, part: Part, host):
    """The fingerprint of a part of a host copy of its shard, taken on the part's device (one
    part on it at a time: numpy's pass over a 70b's state would take minutes)."""
    shard = self.shards[part.shard]
    return fingerprint(jax.device_put(_rows(host, part, shard), shard.devices[0]))

  def _damaged(self, part: Part):
    raise faults.Fault(
        f'config.optimizer.{SETTING[self.kind]}: {self.where[part.shard][2]} changed on disk '
        f'since this run wrote it (rows {part.start}:{part.stop} of a shard read back '
        'otherwise): the disk or another program damaged it, and the run stopped before saving '
        'anything made from it; check the disk, then run again to resume from the newest '
        'checkpoint')

  def close(self) -> None:
    for fd in getattr(self, 'fds', []):
      os.close(fd)
    self.arrays, self.files, self.fds, self.where, self.checks = {}, [], [], {}, []


def scratch(directory: pathlib.Path, workdir: str) -> pathlib.Path:
  """This process's directory under an NVMe tier's: named after the run's workdir (one run holds
  it at a time), so runs sharing a disk never share files."""
  tag = hashlib.sha256(str(pathlib.Path(workdir).expanduser().resolve()).encode()).hexdigest()[:12]
  return directory / f'meshlm-{tag}' / f'process-{jax.process_index()}'


class Readers:
  """The checkpoints reading the tiers in the background: `none` is set while there are none."""

  def __init__(self):
    self.lock, self.reading, self.none = threading.Lock(), 0, threading.Event()
    self.none.set()

  def start(self):
    """One more; returns what it calls when done (once: later calls do nothing)."""
    with self.lock:
      self.reading += 1
      self.none.clear()
    done = threading.Event()

    def read_out():
      with self.lock:
        if not done.is_set():
          done.set()
          self.reading -= 1
          if not self.reading:
            self.none.set()
    return read_out


class Engine:
  """A tiered run's train step: (state, batch) → (state, metrics), as the compiled one's; the
  state it takes and returns is the devices' (parameters, step, bad steps; no optimizer state)."""

  def __init__(self, setup: Setup, compiled_gradients):
    self.setup, self.compiled = setup, compiled_gradients
    self.shards = shards(setup)
    self.groups = groups(self.shards, GROUP_BYTES)
    self.tiers, placed = {}, setup.run.optimizer.placements
    self.scratch = sorted({scratch(directory, setup.run.workdir)
                           for tier, directory in placed.values() if tier == NVME})
    try:
      for kind, (tier, directory) in placed.items():
        self.tiers[kind] = (
            NvmeTier(self.shards, scratch(directory, setup.run.workdir) / kind, kind,
                     [part for group in self.groups for part in group])
            if tier == NVME else (HostTier if tier == HOST else DeviceTier)(self.shards))
    except BaseException:  # a disk that refused: nothing of this run's left on it
      self._remove_scratch()
      raise
    self.params = trained(setup.model_cfg, setup.checkpoint_state.params)[0]  # the master's
    self.copy_dtypes = [x.dtype for x in  # what the devices hold of them
                        jax.tree.leaves(trained(setup.model_cfg, setup.abstract_state.params)[0])]
    self.names = {jax.tree_util.keystr(path): leaf for leaf, (path, _) in
                  enumerate(jax.tree_util.tree_flatten_with_path(self.params)[0])}
    self.decays = jax.tree.leaves(optimizer.decay_mask(self.params))
    self.abstract = {checkpoint.name_of(path): a for path, a in
                     jax.tree_util.tree_leaves_with_path(setup.checkpoint_state)}
    self.off_devices = self._off_devices()  # {checkpoint name: (kind, trained leaf)}
    self.first_holder = self._first_holders(setup.mesh)
    self.readers = Readers()  # checkpoints reading the tiers
    self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix='meshlm-tiers')
    self.count = 0  # updates applied: AdamW's step count

  def _off_devices(self) -> dict[str, tuple[str, int]]:
    """{a checkpoint's name of an array a host or NVMe tier holds: (its kind, its trained
    parameter)}."""
    tiered = {kind for kind in KINDS if type(self.tiers[kind]) is not DeviceTier}
    out = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(self.setup.checkpoint_state.opt_state):
      if (kind := _kind(path)) in tiered and kind in ('mu', 'nu'):
        out[f'opt_state.{checkpoint.name_of(path)}'] = (kind, self._leaf_of(path, kind))
    if 'master' in tiered:
      for leaf, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(self.params)[0]):
        out[f'params.{checkpoint.name_of(path)}'] = ('master', leaf)
    assert set(out) <= set(self.abstract), set(out) - set(self.abstract)
    return out

  def _first_holders(self, mesh) -> dict:
    """{(trained leaf, index key): whether this process holds the index's first holder in
    the mesh}: the one process of the job that saves and restores that shard."""
    order = {d: i for i, d in enumerate(mesh.devices.flat)}
    return {(leaf, _key(index)): holders[0].process_index == jax.process_index()
            for leaf, p in enumerate(jax.tree.leaves(self.params))
            for index, holders in offload.distinct_shards(
                p.sharding.devices_indices_map(p.shape), order)}

  def restoring(self) -> dict[str, Pieces]:
    """The moments on a host or NVMe tier as a checkpoint's pieces to restore into (a chunk of a
    shard at a time, never the whole state in memory: runtime/pieces.py); `load` then finds
    them there."""
    return {name: pieces for name, pieces in self._pieces('put_rows').items()
            if self.off_devices[name][0] in ('mu', 'nu')}

  def load(self, state):
    """The devices' state from a restored one (its moments restored into the tiers already where
    `restoring`'s pieces took them, None in it), or a fresh one without its optimizer state
    (Setup.init_state's): each shard of the master weights and moments put on its tier (fresh
    moments: zeros), the devices keeping the parameters and step count."""
    leaves = jax.tree.leaves(trained(self.setup.model_cfg, state.params)[0])
    moments = None if state.opt_state is None else _moments(state.opt_state)
    for i, shard in enumerate(self.shards):
      device = shard.devices[0]
      shard_of = lambda leaf: next(s.data for s in leaf.addressable_shards if s.device == device)
      self.tiers['master'].put(i, shard_of(leaves[shard.leaf]))
      for kind in ('mu', 'nu'):
        if moments is not None and not moments[kind]:  # None in the state: read into the tier
          self.tiers[kind].seal(i)
        elif moments is None:
          self.tiers[kind].zero(i)
        else:
          self.tiers[kind].put(i, shard_of(moments[kind][shard.leaf]))
    self.count = int(state.step) - int(state.bad_steps)
    for x in jax.tree.leaves(state.opt_state):  # the devices' copies are done with
      x.delete()
    return state.replace(opt_state=None, params=self._copies(state.params))

  def _copies(self, params):
    """The devices' copy of the parameters: the master weights, or in the compute dtype where
    the master weights live off the devices."""
    trained_params, frozen = trained(self.setup.model_cfg, params)
    leaves, treedef = jax.tree.flatten(trained_params)
    return nnx.merge_state(jax.tree.unflatten(treedef, [
        x if x.dtype == dtype else x.astype(dtype) for x, dtype in zip(leaves, self.copy_dtypes)]),
        frozen)

  def saving(self, state):
    """(the state a checkpoint's orbax item holds, its pieces, what the checkpoint calls once it
    has read them): the state as an all-device run's
    with None where a host or NVMe tier holds it, which the checkpoint reads from the tier a
    chunk at a time in the background (runtime/pieces.py), never whole in memory. The next
    update waits until it has read them all (`__call__`)."""
    devices = {checkpoint.name_of(path): x
               for path, x in jax.tree_util.tree_leaves_with_path(state)}
    on_devices = {kind: self._gathered(kind) for kind in KINDS
                  if kind != 'master' and type(self.tiers[kind]) is DeviceTier}

    def leaf(path, x):
      name = checkpoint.name_of(path)
      if name in self.off_devices:
        return None
      kind = _kind(path) if path[0].name == 'opt_state' else None
      if kind in ('mu', 'nu'):
        return on_devices[kind][self._leaf_of(path, kind)]
      if kind == 'count':
        return jax.device_put(np.int32(self.count), x.sharding)
      if name in devices:
        return devices[name]
      raise ValueError(f'training/tiers.py does not know the state leaf {name}')
    return (jax.tree_util.tree_map_with_path(leaf, self.setup.checkpoint_state),
            self._pieces('full'), self.readers.start())

  def _pieces(self, method: str) -> dict[str, Pieces]:
    """{name: Pieces} of what the host and NVMe tiers hold, each shard's function its tier's
    `method` ('full' to save it, 'put_rows' to restore into it): of each distinct shard in the
    job, the process of its first holder saves it; every process restores all it holds."""
    out = {}
    for name, (kind, leaf) in self.off_devices.items():
      mine = {True: [], False: []}
      for i, shard in enumerate(self.shards):
        if shard.leaf == leaf:
          mine[self.first_holder[leaf, _key(shard.index)]].append(
              (shard.index, functools.partial(getattr(self.tiers[kind], method), i)))
      out[name] = Pieces(self.abstract[name].shape, self.abstract[name].dtype,
                         tuple(mine[True]), tuple(mine[False]))
    return out

  def _leaf_of(self, path, kind) -> int:
    """The trained parameter a moment's leaf at `path` mirrors."""
    at = next(i for i, k in enumerate(path) if getattr(k, 'name', None) == kind)
    return self.names[jax.tree_util.keystr(path[at + 1:])]

  def _gathered(self, kind) -> list:
    """Each trained parameter's `kind` on the devices, as a global array in its sharding."""
    tier, params = self.tiers[kind], jax.tree.leaves(self.params)
    by_index = {(s.leaf, _key(s.index)): i for i, s in enumerate(self.shards)}
    return [jax.make_array_from_callback(
        p.shape, p.sharding, lambda index, leaf=leaf: tier.full(by_index[leaf, _key(index)]),
        dtype=p.dtype) for leaf, p in enumerate(params)]

  def __call__(self, state, batch):
    grads, norm, finite, step, bad_steps, metrics = self.compiled(state, batch)
    self.readers.none.wait()  # a checkpoint still reading the tiers (behind the gradients' program)
    if bool(finite):
      if not self.setup.run.optimizer.master_on_devices:
        # the update makes the devices' new copy from the master weights and needs nothing of
        # the old one: freed now, the two never share the devices (the plan's update_bytes)
        for x in jax.tree.leaves(trained(self.setup.model_cfg, state.params)[0]):
          x.delete()
      state = state.replace(params=self._update(state.params, grads, norm))
      self.count += 1
    return state.replace(step=step, bad_steps=bad_steps), metrics

  def _update(self, params, grads, norm):
    """The parameters after clipping and AdamW's update, a group at a time (module docstring);
    `norm`: the gradients' global norm."""
    grad_leaves = jax.tree.leaves(grads)
    grad_of = lambda i: next(s.data for s in grad_leaves[self.shards[i].leaf].addressable_shards
                             if s.device == self.shards[i].devices[0])
    master = self.tiers['master']
    if type(master) is DeviceTier:
      leaves = jax.tree.leaves(trained(self.setup.model_cfg, params)[0])
      for i, shard in enumerate(self.shards):  # the devices' parameters are the master weights
        master.arrays[i] = next(s.data for s in leaves[shard.leaf].addressable_shards
                                if s.device == shard.devices[0])
    # the devices' new parameters: the master tier's own arrays where it is the devices'
    copies = master if type(master) is DeviceTier else DeviceTier(self.shards)
    count = np.int32(self.count)
    norm = np.asarray(norm.addressable_data(0))  # replicated; this process's copy, on the host
    reading = self.pool.submit(self._read, self.groups[0])
    writing = None
    for g, group in enumerate(self.groups):
      inputs = reading.result()
      if g + 1 < len(self.groups):
        reading = self.pool.submit(self._read, self.groups[g + 1])
      outputs = {}
      for device, parts in _by_device(group, self.shards).items():
        arrays = [[_rows(grad_of(p.shard), p, self.shards[p.shard]) for p in parts],
                  *[[inputs[kind][p] for p in parts] for kind in KINDS]]
        decays = [self.decays[self.shards[p.shard].leaf] for p in parts]
        new = _updated(self.setup.run.optimizer, self.setup.schedule, decays, arrays,
                       jax.device_put(count, device), jax.device_put(norm, device))
        for kind, values in zip(KINDS, new):
          outputs.setdefault(kind, {}).update(zip(parts, values))
      if copies is not master:
        for p, value in outputs['master'].items():
          copies.write(p, value)
      if writing is not None:
        writing.result()  # one group's write in flight at a time
      writing = self.pool.submit(self._write, group, outputs)
    if writing is not None:
      writing.result()
    for tier in {id(t): t for t in (*self.tiers.values(), copies)}.values():
      tier.commit()
      if isinstance(tier, NvmeTier):
        tier.verify()  # before anything made from a damaged part leaves the engine
    return self._params_from(params, copies)

  def _read(self, group):
    return {kind: {p: self.tiers[kind].read(p) for p in group} for kind in KINDS}

  def _write(self, group, outputs):
    for kind in KINDS:
      for p in group:
        self.tiers[kind].write(p, outputs[kind][p])

  def _params_from(self, params, copies: DeviceTier):
    """The devices' parameters with the trained ones' shards from `copies` (each on its first
    device, copied to the others holding it)."""
    trained_params, frozen = trained(self.setup.model_cfg, params)
    leaves, treedef = jax.tree.flatten(trained_params)
    per_leaf = {}
    for i, shard in enumerate(self.shards):
      value = copies.full(i).astype(self.copy_dtypes[shard.leaf])
      for device in shard.devices:
        per_leaf.setdefault(shard.leaf, []).append(
            value if device == shard.devices[0] else jax.device_put(value, device))
    new = [jax.make_array_from_single_device_arrays(x.shape, x.sharding, per_leaf[leaf])
           for leaf, x in enumerate(leaves)]
    return nnx.merge_state(jax.tree.unflatten(treedef, new), frozen)

  def close(self) -> None:
    """Ends the engine: its threads, and its NVMe files (the run's record is its checkpoints)."""
    self.readers.none.wait()  # a checkpoint's background read of the tiers ends before they do
    self.pool.shutdown(wait=True)
    for tier in self.tiers.values():
      tier.close()
    self._remove_scratch()

  def _remove_scratch(self) -> None:
    for directory in self.scratch:
      shutil.rmtree(directory, ignore_errors=True)
      try:
        directory.parent.rmdir()  # the run's, once no process of it has files there
      except OSError:
        pass


def _by_device(group, shards) -> dict:
  out = {}
  for p in group:
    out.setdefault(shards[p.shard].devices[0], []).append(p)
  return out


def _kind(path) -> str | None:
  """What an optax state's leaf at `path` is: 'mu' or 'nu' (Adam's moments), 'count' (AdamW's
  and its schedule's step counts), else None."""
  names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
  return next((kind for kind in ('mu', 'nu') if kind in names),
              'count' if names and names[-1] == 'count' else None)


def _moments(opt_state) -> dict[str, list]:
  """{'mu': [leaves], 'nu': [leaves]}: Adam's moments in the trained parameters' order."""
  out = {'mu': [], 'nu': []}
  for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if (kind := _kind(path)) in out:
      out[kind].append(x)
  return out


def _updated(opt_config, schedule, decays: list, arrays: list, count, norm) -> tuple:
  """(master, mu, nu) of each part after AdamW, from `arrays` [grads, master, mu, nu] (lists,
  a part each). One part alone is updated as two halves of its elements: with several parameters
  in one program XLA divides by Adam's bias corrections, as in the all-device step, but with one
  it multiplies by their reciprocals instead, which rounds otherwise (one ulp, on some elements).
  Elementwise, the halves' update is the part's."""
  if len(decays) > 1:
    return _adamw(opt_config, schedule, tuple(decays))(*arrays, count, norm)
  shape, size = arrays[0][0].shape, arrays[0][0].size
  half = (size + 1) // 2 if size > 1 else size
  halves = [[x.reshape(-1)[:half], x.reshape(-1)[half:] if size > 1 else x.reshape(-1)]
            for (x,) in arrays]  # a single element is updated twice, as its own pair
  new = _adamw(opt_config, schedule, (decays[0], decays[0]))(*halves, count, norm)
  return tuple([(jnp.concatenate(v) if size > 1 else v[0]).reshape(shape)] for v in new)


@functools.cache
def _adamw(opt_config, schedule, decays: tuple):
  """(grads, master, mu, nu, count, norm) → (master, mu, nu) for a device's parts of a group
  (lists, each part's weight decay as `decays` says): the gradients clipped as optax's
  clip_by_global_norm clips them (`norm` their global norm), then the optax AdamW of
  training/optimizer.py."""
  tx = optimizer.make_adamw(opt_config, schedule, mask=list(decays))
  max_norm = opt_config.grad_clip

  def clipped(t, norm):  # optax.clip_by_global_norm's clip_fn, its arithmetic as it is there
    return jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)

  @jax.jit
  def update(grads, master, mu, nu, count, norm):
    if max_norm > 0:
      grads = [clipped(t, norm) for t in grads]
    state = jax.eval_shape(tx.init, master)

    def filled(path, _):
      kind = _kind(path)
      return {'mu': mu, 'nu': nu}[kind][path[-1].idx] if kind in ('mu', 'nu') else count
    state = jax.tree_util.tree_map_with_path(filled, state)
    updates, state = tx.update(grads, state, master)
    moments = _moments(state)
    return optax.apply_updates(master, updates), moments['mu'], moments['nu']
  return update
