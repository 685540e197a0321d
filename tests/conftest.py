"""Tests run on 8 CPU devices: XLA_FLAGS must be set before jax is first imported. Prepared
datasets go to a temporary TFDS data dir (TFDS_DATA_DIR, also seen by subprocesses), removed at
the end, so tests never write under the user's home. The processes tests start share a temporary
persistent compilation cache: each compiles the same tiny steps again (a killed run and its
restart, two processes of one job); the test processes (pytest-xdist's workers) share one of
their own."""

import os
import re
import shutil
import sys
import sysconfig
import tempfile

# Tests compile far more than they compute: without LLVM's optimisations a tiny step compiles in
# about half the time (4.6 s against 8.5 s for configs/base.py) and runs about 3× slower, which
# pays for itself up to some 20 steps. So in this process, whose programs are compiled once and
# run a few steps; not in the processes tests start, which run train.py for tens of steps and
# share a compilation cache, so that each program is compiled once and run again and again
# (tests/test_checkpoint.py: 237 → 204 CPU-seconds). FAST_COMPILE is taken out below. The
# programs this process compiles for GPUs that are not here are read, never run: ptxas assembles
# them without its optimisations too (some 10% of such a compile; their HLO, memory and PTX are
# the same, and a kernel's registers and spills are read by ptxas -v of its own:
# planning/gpu_compiler.py: kernels).
FAST_COMPILE = ' --xla_backend_optimization_level=0 --xla_gpu_disable_gpuasm_optimizations=true'
for inherited in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                  'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'):  # set below for the subprocesses
  os.environ.pop(inherited, None)  # of a pytest that started this one (a pytest-xdist worker)
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8' + FAST_COMPILE).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
DATA_DIR = tempfile.mkdtemp(prefix='meshlm-tests-tfds-')
os.environ['TFDS_DATA_DIR'] = DATA_DIR
STDLIB = sysconfig.get_paths()['stdlib']
SMALL_CORPUS = f'{STDLIB}/json/*.py,{STDLIB}/email/*.py'  # 25 real files, ~330 kB

from planning import gpu_compiler  # noqa: E402  (imports no jax)

# This process compiles for GPUs too (tests/test_gpu_compile.py): the GPU compiler must be on the
# path before jax is imported; the processes tests start do not get it.
if os.environ['JAX_PLATFORMS'] == 'cpu' and 'jax' not in sys.modules:
  gpu_compiler.put_on_path()

import jax  # noqa: E402
import pytest  # noqa: E402

from configs import base  # noqa: E402
from runtime.distributed import free_port  # noqa: E402, F401  (the tests' coordinators)

assert jax.device_count() == 8, 'tests expect 8 CPU devices (XLA_FLAGS was set too late)'

# The caches below are made once, by the first process of the session (pytest's own, or its
# only one with -n 0), and shared with pytest-xdist's workers, which inherit its environment:
# the two workers build many of the same tiny programs, each in the files it is given. Only the
# process that made them removes them, once every worker has ended.
CACHES = 'MESHLM_TEST_CACHES'
MADE_CACHES = CACHES not in os.environ
if MADE_CACHES:
  os.environ[CACHES] = os.pathsep.join(tempfile.mkdtemp(prefix='meshlm-tests-xla-cache-')
                                       for _ in range(2))
CACHE_DIR, OWN_CACHE_DIR = os.environ[CACHES].split(os.pathsep)

# Set after jax read its configuration: the environment is for the processes tests start.
os.environ.update(XLA_FLAGS=os.environ['XLA_FLAGS'].replace(FAST_COMPILE, '').strip(),
                  JAX_COMPILATION_CACHE_DIR=CACHE_DIR,
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
# The test processes have one of their own: tests build the same tiny steps again and again
# (each loop.run jits anew), and a cached one loads in milliseconds. Never the started processes'
# cache: a program compiled here, with the GPU compiler loaded, is not one for them to run.
jax.config.update('jax_compilation_cache_dir', OWN_CACHE_DIR)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def tiny_config(**mesh):
  """A 2-layer GQA model small enough to compile in seconds, in fp32 for tight comparisons."""
  c = base.get_config()
  c.batch_size, c.seq_len = 8, 32
  c.model.d_model, c.model.n_layers, c.model.d_ff = 64, 2, 128
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 16
  c.model.compute_dtype = 'float32'
  c.optimizer.warmup_steps = 2
  c.train_steps = 10
  c.mesh.update(dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1))
  c.mesh.update(mesh)
  c.model.vocab_size = 384  # the byte tokenizer's, padded
  c.model.head_chunk = 24  # several chunks a device, the last padded (model/head.py)
  c.data.paths, c.data.validation_fraction = SMALL_CORPUS, 0.1
  return c


