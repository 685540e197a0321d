"""The time model (planning/timing.py): known kernels on hand-written HLO give the times the
efficiencies of planning/gpus.py say; programs the GPU compiler built for H100s that are not here
are charged as the model's docstring says."""

import functools
import json

import pytest

from planning import gpus, timing
from sharding import collectives
from tests.conftest import tiny_config
from training import settings
from training.programs import compile_and_plan
from training.state import build

H100 = gpus.GPUS['H100']
HBM = H100.memory_bandwidth * gpus.HBM_EFFICIENCY
NVLINK = H100.link_bandwidth * gpus.LINK_EFFICIENCY
LAUNCH = gpus.KERNEL_LAUNCH_S
MiB = 2**20


def gemm_s(m, n, k, batch=1):
  return (2 * batch * m * n * k / (H100.peak_bf16_flops * gpus.GEMM_EFFICIENCY
                                   * gpus.tile_waves(m, n, batch, H100.sms)))


def module(entry: str, devices: int = 8, extra: str = '') -> str:
  """A scheduled HLO module: a 4096² bf16 GEMM fusion, an add fusion of two 1024² bf16 arrays,
  a fusion updating one row of a stacked buffer in place, and `entry` as ENTRY's body."""
  return f'''HloModule test, is_scheduled=true, num_partitions={devices}

%gemm (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {{
  %p0 = bf16[4096,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[4096,4096]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%add (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {{
  %p0 = bf16[1024,1024]{{1,0}} parameter(0)
  %p1 = bf16[1024,1024]{{1,0}} parameter(1)
  ROOT %sum = bf16[1024,1024]{{1,0}} add(%p0, %p1)
}}

%update (p0: f32[64,1024,1024], p1: f32[1,1024,1024], p2: s32[]) -> f32[64,1024,1024] {{
  %p0 = f32[64,1024,1024]{{2,1,0}} parameter(0)
  %p1 = f32[1,1024,1024]{{2,1,0}} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[64,1024,1024]{{2,1,0}} dynamic-update-slice(%p0, %p1, %p2, %zero, %zero)
}}
{extra}
ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], x: bf16[1024,1024], s: bf16[512,4096]) -> bf16[4096,4096] {{
  %a = bf16[4096,4096]{{1,0}} parameter(0)
  %b = bf16[4096,4096]{{1,0}} parameter(1)
  %x = bf16[1024,1024]{{1,0}} parameter(2)
  %s = bf16[512,4096]{{1,0}} parameter(3)
{entry}
}}
'''


def test_known_kernels_take_their_known_times():
  """A GEMM at the GEMM efficiency (compute-bound), an add at HBM speed (3 arrays moved), an
  in-place row update moving only the row (read, written), each with a launch."""
  hlo = module('''
  %g = bf16[4096,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %y = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kLoop, calls=%add
  %buf = f32[64,1024,1024]{2,1,0} parameter(4)
  %row = f32[1,1024,1024]{2,1,0} parameter(5)
  %i = s32[] parameter(6)
  %u = f32[64,1024,1024]{2,1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%update
  ROOT %t = (bf16[4096,4096]{1,0}, bf16[1024,1024]{1,0}) tuple(%g, %y)''')
  predicted = timing.predict(hlo, H100)
  by_name = {k.name: k for k in predicted.kernels}
  assert by_name['g'].seconds == pytest.approx(gemm_s(4096, 4096, 4096), rel=1e-12)
  assert by_name['g'].flops == 2 * 4096**3 and by_name['g'].part == 'gemm'
  assert by_name['y'].seconds == pytest.approx(3 * MiB * 2 / HBM, rel=1e-12)
  assert by_name['u'].bytes == 2 * 4 * MiB + 4  # the row read and written, and the index: not
                                                # the 256 MiB buffer
  expected = gemm_s(4096, 4096, 4096) + 3 * 2 * MiB / HBM + (2 * 4 * MiB + 4) / HBM + 3 * LAUNCH
  assert predicted.seconds == pytest.approx(expected, rel=1e-12)
  assert predicted.breakdown['launch'] == pytest.approx(3 * LAUNCH)
  assert predicted.breakdown['communication'] == pytest.approx(0, abs=1e-15)


