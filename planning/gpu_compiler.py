"""Compiling for GPUs that are not there: XLA's own GPU pipeline on a machine without one.

`devices(gpu, n)` gives n compile-only devices of a GPU in planning/gpus.py (a "topology" made
from its target config); `jax.jit(...).lower(...).compile()` over a mesh of them runs the real
GPU compiler: its memory plan and buffer assignment, its collectives (reduce-scatter, bf16), and
Pallas → Triton → PTX → cubin for the device's architecture, with its shared-memory and register
limits enforced. Nothing runs, so nothing is autotuned (training/programs.py turns XLA's autotuner
off for such devices: it compiles candidates it cannot time) and cuDNN builds no execution plan.

The compiler is JAX's CUDA plugin with NVIDIA's ptxas, libdevice and cuDNN (~1.6 GB of wheels),
installed into a folder of its own, off the environment's import path:

  python -m planning.gpu_compiler install     # once per environment
  python -m planning.gpu_compiler check       # where it is; compile a matmul for an H100

Only a process that compiles for GPUs imports it, and that process has it on its path from the
start, with JAX_PLATFORMS=cpu (`environment()`), so JAX finds the plugin as on a GPU machine while
running nothing on CUDA. Everywhere else it stays out: importable in every process, the plugin
checks for a CUDA driver at each start of JAX and logs a traceback when there is none. So a dry run
for a GPU target (`plan_in_compiler_process`) and benchmarks/kernel_resources.py run in such a
process; the tests put it on their own path (tests/conftest.py, `put_on_path`).

The folder is `<environment>/meshlm-gpu-compiler/<jaxlib version>` (the plugin must match jaxlib
exactly, and pip leaves an older one's metadata behind) unless MESHLM_GPU_COMPILER names another.
On a GPU machine (pip install -e '.[gpu]') the environment's own CUDA plugin serves instead.

jaxlib 0.12.1 cannot do this for cuDNN's attention: its XLA builds cuDNN's execution plan while
compiling, loading cuDNN's runtime-compiled engines, which need a CUDA driver (libcuda), so
pyproject.toml keeps jax below it.
"""

import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from planning import gpus

INSTALL = 'python -m planning.gpu_compiler install'


def folder() -> pathlib.Path:
  return pathlib.Path(os.environ.get('MESHLM_GPU_COMPILER') or
                      pathlib.Path(sys.prefix) / 'meshlm-gpu-compiler' / _jaxlib_version())


def _jaxlib_version() -> str:
  return importlib.metadata.version('jaxlib')


def packages() -> list[str]:
  """The wheels, the plugin pinned to this jaxlib (they must match exactly)."""
  version = _jaxlib_version()
  return [f'jax-cuda13-plugin=={version}', f'jax-cuda13-pjrt=={version}',
          'nvidia-cuda-nvcc>=13.0', 'nvidia-nvvm>=13.0', 'nvidia-cudnn-cu13>=9.12,<10']


def _plugin_version(paths) -> str | None:
  for dist in importlib.metadata.distributions(path=list(paths)):
    if dist.metadata['Name'] == 'jax-cuda13-plugin':
      return dist.version
  return None


def installed() -> bool:
  """True where a CUDA plugin matching this jaxlib is in folder() or in this environment."""
  return _jaxlib_version() in (_plugin_version([str(folder())]), _plugin_version(sys.path))


def in_this_process() -> bool:
  """True where this process's JAX can compile for GPUs: the plugin is on its import path."""
  return _plugin_version(sys.path) == _jaxlib_version()


def environment() -> dict:
  """os.environ for a child process that compiles for GPUs (see the module docstring)."""
  path = os.pathsep.join(p for p in (str(folder()), os.environ.get('PYTHONPATH')) if p)
  return {**os.environ, 'PYTHONPATH': path, 'JAX_PLATFORMS': 'cpu'}


def put_on_path() -> bool:
  """Lets this process compile for GPUs, if the compiler is installed: call it before jax is
  imported, with JAX_PLATFORMS=cpu. Returns whether this process can compile for GPUs."""
  if in_this_process():
    return True
  if 'jax' in sys.modules:
    raise RuntimeError('gpu_compiler.put_on_path() must run before jax is imported')
  if os.environ.get('JAX_PLATFORMS') != 'cpu':
    raise RuntimeError('gpu_compiler.put_on_path() needs JAX_PLATFORMS=cpu')
  if not installed():
    return False
  sys.path.append(str(folder()))
  return True


def install(log=print) -> None:
  """pip-installs the compiler's wheels into folder(), unless a matching one is there."""
  if installed():
    log(f'the GPU compiler for jaxlib {_jaxlib_version()} is installed')
    return
  log(f'installing the GPU compiler for jaxlib {_jaxlib_version()} into {folder()}')
  subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--upgrade',
                  '--target', str(folder()), *packages()], check=True)
  if not installed():
    raise RuntimeError(f'{folder()} holds no CUDA plugin for jaxlib {_jaxlib_version()} after '
                       'pip install')