def f32_shapes(hlo: str) -> list[tuple[int, ...]]:
  """The shape of every fp32 array a compiled program's text names."""
  return [tuple(map(int, dims.split(','))) for dims in re.findall(r'f32\[([\d,]+)\]', hlo)]


def with_file_size_limit(limit: int, args: list[str]) -> list[str]:
  """`args` (a python command) run where writes past `limit` bytes fail with EFBIG, as a full
  disk's fail with ENOSPC (SIGXFSZ ignored: the write returns the error instead of killing)."""
  return [sys.executable, '-c', 'import os, resource, signal, sys\n'
          'signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
          f'resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n'
          'os.execv(sys.executable, [sys.executable, *sys.argv[1:]])', *args[1:]]


LONGEST = {  # test-seconds on 2 cores (pytest --durations=0 of a whole run)
    'test_faults.py': 1161, 'test_gpu_compile.py': 347, 'test_benchmarks.py': 166,
    'test_training.py': 143, 'test_context_parallel.py': 124, 'test_distributed.py': 121,
    'test_sharding.py': 111, 'test_tiers.py': 102, 'test_evaluation.py': 95,
    'test_flash_attention_hopper.py': 93, 'test_dpo.py': 86, 'test_plan.py': 82,
    'test_moe.py': 81, 'test_model.py': 77, 'test_pipeline.py': 76, 'test_notebook.py': 68,
    'test_checkpoint.py': 61, 'test_kernels.py': 60, 'test_generate.py': 59,
    'test_speculate.py': 58, 'test_huggingface.py': 53, 'test_timing.py': 52, 'test_lora.py': 43,
    'test_kv_cache.py': 37, 'test_chat.py': 36, 'test_data.py': 26, 'test_hierarchical.py': 24,
    'test_configs.py': 24, 'test_tokens.py': 16, 'test_fp8.py': 15, 'test_head.py': 14,
    'test_grouped_matmul.py': 13, 'test_preemption.py': 10, 'test_grpo.py': 10,
    'test_structure.py': 7, 'test_instruments.py': 5, 'test_workdir.py': 3,
    'test_embedding.py': 3}


def pytest_collection_modifyitems(config, items):
  """Orders the files longest first (LONGEST; a file it lacks is an error)."""
  partly = {f'tests/{os.path.basename(arg.split("::")[0])}' for arg in config.args if '::' in arg}
  files = {item.nodeid.split('::')[0] for item in items} - partly
  # The longest files first (their test seconds on 2 cores), so that the two workers, each
  # taking a file at a time, end on short ones together rather than one on a long one alone.
  items.sort(key=lambda item: -LONGEST.get(os.path.basename(item.nodeid.split('::')[0]), 0))
  # A file LONGEST does not name runs last, where one worker may run it alone while the other
  # idles.
  if unranked := sorted(os.path.basename(f) for f in files
                        if os.path.basename(f) not in LONGEST):
    raise pytest.UsageError(f'tests/conftest.py LONGEST lacks {unranked}: add each with its '
                            'seconds (pytest --durations=0), so that it runs in its place')


def pytest_sessionfinish(session, exitstatus):
  shutil.rmtree(DATA_DIR, ignore_errors=True)
  if MADE_CACHES:
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    shutil.rmtree(OWN_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope='session')
def h100():
  """One H100 that is not here, to compile for (planning/gpu_compiler.py)."""
  from planning import gpus
  assert gpu_compiler.in_this_process(), (
      f'the GPU compiler is not installed; run `{gpu_compiler.INSTALL}` (the README test command '
      'does)')
  device, = gpu_compiler.devices(gpus.GPUS['H100'], 1)
  assert device.device_kind == gpus.GPUS['H100'].device_kind
  assert gpu_compiler.is_deviceless(device)
  return device


@pytest.fixture(scope='session')
def small_corpus():
  """A real corpus, small, prepared once: the json and email packages of the standard library."""
  from data import corpus
  return corpus.load(tiny_config().data)