def test_our_grouped_matmul_is_charged_for_the_rows_its_name_says_are_filled():
  """The forward and the weight gradient of kernels/grouped_matmul.py, a quarter of whose 8192
  rows a balanced routing fills: a quarter of the FLOPs at GROUPED_GEMM_EFFICIENCY, the filled
  rows' bytes, the other operands' and the whole output; and a ragged all-to-all sends its input
  rows, not its 4× buffer."""
  triton = 'custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/%s/pallas_call"}'
  hlo = module(f'''
  %i = s32[136]{{0}} parameter(4)
  %xs = bf16[8192,1024]{{1,0}} parameter(5)
  %w = bf16[8,1024,2048]{{2,1,0}} parameter(6)
  %dy = bf16[8192,2048]{{1,0}} parameter(7)
  %y = bf16[8192,2048]{{1,0}} custom-call(%i, %i, %i, %i, %xs, %w), {triton % 'grouped_matmul_filled2500'}
  %dw = f32[8,1024,2048]{{2,1,0}} custom-call(%i, %i, %xs, %dy), {triton % 'grouped_matmul_dw_filled2500'}
  %out = bf16[2048,1024]{{1,0}} slice(%xs), slice={{[0:2048], [0:1024]}}
  %zeros = bf16[8192,1024]{{1,0}} broadcast(%out), dimensions={{}}
  %n = s64[8]{{0}} parameter(8)
  %start = ((bf16[2048,1024]{{1,0}}, bf16[8192,1024]{{1,0}}, s64[8]{{0}}, s64[8]{{0}}, s64[8]{{0}}, s64[8]{{0}}), bf16[8192,1024]{{1,0}}) ragged-all-to-all-start(%out, %zeros, %n, %n, %n, %n), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}
  %done = bf16[8192,1024]{{1,0}} ragged-all-to-all-done(%start)
  ROOT %t = (bf16[8192,2048]{{1,0}}, f32[8,1024,2048]{{2,1,0}}) tuple(%y, %dw)''')
  predicted = timing.predict(hlo, H100)
  by_name = {k.name: k for k in predicted.kernels}
  ints = 4 * 136 * 4
  assert by_name['y'].flops == by_name['dw'].flops == 2 * 2048 * 1024 * 2048
  assert by_name['y'].bytes == ints + 2048 * 1024 * 2 + 8 * 1024 * 2048 * 2 + 8192 * 2048 * 2
  assert by_name['dw'].bytes == 2 * 136 * 4 + (2048 * 1024 + 2048 * 2048) * 2 + 8 * 1024 * 2048 * 4
  rate = H100.peak_bf16_flops * gpus.GROUPED_GEMM_EFFICIENCY
  for k in (by_name['y'], by_name['dw']):
    assert k.part == 'gemm'
    assert k.seconds == pytest.approx(max(k.flops / rate, k.bytes / HBM), rel=1e-12)
  ragged, = [c for c in collectives.executed(hlo) if c.op == 'ragged-all-to-all']
  assert ragged.sent_bytes == 2048 * 1024 * 2 * 7 / 8


def test_a_loop_body_counts_once_per_trip():
  body = '''
%body (t: (s32[], bf16[1024,1024])) -> (s32[], bf16[1024,1024]) {
  %t = (s32[], bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[1024,1024]{1,0} get-tuple-element(%t), index=1
  %w = bf16[1024,1024]{1,0} fusion(%v, %v), kind=kLoop, calls=%add
  ROOT %r = (s32[], bf16[1024,1024]{1,0}) tuple(%i, %w)
}

%cond (t: (s32[], bf16[1024,1024])) -> pred[] {
  %t = (s32[], bf16[1024,1024]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}
'''
  hlo = module('''
  %zero = s32[] constant(0)
  %init = (s32[], bf16[1024,1024]{1,0}) tuple(%zero, %x)
  ROOT %loop = (s32[], bf16[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}''',
               extra=body)
  predicted = timing.predict(hlo, H100)
  add, = predicted.kernels
  assert add.runs == 6 and predicted.loops_charged_once == 0
  assert predicted.seconds == pytest.approx(6 * (3 * 2 * MiB / HBM + LAUNCH), rel=1e-12)
  # A loop whose trip count depends on the data (XLA states none): one run charged, and said so
  # (benchmarks/peers.py marks such a program not comparable).
  unknown = timing.predict(hlo.replace(', backend_config={"known_trip_count":{"n":"6"}}', ''),
                           H100)
  assert unknown.kernels[0].runs == 1 and unknown.loops_charged_once == 1