def devices(gpu: gpus.GPU, n: int) -> list:
  """n compile-only devices of `gpu`, 8 to a node (n ≤ 8, or a multiple of 8)."""
  from jax.experimental import topologies
  if not in_this_process():
    raise RuntimeError('this process cannot compile for GPUs: run it with '
                       'gpu_compiler.environment() (after `' + INSTALL + '`)')
  if n < 1 or (n > 8 and n % 8):
    raise ValueError(f'config.plan.devices={n}: plan for 1 to 8 GPUs, or a multiple of 8 '
                     '(8 to a node)')
  per_node = min(n, 8)
  topology = topologies.get_topology_desc(platform='cuda', topology=f'1x{n // per_node}x{per_node}',
                                          target_config=gpus.target_config(gpu))
  _answer_capability_checks(gpu)
  return list(topology.devices)


def _answer_capability_checks(gpu: gpus.GPU) -> None:
  """JAX's cuDNN attention asks this process's own GPU for its compute capability while it
  traces (its packed layout needs Hopper). A compile-only process has none: the GPU the devices
  are made for answers."""
  from jax._src.cudnn import fused_attention_stablehlo as fused_attention
  fused_attention.check_compute_capability = lambda capability: gpu.compute_capability >= tuple(
      int(x) for x in capability.split('.'))


def is_deviceless(device) -> bool:
  """True for a compile-only device (from devices()), False for one this process can run on."""
  import jax
  try:
    return all(d is not device for d in jax.devices(device.platform))
  except RuntimeError:  # no backend for that platform in this process
    return True


def plan_in_compiler_process(settings: dict, module: str) -> dict:
  """A dry run of a run's `settings` (configs.base.Run.as_dict) as `python -m module
  config.json` (training.dry_run's) in a child process that can compile for GPUs: its output
  appears here as it is printed; returns its plan, the last line. A ValueError in the child (a
  bad setting) is raised here as one."""
  with tempfile.TemporaryDirectory(prefix='meshlm-plan-') as tmp:
    config_file, errors = pathlib.Path(tmp) / 'config.json', pathlib.Path(tmp) / 'stderr'
    config_file.write_text(json.dumps(settings))
    with errors.open('w') as stderr:
      child = subprocess.Popen([sys.executable, '-m', module, str(config_file)],
                               env=environment(), stdout=subprocess.PIPE,
                               stderr=stderr, text=True)
      lines = []
      for line in child.stdout:
        print(line, end='', flush=True)
        lines.append(line)
    error = errors.read_text()
  if child.wait():
    last = error.strip().splitlines()[-1] if error.strip() else ''
    if last.startswith('ValueError: '):
      raise ValueError(last.removeprefix('ValueError: '))
    raise RuntimeError(f'the GPU compiler\'s process failed:\n{error[-3000:]}')
  sys.stderr.write(error)
  return json.loads(lines[-1])


