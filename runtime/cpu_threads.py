"""Enough threads for collectives between simulated CPU devices.

XLA's CPU client runs a step's ready operations on its intra-op thread pool, collectives
included, and a collective holds its thread until every device has arrived. The pool has
max(cores, devices) threads. With 8 simulated devices on a 2-core machine, devices that run ahead
can fill every thread with collectives that wait for a device whose next operation is queued
behind them; XLA then aborts the process after 40 s ("Termination timeout … Exiting to ensure a
consistent program state"). Machines with many cores rarely see it, which is why it looks like
a flaky CI failure. Sixteen threads a device leave room for the collectives the devices issue at
once (tests/test_cli.py's stress program deadlocks with 12 a device and passes with 16); idle
threads cost nothing. XLA's other deadlock between simulated devices, collectives taken in
different orders, no thread count prevents (docs/testing.md).

This must run before jax starts its CPU client (the first jax.devices() or array), so it reads
only the environment and imports no jax.
"""

import os
import re

THREADS_PER_DEVICE = 16
_DEVICE_COUNT = re.compile(r'--xla_force_host_platform_device_count=(\d+)')


def enough_for_collectives(environ=os.environ) -> None:
  """Sets PJRT_NPROC, the size of XLA's CPU thread pools, to 16 per simulated device when
  XLA_FLAGS asks for more than one device and the user has not set PJRT_NPROC."""
  match = _DEVICE_COUNT.search(environ.get('XLA_FLAGS', ''))
  if match and int(match.group(1)) > 1 and 'PJRT_NPROC' not in environ:
    environ['PJRT_NPROC'] = str(max(os.cpu_count() or 1, THREADS_PER_DEVICE * int(match.group(1))))