def test_a_loop_whose_trip_count_a_pass_dropped_is_read_from_the_loop():
  """XLA's collective pipeliner peels a loop's first iteration and drops its known_trip_count,
  keeping the induction variable: the count is read from its start (through copies), its step
  (the body's add, fused) and its bound (the condition's compare, fused): i = 1; i < 4; i += 1."""
  loop = '''
%step (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %next = s32[] add(%p, %one)
}

%below (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%p, %n), direction=LT
}

%body (t: (s32[], bf16[1024,1024])) -> (s32[], bf16[1024,1024]) {
  %t = (s32[], bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %i2 = s32[] copy(%i)
  %v = bf16[1024,1024]{1,0} get-tuple-element(%t), index=1
  %w = bf16[1024,1024]{1,0} fusion(%v, %v), kind=kLoop, calls=%add
  %j = s32[] fusion(%i2), kind=kLoop, calls=%step
  ROOT %r = (s32[], bf16[1024,1024]{1,0}) tuple(%j, %w)
}

%cond (t: (s32[], bf16[1024,1024])) -> pred[] {
  %t = (s32[], bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%below
}
'''
  hlo = module('''
  %start = s32[] constant(1)
  %first = s32[] copy(%start)
  %init = (s32[], bf16[1024,1024]{1,0}) tuple(%first, %x)
  ROOT %loop = (s32[], bf16[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}''',
               extra=loop)
  predicted = timing.predict(hlo, H100)
  assert predicted.kernels[0].runs == 3 and predicted.loops_charged_once == 0
  assert timing.predict(hlo.replace('direction=LT', 'direction=LE'), H100).kernels[0].runs == 4
  assert timing.predict(hlo.replace('constant(1)\n  ROOT %next', 'constant(2)\n  ROOT %next'),
                        H100).kernels[0].runs == 2  # i = 1, 3
  # without the induction variable XLA names, or with a bound that is not a constant: unknown
  for unknown in (hlo.replace('"known_induction_variable":{"tuple_index":"0"}', '"x":1'),
                  hlo.replace('compare(%p, %n)', 'compare(%p, %p)')):
    predicted = timing.predict(unknown, H100)
    assert predicted.kernels[0].runs == 1 and predicted.loops_charged_once == 1


GATHER = ('%ag = (bf16[512,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) all-gather-start(%s), channel_id=1, '
          'replica_groups={groups}, dimensions={{0}}, '
          'use_global_device_ids=true')


def gathered_s(bandwidth, latency, group=8):
  return 32 * MiB * (group - 1) / group / bandwidth + latency


