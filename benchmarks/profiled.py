"""What the devices ran in some calls of a program, from JAX's profiler: the kernels a banked
program's prediction is held against (benchmarks/bank.py). jax and the stdlib only, so that a
peer's environment (benchmarks/side_by_side_maxtext.py) profiles its steps the same way."""

import collections
import glob
import tempfile
import warnings

import jax


def kernels(call, calls: int) -> dict:
  """What the devices ran in `calls` calls of `call`, from JAX's profiler trace: {'calls',
  'events': [{plane, line, name, hlo_op, count, us}]}, longest first. On a GPU, the device plane's
  lines: its streams' kernels (hlo_op names the instruction of the program) and XLA's own lines of
  modules and ops. On a CPU, the host's events that name an hlo_op. {'error'} if tracing failed:
  the measured row still counts."""
  try:
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        for _ in range(calls):
          jax.block_until_ready(call())
      (path,) = glob.glob(f'{trace_dir}/**/*.xplane.pb', recursive=True)
      data = jax.profiler.ProfileData.from_file(path)
    totals = collections.defaultdict(lambda: [0, 0.0])
    warnings.simplefilter('ignore', DeprecationWarning)  # the stats' type, on Python 3.12
    for plane in data.planes:
      on_device = plane.name.startswith('/device:')
      for line in plane.lines:
        for event in line.events:
          hlo_op = str(dict(event.stats).get('hlo_op', ''))
          if on_device or hlo_op:
            total = totals[plane.name, line.name, event.name, hlo_op]
            total[0] += 1
            total[1] += event.duration_ns / 1e3
  except Exception as e:  # a profiler that fails on some machine must not lose the measurement
    return {'error': f'{type(e).__name__}: {str(e)[:300]}'}
  events = [{'plane': plane, 'line': line, 'name': name, 'hlo_op': hlo_op, 'count': count,
             'us': round(us, 3)} for (plane, line, name, hlo_op), (count, us) in totals.items()]
  return {'calls': calls, 'events': sorted(events, key=lambda e: -e['us'])}
