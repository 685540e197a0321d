"""One process per host (or per GPU) joins JAX's distributed runtime before anything touches the
devices. Where the numbers come from:

  config.distributed.coordinator_address set   → it, with num_processes and process_id
  SLURM (srun) or Open MPI (mpirun) detected    → JAX reads them from the scheduler's environment
  neither                                       → a single process; nothing to initialise

Detection uses the variables JAX's own cluster detection reads (jax/_src/clusters): SLURM_JOB_ID,
SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID; Open MPI's
OMPI_MCA_orte_hnp_uri and OMPI_COMM_WORLD_SIZE. A one-task job needs no runtime and gets none.

Failure: every process sends heartbeats to the coordination service (hosted by process 0). When
one dies, the service notices within `heartbeat_timeout_s` and every surviving process is
terminated with "...detected fatal errors..." (a non-zero exit) instead of waiting forever in a
collective; if process 0 dies, the others lose the service and stop the same way. A process that
exits with a Python error first tells the service, so the others stop at once. A survivor whose
collective fails before the service ends it prints "meshlm: process i of n failed" first
(`explain_failures`); which comes first is a race between threads, so either line may be the last.
"""

import contextlib
import os
import socket
import sys

import jax

def free_port() -> int:
  """A TCP port nobody listens on now, for a coordinator started on this machine (a test's, a
  benchmark's local job)."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


SLURM_VARS = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID',
              'SLURM_LOCALID')


def scheduler_process_count(environ=os.environ) -> tuple[str, int] | None:
  """(scheduler, processes) when launched by srun or mpirun, else None."""
  if all(v in environ for v in SLURM_VARS):
    return 'SLURM', int(environ['SLURM_NTASKS'])
  if 'OMPI_MCA_orte_hnp_uri' in environ:
    return 'Open MPI', int(environ.get('OMPI_COMM_WORLD_SIZE', '1'))
  return None


def initialize(dist_config) -> int:
  """Join the job's other processes, if there are any; returns the number of processes. Must
  run before jax touches a device (the first thing `training.loop.run` does)."""
  if jax.distributed.is_initialized():  # a notebook or a caller did it already
    return jax.process_count()
  timeouts = dict(initialization_timeout=dist_config.initialization_timeout_s,
                  heartbeat_timeout_seconds=dist_config.heartbeat_timeout_s)
  if dist_config.coordinator_address:
    if dist_config.num_processes == 1:
      return 1
    _cpu_collectives()
    jax.distributed.initialize(dist_config.coordinator_address, dist_config.num_processes,
                               dist_config.process_id, **timeouts)
    return dist_config.num_processes
  detected = scheduler_process_count()
  if detected is None or detected[1] == 1:
    return 1
  _cpu_collectives()
  jax.distributed.initialize(**timeouts)  # JAX reads address, count and id from the scheduler
  return detected[1]


def _cpu_collectives() -> None:
  # CPU devices of different processes talk through gloo over TCP (the tests' setting); GPUs use
  # NCCL whatever this says.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')


@contextlib.contextmanager
def explain_failures(dist_config):
  """On a multi-process job, a failing process says which it is and what the others will do
  (JAX's own messages follow it)."""
  try:
    yield
  except Exception as e:
    if jax.process_count() > 1:
      print(f'meshlm: process {jax.process_index()} of {jax.process_count()} failed '
            f'({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}). If another '
            'process died first, its log has the cause. Every process of the job stops within '
            f'config.distributed.heartbeat_timeout_s={dist_config.heartbeat_timeout_s} s',
            file=sys.stderr, flush=True)
    raise