def test_a_collective_with_no_compute_beside_it_is_exposed_and_one_overlapped_is_hidden():
  start = GATHER.format(groups='[1,8]<=[8]')
  exposed = module(f'''
  {start}
  %w = bf16[4096,4096]{{1,0}} all-gather-done(%ag)
  %g = bf16[4096,4096]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm
  ROOT %h = bf16[4096,4096]{{1,0}} fusion(%g, %w), kind=kCustom, calls=%gemm''')
  hidden = module(f'''
  {start}
  %g = bf16[4096,4096]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm
  %w = bf16[4096,4096]{{1,0}} all-gather-done(%ag)
  ROOT %h = bf16[4096,4096]{{1,0}} fusion(%g, %w), kind=kCustom, calls=%gemm''')
  gather = gathered_s(NVLINK, gpus.LINK_LATENCY_S)
  gemms = 2 * (gemm_s(4096, 4096, 4096) + LAUNCH)
  assert gather < gemm_s(4096, 4096, 4096)  # so the first GEMM can hide it
  for hlo, exposed_s in ((exposed, gather), (hidden, 0.0)):
    predicted = timing.predict(hlo, H100)
    assert predicted.communication_s == pytest.approx(gather, rel=1e-12)
    assert predicted.breakdown['communication'] == pytest.approx(exposed_s, abs=1e-12)
    assert predicted.seconds == pytest.approx(gemms + exposed_s, rel=1e-12)

  # Half hidden: the add fusion lasts less than the gather, which shows for the rest.
  partly = module(f'''
  {start}
  %y = bf16[1024,1024]{{1,0}} fusion(%x, %x), kind=kLoop, calls=%add
  %w = bf16[4096,4096]{{1,0}} all-gather-done(%ag)
  ROOT %h = bf16[4096,4096]{{1,0}} fusion(%a, %w), kind=kCustom, calls=%gemm''')
  add = 3 * 2 * MiB / HBM + LAUNCH
  predicted = timing.predict(partly, H100)
  assert predicted.breakdown['communication'] == pytest.approx(gather - add, rel=1e-9)


def test_a_collective_spanning_nodes_goes_at_the_nics_speed():
  """Of 16 GPUs (8 a node), groups of 8 within a node go over NVLink; the same groups of 8 made
  of devices 0, 2, 4, … (each spanning both nodes) go over the NIC."""
  for groups, bandwidth, latency in (
      ('[2,8]<=[16]', NVLINK, gpus.LINK_LATENCY_S),
      ('[2,8]<=[8,2]T(1,0)', H100.node_bandwidth * gpus.NETWORK_EFFICIENCY,
       gpus.NETWORK_LATENCY_S)):
    hlo = module(f'''
  {GATHER.format(groups=groups)}
  ROOT %w = bf16[4096,4096]{{1,0}} all-gather-done(%ag)''', devices=16)
    assert timing.predict(hlo, H100).seconds == pytest.approx(
        gathered_s(bandwidth, latency), rel=1e-12), groups


def test_a_gemm_only_program_takes_its_flops_at_the_gemm_efficiency(h100):
  """Compiled for an H100: an 8192³ bf16 matmul is predicted at GEMM_EFFICIENCY of the peak, its
  output tiles' waves counted."""
  import jax
  import jax.numpy as jnp
  x = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16,
                           sharding=jax.sharding.SingleDeviceSharding(h100))
  hlo = jax.jit(lambda a, b: a @ b).lower(x, x).compile().as_text()
  predicted = timing.predict(hlo, H100)
  gemm, = predicted.kernels
  assert gemm.part == 'gemm' and gemm.flops == 2 * 8192**3
  assert predicted.seconds == pytest.approx(gemm_s(8192, 8192, 8192) + LAUNCH, rel=1e-9)


@functools.cache
def _compiled_for_h100(changes: tuple):
  return compiled_for_h100(**dict(changes))


def compiled_for_h100(**changes):
  """A 2-layer model big enough that its GEMMs are compute-bound, compiled for one H100."""
  config = tiny_config()
  config.model.update(d_model=1024, d_ff=4096, n_heads=8, n_kv_heads=8, head_dim=128,
                      compute_dtype='bfloat16', attention='cudnn')
  config.seq_len = 1024
  config.plan.target, config.plan.devices, config.dry_run = 'H100', 1, True
  config.model.update(changes)
  compiled, plan = compile_and_plan(build(settings.resolve(config)))
  return compiled.as_text(), plan


