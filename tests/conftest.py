"""Tests run on 8 CPU devices: XLA_FLAGS must be set before jax is first imported. Prepared
datasets go to a temporary TFDS data dir (TFDS_DATA_DIR, also seen by subprocesses), removed at
the end, so tests never write under the user's home. The processes tests start share a temporary
persistent compilation cache: each compiles the same tiny steps again (a killed run and its
restart, two processes of one job). This process compiles its own."""

import os
import shutil
import socket
import sys
import sysconfig
import tempfile

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
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

assert jax.device_count() == 8, 'tests expect 8 CPU devices (XLA_FLAGS was set too late)'

# Set after jax read its configuration, so only the processes tests start see it.
CACHE_DIR = tempfile.mkdtemp(prefix='meshlm-tests-xla-cache-')
os.environ.update(JAX_COMPILATION_CACHE_DIR=CACHE_DIR,
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
assert not jax.config.jax_compilation_cache_dir


def tiny_config(**mesh):
  """A 2-layer GQA model small enough to compile in seconds, in fp32 for tight comparisons."""
  c = base.get_config()
  c.batch_size, c.seq_len = 8, 32
  c.model.d_model, c.model.n_layers, c.model.d_ff = 64, 2, 128
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 16
  c.model.compute_dtype = 'float32'
  c.optimizer.warmup_steps = 2
  c.train_steps = 10
  c.mesh.update(dict(data=1, stage=1, fsdp=1, tensor=1, sequence=1))
  c.mesh.update(mesh)
  c.model.vocab_size = 384  # the byte tokenizer's, padded
  c.data.paths, c.data.validation_fraction = SMALL_CORPUS, 0.1
  return c


def free_port() -> int:
  """A TCP port nobody listens on now, for a test's jax.distributed coordinator."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def with_file_size_limit(limit: int, args: list[str]) -> list[str]:
  """`args` (a python command) run where writes past `limit` bytes fail with EFBIG, as a full
  disk's fail with ENOSPC (SIGXFSZ ignored: the write returns the error instead of killing)."""
  return [sys.executable, '-c', 'import os, resource, signal, sys\n'
          'signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
          f'resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n'
          'os.execv(sys.executable, [sys.executable, *sys.argv[1:]])', *args[1:]]


def pytest_sessionfinish(session, exitstatus):
  shutil.rmtree(DATA_DIR, ignore_errors=True)
  shutil.rmtree(CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope='session')
def small_corpus():
  """A real corpus, small, prepared once: the json and email packages of the standard library."""
  from data import corpus
  return corpus.load(tiny_config().data)