def run_as_compiler_process(argv) -> None:
  """For a script that compiles for GPUs: unless this process can, replace it with
  `python *argv` in environment() (argv: the script and its arguments, or '-m', module, …)."""
  if in_this_process():
    return
  if not installed():
    raise SystemExit(f'no GPU compiler for jaxlib {_jaxlib_version()} in {folder()}; install it '
                     f'with `{INSTALL}`')
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, *argv], environment())


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One GPU kernel of a compiled program, as the compiler built it."""
  name: str
  grid: tuple[int, ...]
  threads: int  # per block
  shared_memory: int  # bytes per block
  registers: int  # per thread
  spill_stores: int  # bytes per thread
  spill_loads: int
  stack_frame: int

  @property
  def spills(self) -> bool:
    return bool(self.spill_stores or self.spill_loads)


_THUNK = re.compile(r'(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes')
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r'(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads')
_USED = re.compile(r'Used (\d+) registers')


def lower(device, jitted, *args):
  """`jitted.lower(*args)` for `device`, a GPU of this compiler: a Pallas kernel asks the default
  device which GPU it lowers for, which here is a CPU unless set."""
  import jax
  with jax.default_device(device):
    return jitted.lower(*args)


def kernels(lowered) -> list[Kernel]:
  """Compiles `lowered` (a jax Lowered for GPU devices) and reports each kernel it launches:
  grid, threads and shared memory as XLA launches it (its thunk sequence), registers and spills
  as ptxas assembles the PTX XLA emitted (ptxas -v, the same assembler XLA uses)."""
  with tempfile.TemporaryDirectory(prefix='meshlm-kernels-') as dump:
    # At XLA's own optimisation level, whatever XLA_FLAGS says: registers and spills depend on it.
    # XLA dumps only the kinds xla_dump_emitter_re names: the PTX alone, since '.*' adds some
    # 70 MB of Triton's pass-by-pass IR for our attention and makes the compile 10× slower.
    lowered.compile(compiler_options={'xla_dump_to': dump, 'xla_backend_optimization_level': 2,
                                      'xla_dump_emitter_re': 'ptx'})
    files = sorted(pathlib.Path(dump).iterdir())
    launches = {}
    for f in files:
      if f.name.endswith('thunk_sequence.txt'):
        for name, grid, threads, smem in _THUNK.findall(f.read_text()):
          launches[name] = (tuple(int(g) for g in grid.split(',')),
                            math.prod(int(t) for t in threads.split(',')), int(smem))
    assembled = {}
    for f in files:
      if f.suffix == '.ptx':
        assembled.update(_ptxas(f))
  return [Kernel(name, *launches[name], *assembled[name]) for name in launches
          if name in assembled]


FLASH_KERNELS = ('flash_attention_fwd', 'flash_attention_dq', 'flash_attention_dkv')


def flash_attention_kernels(device, head_dim: int, segments: bool, tiles, heads=(32, 8),
                            seq_len=4096, dtype='bfloat16', window: bool = False) -> dict:
  """{'kernels': {name: Kernel fields}} of our flash attention's three kernels in one causal
  fwd+bwd call (`dtype`, B = 1, L = S = seq_len, heads = (query, kv); with `window`, a sliding
  window known at run time) compiled for `device`, with tiles (block_q, block_k, num_warps,
  num_stages); or {'error': the compiler's message} when it refuses them."""
  import jax
  import jax.numpy as jnp
  from kernels.flash_attention import flash_attention
  (N, K), L = heads, seq_len
  place = jax.sharding.SingleDeviceSharding(device)
  q = jax.ShapeDtypeStruct((1, L, N, head_dim), jnp.dtype(dtype), sharding=place)
  kv = jax.ShapeDtypeStruct((1, L, K, head_dim), jnp.dtype(dtype), sharding=place)
  seg = jax.ShapeDtypeStruct((1, L), jnp.int32, sharding=place)
  block_q, block_k, num_warps, num_stages = tiles

  def loss(q, k, v, s, w):
    out = flash_attention(q, k, v, causal=True, segment_ids_BL=s if segments else None,
                          block_q=block_q, block_k=block_k, num_warps=num_warps,
                          num_stages=num_stages, window=w if window else None)
    return out.astype(jnp.float32).sum()

  w = jax.ShapeDtypeStruct((), jnp.int32, sharding=place)
  try:
    found = kernels(lower(device, jax.jit(jax.grad(loss, (0, 1, 2))), q, kv, kv, seg, w))
  except Exception as e:  # the compiler's refusal is a result: report it
    return {'error': f'{type(e).__name__}: {str(e).splitlines()[0][:300]}'}
  return {'kernels': {k.name: {f: getattr(k, f) for f in ('grid', 'threads', 'shared_memory',
                                                           'registers', 'spill_stores',
                                                           'spill_loads')}
                      for k in found if k.name in FLASH_KERNELS}}


def ptxas() -> pathlib.Path:
  """NVIDIA's PTX assembler from the nvidia-cuda-nvcc wheel."""
  spec = importlib.util.find_spec('nvidia')
  for root in [*(spec.submodule_search_locations if spec else []), folder() / 'nvidia']:
    for candidate in pathlib.Path(root).glob('cu*/bin/ptxas'):
      return candidate
  raise RuntimeError(f'ptxas not found (nvidia-cuda-nvcc); install the GPU compiler: `{INSTALL}`')


def _ptxas(ptx: pathlib.Path) -> dict[str, tuple[int, int, int, int]]:
  """{kernel: (registers, spill stores, spill loads, stack frame)} from `ptxas -v`."""
  target = re.search(r'^\.target\s+(\w+)', ptx.read_text(), re.M)
  if not target:  # XLA writes an empty file for a module part with no kernels
    return {}
  out = subprocess.run([str(ptxas()), f'-arch={target.group(1)}', '-v', str(ptx), '-o',
                        os.devnull], capture_output=True, text=True, check=True).stderr
  found, name, frame = {}, None, (0, 0, 0)
  for line in out.splitlines():
    if m := _ENTRY.search(line):
      name, frame = m.group(1), (0, 0, 0)
    elif m := _FRAME.search(line):
      frame = tuple(int(g) for g in m.groups())
    elif (m := _USED.search(line)) and name:
      stack, stores, loads = frame
      found[name] = (int(m.group(1)), stores, loads, stack)
  return found


def main(argv) -> None:
  command = argv[1] if len(argv) > 1 else 'check'
  if command == 'install':
    install()
    command = 'check'
  if command == 'check':
    run_as_compiler_process(['-m', 'planning.gpu_compiler', 'check'])
    import jax
    import jax.numpy as jnp
    device, = devices(gpus.GPUS['H100'], 1)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(device))
    jax.jit(lambda a: a @ a).lower(x).compile()
    print(f'GPU compiler {_plugin_version(sys.path)} in {folder()}: compiles for '
          f'{device.device_kind}')
  else:
    raise SystemExit(f'usage: python -m planning.gpu_compiler [install|check]; got {command!r}')


if __name__ == '__main__':
  main(sys.argv)