@pytest.mark.integration
def test_remat_full_is_predicted_slower_than_dots_by_its_recomputed_flops(h100):
  dots, dots_plan = _compiled_for_h100((('remat_policy', 'dots'),))
  full, full_plan = compiled_for_h100(remat_policy='full')
  fast, slow = timing.predict(dots, H100), timing.predict(full, H100)
  recomputed = full_plan.matmul_flops - dots_plan.matmul_flops
  assert recomputed > 0.1 * dots_plan.matmul_flops  # the projections' forward again
  rate = H100.peak_bf16_flops * gpus.GEMM_EFFICIENCY * gpus.tile_waves(8192, 1024, 1, H100.sms)
  extra_gemm_s = slow.breakdown['gemm'] - fast.breakdown['gemm']
  assert extra_gemm_s == pytest.approx(recomputed / rate, rel=0.05)
  # The recompute's cost is mostly its matmuls: `full` recomputes the element-wise work too
  # (RoPE among it, which `dots` no longer does: it keeps q and k rotated), but saves the HBM
  # traffic of `dots` writing every projection's output for the backward and reading it back,
  # and the two nearly cancel (jaxlib 0.10 predicted `full`'s fusions faster, 0.11 slower).
  assert abs(slow.breakdown['fusion'] - fast.breakdown['fusion']) < 0.15 * extra_gemm_s
  assert slow.seconds > fast.seconds
  assert full_plan.time['seconds'] == pytest.approx(slow.seconds)  # the plan carries it


@pytest.mark.integration
def test_dots_attention_keeps_cudnns_forward_for_the_backward(h100):
  """`dots` runs cuDNN's attention forward twice (the backward recomputes it for its softmax
  statistics); `dots_attention` keeps its output and statistics, so once, and the time model
  charges one forward less, for the bytes kept."""
  dots, dots_plan = _compiled_for_h100((('remat_policy', 'dots'),))
  kept, kept_plan = _compiled_for_h100((('remat_policy', 'dots_attention'),))
  for kernel in ('fmhaSoftmax', 'fmhaSoftmaxBackward'):  # the scanned layer's; a batch's packed
    count = lambda hlo: hlo.count(f'custom_call_target="__cudnn${kernel}"')  # rows: its dense
    assert (count(dots), count(kept)) == ((2, 1) if kernel == 'fmhaSoftmax' else (1, 1))  # mask
  forwards = lambda hlo: [k.seconds * k.runs for k in timing.predict(hlo, H100).kernels
                          if k.part == 'attention' and k.op.endswith('attention_fwd')]
  assert len(forwards(dots)) == 2 and len(forwards(kept)) == 1
  attention = lambda plan: plan.time['breakdown']['attention']['s']
  assert attention(dots_plan) - attention(kept_plan) == pytest.approx(forwards(kept)[0])
  assert kept_plan.temp_bytes > dots_plan.temp_bytes


@pytest.mark.integration
def test_dots_except_out_runs_the_output_projection_again_and_is_charged_for_it(h100):
  """`dots_except_out` leaves the output projection's output to the backward, which runs that
  matmul again (from attention's output, which `dots` recomputes anyway): exactly its FLOPs more
  in the compiled program, which the time model charges to the GEMMs (what it keeps, and so
  writes and reads no more: test_model.py; here the two nearly cancel)."""
  dots, dots_plan = _compiled_for_h100((('remat_policy', 'dots'),))
  lean, lean_plan = compiled_for_h100(remat_policy='dots_except_out')
  tokens, d_model, width, layers = 8 * 1024, 1024, 8 * 128, 2  # compiled_for_h100's model
  assert lean_plan.matmul_flops - dots_plan.matmul_flops == 2 * tokens * width * d_model * layers
  gemm_s = lambda hlo: timing.predict(hlo, H100).breakdown['gemm']
  assert gemm_s(lean) > gemm_s(dots)


def banked(part: str, what: str) -> str:
  """The optimized HLO a GPU compiled for a row of benchmarks/results (benchmarks/bank.py)."""
  import gzip
  with gzip.open(f'benchmarks/results/calibrate_{part}.programs.json.gz') as f:
    return json.load(f)['programs'][what]['hlo']


@pytest.mark.integration
def test_every_banked_gpu_program_is_predicted_within_the_goal():
  """What GPUs measured (benchmarks/calibrate.py's bank), re-predicted by today's model: every
  train step and GEMM of at least 4096³ within 0.85–1.18 of its time, every attention program
  (cuDNN's and ours, forward and forward+backward) and copy to or from host memory within 0.8–1.25
  (benchmarks/bank.py: GOAL)."""
  from benchmarks import bank
  checked = bank.check()
  kinds = {(c.file, c.kind) for c in checked}
  assert {(f'{part}-{gpu}', kind) for gpu in ('h100', 'h200') for part, kind in (
      ('steps_125m', 'step'), ('steps_1b', 'step'), ('gemm', 'gemm'),
      ('attention', 'attention'))} | {('host-h100', 'host')} <= kinds
  assert {c.what for c in checked if c.kind == 'attention'} >= {
      f'{impl} attention H={h} S={s}{fb}' for impl in ('cudnn', 'pallas') for h in (64, 128)
      for s in (2048, 4096, 8192) for fb in ('', ' fwd_bwd')}
  assert not bank.missing_goal(checked), [(c.what, round(c.ratio, 3))
                                          for c in bank.missing_goal(checked)]


def test_copies_to_and_from_host_memory_take_one_way_of_the_pcie_link_each():
  """The H100's measured copies (calibrate's host part): a copy to pinned host memory and one
  from it are charged host_bandwidth each; the two at once overlap but share the link (1.2-1.36×
  one way's time, as measured in two runs, not 2× and not 1×): the copy that starts second moves
  at half of host_duplex_bandwidth while the first is under way."""
  with open('benchmarks/results/calibrate_host-h100.json') as f:
    rows = {r['what']: r for r in json.load(f)['rows']}
  one_way = 2**30 / H100.host_bandwidth
  shared = H100.host_duplex_bandwidth / 2 / H100.host_bandwidth  # the second's rate, of one way's
  for way, seconds in (('to host', one_way), ('from host', one_way),
                       ('both ways', one_way * (2 - shared))):
    predicted = timing.predict(banked('host-h100', f'{way} 1024 MiB'), H100)
    assert predicted.seconds == pytest.approx(seconds)
    assert 0.8 <= predicted.seconds / rows[f'{way} 1024 MiB']['measured_s'] <= 1.25
  assert rows['both ways 1024 MiB']['measured_s'] < 1.4 * rows['to host 1024 MiB']['measured_s']


def test_offloaded_steps_are_charged_their_trips_over_the_pcie_link():
  """The H100's steps with Adam's moments in host memory, and with a scanned 125m's saved matmul
  outputs there (`offload_dots`: slices of its stacked arrays moved to and from host memory by
  asynchronous fusions, which the GPU ran in line with its kernels, 3.6× the plain step)."""
  with open('benchmarks/results/calibrate_steps_125m-h100.json') as f:
    rows = {r['what']: r for r in json.load(f)['rows']}
  steps = {variant: timing.predict(banked('steps_125m-h100', what), H100)
           for variant in ('optimizer.offload_state=True', 'model.remat_policy=offload_dots')
           for what in [f'configs/llama.py:125m cudnn default {variant}']}
  for variant, step in steps.items():
    measured = rows[f'configs/llama.py:125m cudnn default {variant}']['measured_s']
    assert 0.9 <= step.seconds / measured <= 1.1, variant
  kernels = steps['model.remat_policy=offload_dots'].kernels
  host = [k for k in kernels if k.name.startswith(('dynamic-slice-start', 'dynamic-update'))]
  assert host and sum(k.seconds * k.runs for k in host) > 0.5 * steps[
      'model.remat_policy=offload_dots'].seconds


def test_the_gpus_own_program_is_charged_its_cudnn_attention_and_fused_gemms():
  """The GPU's compile writes cuDNN's config with its keys in another order, fuses the head's
  GEMMs with their operands' slicing (a dynamic-slice fusion around a cuBLAS call), and moves a
  scanned layer's slices of its stacked arrays by asynchronous fusions: each is charged."""
  H200 = gpus.GPUS['H200']
  step = timing.predict(banked('steps_1b-h200', 'configs/llama.py:1b cudnn fp8'), H200)
  attention = [k for k in step.kernels if k.part == 'attention']
  assert {k.implementation for k in attention} == {'cudnn'} and sum(k.runs for k in attention) == 48
  head = [k for k in step.kernels if k.part == 'gemm' and k.flops == 2 * 4096 * 128256 * 2048]
  assert sum(k.runs for k in head) == 3 * 8  # logits, dx, dW for each of the 8 chunks
  copies = [k for k in step.kernels if k.name.startswith('fusion-start')]
  assert copies and all(k.part == 'other' and k.bytes > 0 for k in copies)
  assert all(k.seconds == pytest.approx(k.bytes / (H200.memory_bandwidth
                                                   * gpus.ASYNC_COPY_EFFICIENCY)) for k in copies)


def test_cudnn_with_the_document_bias_is_charged_its_measured_slowdown():
  """The banked 1b step whose cuDNN took the document mask as a bias (packed rows before the
  packed layout, or with cudnn_segments=0) against the same step without segment ids."""
  import gzip
  H200 = gpus.GPUS['H200']
  with gzip.open('benchmarks/results/calibrate_steps_1b-h200.programs.json.gz') as f:
    programs = json.load(f)['programs']
  with_bias = next(hlo for what, hlo in ((w, p['hlo']) for w, p in programs.items())
                   if what.startswith('configs/llama.py:1b cudnn default packed')
                   and 'fmhaScaleBiasSoftmax' in hlo)
  plain, biased = (
      {k.op.rsplit('/', 1)[-1]: k for k in timing.predict(hlo, H200).kernels
       if k.part == 'attention'}
      for hlo in (banked('steps_1b-h200', 'configs/llama.py:1b cudnn default'), with_bias))
  for name, k in plain.items():
    backward = 'bwd' in name
    assert biased[name].flops == k.flops
    assert biased[name].seconds == pytest.approx(
        k.seconds * gpus.CUDNN_BIAS_SLOWDOWN[backward], rel=1e-6), name


def test_our_kernels_with_segment_ids_are_charged_their_measured_slowdown():
  """The H100's banked 1b step with packed rows on our kernels (segment ids in every call)
  against the same step without: each kernel charged PALLAS_SEGMENT_SLOWDOWN more; the zigzag
  ring's query positions (one int32 operand) are not segment ids."""
  H100 = gpus.GPUS['H100']
  plain, packed = (
      sorted((k for k in timing.predict(banked('steps_1b-h100', what), H100).kernels
              if k.part == 'attention'), key=lambda k: k.op)
      for what in ('configs/llama.py:1b pallas default', 'configs/llama.py:1b pallas default packed'))
  assert [k.op for k in plain] == [k.op for k in packed] and len(plain) >= 3
  for k, s in zip(plain, packed):  # op: flash_attention_{fwd,dq,dkv}/pallas_call
    part = k.op.split('/')[0].removeprefix('flash_attention_')
    assert s.flops == k.flops
    assert s.seconds == pytest.approx(k.seconds * gpus.PALLAS_SEGMENT_SLOWDOWN[part], rel=1e-6)
  assert timing._segment_ids([[('s32', (8, 4096))], [('s32', (8, 4096))]])
  assert not timing._segment_ids([[('bf16', (8, 4096, 32, 64))], [('s32', (8, 4096))]])


def test_the_plan_says_which_parts_no_gpu_has_fitted():
  """Collectives and our grouped matmul run at priors: the plan says so beside their time, and
  says nothing of a part that takes none."""
  from planning.plan import time_rows
  part = lambda s: {'s': s, 'share': 0.5}
  time = {'seconds': 1.0, 'tokens_per_s_per_device': 1.0, 'mfu': 0.5, 'gpu': 'H100',
          'communication_s': 0.5, 'kernels': [{'s': 0.1, 'part': 'gemm', 'op': 'x/dot_general',
                                               'name': 'gemm_fusion', 'runs': 1}],
          'breakdown': {'gemm': part(0.5), 'communication': part(0.5)}}
  rows = dict(time_rows(time))
  assert 'collectives at priors' in rows['  exposed communication']
  assert 'prior' not in rows['  GEMMs']
  time['kernels'][0]['op'] = 'grouped_matmul/pallas_call'
  time['breakdown']['communication'] = part(0.0)
  rows = dict(time_rows(time))
  assert 'grouped matmul at a prior' in rows['  GEMMs']
  assert 'prior' not in rows['  exposed communication']
