"""The time model: how long one run of a compiled GPU program takes, predicted kernel by kernel
from the program XLA compiled for the GPU (after fusion and scheduling) and the efficiencies of
planning/gpus.py. A prediction, never a measurement; what prints it says so.

Every instruction of every computation the program runs (ENTRY, loop bodies, the slowest branch of
a conditional), each counted once per run of its loop, is one of:
  gemm       a dot: in a Triton GEMM fusion, a cuBLAS or cuBLASLt custom call (fp8 too), or left
             alone. 2·batch·M·N·K FLOPs at its operands' peak (fp8; bf16 and f16; f32 as TF32,
             half of bf16's) × GEMM_EFFICIENCY (FP8_GEMM_EFFICIENCY) × the share of the SMs its
             output tiles keep busy (gpus.tile_waves). Tiles the deviceless compile chose are
             ignored: on the GPU, XLA autotunes them.
  grouped    our grouped matmul's kernels (kernels/grouped_matmul.py, an MoE layer's experts):
             2·M·K·N FLOPs, M the rows its name says the groups fill (a buffer sized for the
             worst case is mostly padding, which it skips), at gpus.GROUPED_GEMM_EFFICIENCY of
             the bf16 peak; the bytes of those rows, its other operands and its whole output;
             counted with the GEMMs
  attention  cuDNN's fused attention and our Pallas kernels (flash_attention_fwd, _dq, _dkv):
             FlashAttention's FLOPs (forward 4·B·N·L·S·H, causal the share 1 − L/2S of the keys a
             query sees: half when L = S, the last device's share with keys all-gathered over a
             sequence split; backward 2.5 × forward, split 3 : 4 between our dq and dkv kernels as
             their matmuls are) at gpus.ATTENTION_TFLOPS for the kernel, direction, head dim and
             keys per query (ATTENTION_LENGTH_FACTOR)
  fusion     any other fusion: the HBM bytes it reads and writes, a parameter read only through a
             slice counting the slice and the buffer a dynamic-update-slice writes in place only
             the update; its element-wise arithmetic at the CUDA cores' FP32 rate
  other      copies, other custom calls (other Triton kernels) and lone ops, as fusions
A kernel takes max(FLOPs / (peak × efficiency), bytes / (HBM bandwidth × HBM_EFFICIENCY)), and
every launch (collectives' too) KERNEL_LAUNCH_S more.

A collective costs the bytes each device sends (sharding/collectives.py's ring model) over the
NVLink bandwidth × LINK_EFFICIENCY, or the NIC's × NETWORK_EFFICIENCY where its groups span
nodes (gpus_per_node GPUs a node, in device order), plus LINK_LATENCY_S (NETWORK_LATENCY_S); a
copy to or from host memory (offloaded state) its bytes over the PCIe link, whose two ways run at
once (one stream each way: the H100 copied 1 GiB each way at once in 1.20× one way's time,
benchmarks/results/calibrate_host-h100.json). The compiled schedule
decides what hides them: each computation runs its instructions in order on a compute stream; an
async collective runs on a communication stream from its -start, one at a time in the order
started, and its -done waits for it. So a collective is hidden as far as the kernels scheduled
between its start and done last, and exposed for the rest; a synchronous one is exposed whole. A
loop body's schedule runs trip-count times (once where XLA states none, a trip count that depends
on the data: StepTime.loops_charged_once counts such loops); a -done whose -start an earlier
iteration issued (XLA's collective pipelining) counts from the start of the body.

Why not XLA's own GPU cost model: the one its latency-hiding scheduler can use
(--xla_gpu_enable_analytical_latency_estimator) is not in what a compile returns
(`cost_analysis()` is None for these programs), only in verbose logs, and there it charges a cuBLAS
GEMM at the CUDA cores' FP32 rate: 514 µs for a 1024×4096×4096 bf16 GEMM an H100 runs in about
45 µs. docs/time-model.md has the comparison.
"""

import dataclasses
import math
import re

import kernels
from kernels.flash_attention import keys_seen
from planning import gpus
from sharding import collectives, hlo

PARTS = ('gemm', 'attention', 'fusion', 'other', 'communication', 'launch')
_FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'after-all',
         'partition-id', 'replica-id', 'add-dependency', 'opt-barrier', 'domain'}
_ARITHMETIC = {'add', 'subtract', 'multiply', 'divide', 'exponential', 'log', 'tanh', 'rsqrt',
               'sqrt', 'power', 'maximum', 'minimum', 'negate', 'compare', 'select', 'logistic',
               'exponential-minus-one', 'log-plus-one', 'cosine', 'sine', 'abs', 'clamp',
               'convert', 'and', 'or', 'not', 'is-finite', 'remainder', 'atan2', 'floor'}
_DIMS = re.compile(r'\b(lhs|rhs)_(batch|contracting)_dims=\{([0-9,]*)\}')
_GEMM_DIMS = re.compile(r'"(lhs|rhs)_(batch|contracting)_dimensions":\[([^\]]*)\]')
_FLASH = re.compile(r'flash_attention_(fwd|dq|dkv)')
_HOPPER = re.compile(r'flash_attention_hopper_(fwd|dq|dkv)')  # ours in Mosaic GPU
# Our kernels' mask scope (kernels/flash_attention.py: _Static.scope): `/unmasked/`, or
# `jvp(unmasked)` and `transpose(jvp(unmasked))` where the kernel is differentiated
_UNMASKED = re.compile(r'[/(]unmasked[/)]')
# `windowed_0213`: a sliding window leaves 21.3% of causal attention's work (kernels/flash_attention.py)
_WINDOWED = re.compile(r'[/(]windowed_(\d{4})[/)]')
_CUDNN_WINDOW = re.compile(r'"sliding_window_length":\s*"?(\d+)')  # its backend config's
_GROUPED = re.compile(r'grouped_matmul(?:_dw)?(?:_filled(\d+))?/pallas_call')
# cuDNN's scores [B, N, L, S], in its backend config: a deviceless compile writes the element type
# first and the dims as numbers, the GPU's own compile the dims first, as strings
_SCORES = re.compile(r'"intermediate_tensor_shape":\{[^{}]*?"dimensions":\[([^\]]*)\]')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
BACKWARD_SHARE = {'dq': 3 / 7, 'dkv': 4 / 7}  # of the backward's matmuls: 3 in dq, 4 in dkv


@dataclasses.dataclass
class Kernel:
  """One kernel launch of the program, as the model charges it."""
  name: str  # the instruction
  op: str  # what it computes: the JAX operation it comes from, or its custom call
  part: str  # gemm, attention, fusion or other (PARTS)
  flops: float  # one run's, as its efficiency counts them
  bytes: float  # HBM bytes one run reads and writes
  seconds: float  # one run, launch excluded
  runs: int = 0  # per run of the program
  implementation: str = ''  # an attention's: cudnn, pallas or hopper


@dataclasses.dataclass
class StepTime:
  """The model's prediction for one run of a program."""
  seconds: float
  breakdown: dict[str, float]  # {part of PARTS: seconds of the run}; communication is exposed
  kernels: list[Kernel]  # every kernel that runs, costliest (seconds × runs) first
  communication_s: float  # every collective's time, hidden or not
  launches: int
  loops_charged_once: int = 0  # while loops whose trip count XLA does not state (it depends on
                               # the data): each body is charged one run, so the step is undercounted

  @property
  def gemm_flops(self) -> float:
    """The matmul FLOPs of one run: every dot and GEMM, each run counted (recomputation too)."""
    return sum(k.flops * k.runs for k in self.kernels if k.part == 'gemm')

  def table(self, top: int = 10) -> dict:
    """As the plan's JSON has it: the parts with their shares, and the costliest kernels."""
    return {'seconds': self.seconds, 'source': 'model',
            'breakdown': {part: {'s': s, 'share': s / self.seconds if self.seconds else 0.0}
                          for part, s in self.breakdown.items()},
            'communication_s': self.communication_s, 'launches': self.launches,
            'kernels': [{'name': k.name, 'op': k.op, 'part': k.part, 'runs': k.runs,
                         's': k.seconds * k.runs, 'flops': k.flops * k.runs,
                         'bytes': k.bytes * k.runs} for k in self.kernels[:top]]}


def predict(hlo_text: str, gpu: gpus.GPU) -> StepTime:
  """The time one run of the compiled program takes on `gpu`, per the module docstring."""
  computations, entry, devices = hlo.parse(hlo_text)
  model = _Model(computations, devices, gpu)
  seconds = model.run(entry, 1) if entry else 0.0
  kernels = sorted((k for k in model.kernels.values() if k.runs),
                   key=lambda k: -k.seconds * k.runs)
  breakdown = dict.fromkeys(PARTS, 0.0)
  for k in kernels:
    breakdown[k.part] += k.seconds * k.runs
  breakdown['launch'] = model.launches * gpus.KERNEL_LAUNCH_S
  breakdown['communication'] = max(0.0, seconds - sum(breakdown.values()))
  unknown = sum(1 for name, lines in computations.items() for line in lines
                if (inst := hlo.instruction(line)) and inst.opcode == 'while'
                and hlo.trips(inst, computations, name) is None)
  return StepTime(seconds, breakdown, kernels, model.communication_s, model.launches, unknown)


def attention_efficiency(kernel: str, backward: bool, head_dim: int, keys: int) -> float:
  """The share of the bf16 peak a fused attention kernel reaches (planning/gpus.py)."""
  by_head_dim = gpus.ATTENTION_TFLOPS[kernel]
  by_keys = by_head_dim[min(by_head_dim, key=lambda h: (abs(h - head_dim), h))]
  lengths = sorted(by_keys)
  tflops = [by_keys[n][int(backward)] for n in lengths]
  if keys <= lengths[0]:
    short = sorted(gpus.ATTENTION_LENGTH_FACTOR)
    if keys <= short[0]:
      factor = gpus.ATTENTION_LENGTH_FACTOR[short[0]] * keys / short[0]
    else:
      i = next(i for i, n in enumerate(short) if n >= keys) - 1
      factor = _geometric(keys, short[i], short[i + 1], gpus.ATTENTION_LENGTH_FACTOR[short[i]],
                          gpus.ATTENTION_LENGTH_FACTOR[short[i + 1]])
    rate = tflops[0] * factor
  elif keys >= lengths[-1]:
    rate = tflops[-1]
  else:
    i = next(i for i, n in enumerate(lengths) if n >= keys) - 1
    rate = _geometric(keys, lengths[i], lengths[i + 1], tflops[i], tflops[i + 1])
  return rate * 1e12 / gpus.ATTENTION_MEASURED_ON


def _segment_ids(operand_arrays) -> bool:
  """Whether our kernel reads segment ids: a pair of int32 [B, length] operands (a query's
  positions, under the zigzag ring, are one)."""
  return sum(dtype == 's32' and len(dims) == 2
             for arrays in operand_arrays for dtype, dims in arrays) >= 2


def _geometric(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
  """y at x, geometric in x between (x0, y0) and (x1, y1)."""
  return y0 * (y1 / y0) ** (math.log(x / x0) / math.log(x1 / x0))


def attention_seconds(kernel: str, head_dim: int, keys: int) -> float:
  """The time model's seconds for one FLOP of causal attention forward and backward (backward
  2.5 × the forward's FLOPs) with `kernel` on a GPU of 1 FLOP/s bf16 peak: a rate to rank
  kernels by, the same on every GPU of planning/gpus.py."""
  return (1 / attention_efficiency(kernel, False, head_dim, keys)
          + 2.5 / attention_efficiency(kernel, True, head_dim, keys)) / 3.5


def rank_attention(head_dim: int, compute_dtype: str, keys: int, length_split: bool,
                   gpu: gpus.GPU, windows: str = 'none', lse: bool = False
                   ) -> list[tuple[str, float]]:
  """[(kernel, its time ÷ the fastest's)] of the fused attentions that run this model on `gpu`
  (kernels.fused_for: ours for Hopper on sm_90 only), fastest first, as the time model charges a
  train step's attention; a tie keeps fused_for's order (cuDNN, ours in Triton, in Mosaic GPU)."""
  runnable = kernels.fused_for(head_dim, compute_dtype, length_split,
                               hopper=gpu.compute_capability == (9, 0), windows=windows,
                               lse=lse)
  seconds = {k: attention_seconds(k, head_dim, keys) for k in runnable}
  fastest = min(seconds.values())
  return sorted(((k, t / fastest) for k, t in seconds.items()), key=lambda kt: kt[1])


class _Model:
  """Walks the program's computations, charging kernels and simulating the streams."""

  def __init__(self, computations: dict, devices: int, gpu: gpus.GPU):
    self.computations, self.devices, self.gpu = computations, devices, gpu
    self.kernels: dict[tuple[str, str], Kernel] = {}
    self.launches = 0
    self.communication_s = 0.0
    self._parsed = {}

  def instructions(self, computation: str) -> list[hlo.Instruction]:
    if computation not in self._parsed:
      self._parsed[computation] = [i for line in self.computations.get(computation, ())
                                   if (i := hlo.instruction(line))]
    return self._parsed[computation]

  def run(self, computation: str, runs: int) -> float:
    """Seconds one run of `computation` takes; records its kernels as run `runs` times (0: only
    the time)."""
    instructions = self.instructions(computation)
    types = {i.name: i.arrays for i in instructions}
    starts, dones = {}, {}  # a collective's start index → (done index, seconds); done → seconds
    for begin, done, c in collectives.in_computation([i.line for i in instructions], self.devices):
      seconds = self.collective_seconds(c)
      starts[begin], dones[done] = (done, seconds), seconds
      self.communication_s += seconds * runs
    now = comm_free = 0.0  # when the compute and communication streams free up
    host_free = {True: 0.0, False: 0.0}  # the PCIe link's two ways (to the host, from it) likewise
    finish = {}  # a collective's done index, or a host copy's start name → when it is over
    for index, inst in enumerate(instructions):
      op = inst.opcode
      if index in starts and not op.endswith('-done'):  # a start, or a synchronous collective
        done, seconds = starts[index]
        comm_free = max(now, comm_free) + seconds
        if done == index:
          now = comm_free
        finish[done] = comm_free
      elif index in dones:  # a done; without its start here, started by an earlier iteration
        now = max(now, finish.get(index, dones[index]))
      elif op == 'copy-start' and ':S(5)' in inst.line:  # to or from host memory
        to_host = ':S(5)' in inst.type[:inst.type.index('}') + 1]  # the copy's result is there
        host_free[to_host] = self.host_copy(max(now, host_free[to_host]), host_free[not to_host],
                                            hlo.nbytes(inst.arrays[:1]))
        finish[inst.name] = host_free[to_host]
      elif op == 'copy-done' and inst.operands and inst.operands[0] in finish:
        now = max(now, finish[inst.operands[0]])
      elif op == 'while':
        callees, trips = dict(inst.callees()), hlo.trips(inst, self.computations, computation) or 1
        now += (trips * self.run(callees['body'], runs * trips)
                + (trips + 1) * self.run(callees['condition'], runs * (trips + 1)))
      elif op == 'conditional':  # its slowest branch; not cuDNN's fallback for overfull rows
        branches = [callee for _, callee in inst.callees()]
        branches = [b for b in branches if not self.falls_back(b)] or branches
        slowest = max(branches, key=lambda b: self.run(b, 0))
        now += self.run(slowest, runs)
      elif op in ('call', 'async-start'):
        now += sum(self.run(callee, runs) for kind, callee in inst.callees()
                   if kind in ('to_apply', 'calls'))
      elif op == 'fusion-start' or not (op in _FREE or op.startswith('async-')
                                        or op.endswith(('-start', '-done'))):
        # an asynchronous fusion-start: a slice of a stacked array moved by memcpy, on the stream
        kernel = self.async_copy(inst) if op == 'fusion-start' else self.kernel(inst, types)
        now += kernel.seconds + gpus.KERNEL_LAUNCH_S
        if runs:
          self.kernels.setdefault((computation, inst.name), kernel).runs += runs
          self.launches += runs
    return now

  def falls_back(self, computation: str) -> bool:
    """Whether `computation` (or one it calls) is cuDNN's dense-mask fallback: a step takes it
    only when a packed row holds more documents than its packed layout (kernels/attention.py)."""
    return any(kernels.DENSE_FALLBACK in i.op_name or any(
        self.falls_back(callee) for _, callee in i.callees())
        for i in self.instructions(computation))

  def collective_seconds(self, c: collectives.Collective) -> float:
    if c.group <= 1 or not c.sent_bytes:
      return 0.0
    if c.crosses(lambda device: device // self.gpu.gpus_per_node):
      return (c.sent_bytes / (self.gpu.node_bandwidth * gpus.NETWORK_EFFICIENCY)
              + gpus.NETWORK_LATENCY_S)
    return c.sent_bytes / (self.gpu.link_bandwidth * gpus.LINK_EFFICIENCY) + gpus.LINK_LATENCY_S

  def kernel(self, inst: hlo.Instruction, types: dict) -> Kernel:
    """The kernel `inst` launches, with its one-run time."""
    op, operand_arrays = inst.opcode, [types.get(name, ()) for name in inst.operands]
    target = m.group(1) if (m := _TARGET.search(inst.line)) else ''
    what = inst.op_name.rsplit('/', 2)
    what = '/'.join(what[-2:]) if what[0] else target or op
    if op == 'fusion':
      body = dict(inst.callees()).get('calls', '')
      # XLA fuses the dynamic slices of a scanned layer's operands into an FFI custom call's
      # launch (a kCustom "dynamic-slice-fusion": ours in Mosaic GPU): the call is the kernel
      inner = self.instructions(body)
      calls = [i for i in inner if i.opcode == 'custom-call']
      if len(calls) == 1 and _HOPPER.search(calls[0].op_name):
        return self.kernel(calls[0], {i.name: i.arrays for i in inner})
      dots = self.dots(body)
      read, written, arithmetic = self.fusion_bytes(body)
      if dots:
        return self.gemm(inst.name, what, dots, read + written)
      return self.timed(Kernel(inst.name, what, 'fusion', arithmetic, read + written, 0.0),
                        self.gpu.vector_flops)
    if op == 'custom-call' and target.startswith('__cudnn$fmha') and _SCORES.search(
        inst.line.replace(' ', '')):
      return self.attention(inst, 'cudnn', operand_arrays, what)
    # ours, the call that takes q[B, L, N, H] first (interpreted, a kernel is many callbacks)
    ours = op == 'custom-call' and len(operand_arrays) > 1 and len(operand_arrays[0][0][1]) == 4
    if ours and (flash := _FLASH.search(inst.op_name)):
      return self.attention(inst, 'pallas', operand_arrays, what, flash.group(1))
    if ours and (flash := _HOPPER.search(inst.op_name)):
      return self.attention(inst, 'hopper', operand_arrays, what, flash.group(1))
    if op == 'custom-call' and (grouped := _GROUPED.search(inst.op_name)):
      return self.grouped(inst, operand_arrays, what, grouped)
    moved = hlo.nbytes(a for arrays in operand_arrays for a in arrays)
    if op == 'custom-call' and target.startswith('__cublas'):
      dims = {(side, kind): _ints(value) for side, kind, value in _GEMM_DIMS.findall(inst.line)}
      dot = _dot(operand_arrays[0][0], operand_arrays[1][0], inst.arrays[0], dims)
      return self.gemm(inst.name, what, [dot], moved + hlo.nbytes(inst.arrays[:1]))
    if op in ('dot', 'convolution'):
      dims = {(side, kind): _ints(value) for side, kind, value in _DIMS.findall(inst.line)}
      dot = _dot(operand_arrays[0][0], operand_arrays[1][0], inst.arrays[0], dims)
      return self.gemm(inst.name, what, [dot], moved + hlo.nbytes(inst.arrays))
    written = hlo.nbytes(inst.arrays)
    if op in ('dynamic-slice', 'slice'):
      moved = 0
    elif op == 'dynamic-update-slice':
      moved, written = hlo.nbytes(operand_arrays[1]), hlo.nbytes(operand_arrays[1])
    return self.timed(Kernel(inst.name, what, 'other', 0.0, moved + written, 0.0), 1.0)

  def host_copy(self, start: float, other_way_free: float, nbytes: int) -> float:
    """When a copy over the PCIe link that starts at `start` ends: at host_bandwidth, but at half
    of host_duplex_bandwidth while the other way is still busy (the H100 took 1.17-1.35x one
    way's time for both at once). The copy that starts second bears the sharing: the first's end
    is already scheduled, and both together come to what was measured."""
    shared_rate = self.gpu.host_duplex_bandwidth / 2
    shared = min(nbytes, max(0.0, other_way_free - start) * shared_rate)
    return start + shared / shared_rate + (nbytes - shared) / self.gpu.host_bandwidth

  def async_copy(self, inst: hlo.Instruction) -> Kernel:
    """An asynchronous (dynamic-)slice or update-slice fusion: its bytes at the copies' rate; a
    slice of an array in host memory (a scanned layer's offloaded activations) crosses the PCIe
    link instead, in line with the kernels (the H100 ran them on its compute stream)."""
    read, written, _ = self.fusion_bytes(dict(inst.callees()).get('calls', ''))
    kernel = Kernel(inst.name, inst.op_name.rsplit('/', 1)[-1] or 'fusion-start', 'other', 0.0,
                    read + written, 0.0)
    if ':S(5)' in inst.line:
      kernel.seconds = written / self.gpu.host_bandwidth
    else:
      kernel.seconds = kernel.bytes / (self.gpu.memory_bandwidth * gpus.ASYNC_COPY_EFFICIENCY)
    return kernel

  def timed(self, kernel: Kernel, flops_per_s: float) -> Kernel:
    kernel.seconds = max(kernel.flops / flops_per_s,
                         kernel.bytes / (self.gpu.memory_bandwidth * gpus.HBM_EFFICIENCY))
    return kernel

  def gemm(self, name: str, what: str, dots: list, moved: float) -> Kernel:
    """A kernel of dots: [(batch, m, n, k, operand dtype)], each at its tile waves."""
    compute = 0.0
    for batch, m, n, k, dtype in dots:
      if dtype.startswith('f8') or dtype in ('s8', 'u8'):
        rate = self.gpu.peak_fp8_flops * gpus.FP8_GEMM_EFFICIENCY
      elif dtype in ('bf16', 'f16'):
        rate = self.gpu.peak_bf16_flops * gpus.GEMM_EFFICIENCY
      elif dtype == 'f32':  # TF32 tensor cores
        rate = self.gpu.peak_bf16_flops / 2 * gpus.GEMM_EFFICIENCY
      else:
        rate = self.gpu.vector_flops
      compute += 2 * batch * m * n * k / (rate * gpus.tile_waves(m, n, batch, self.gpu.sms))
    flops = sum(2 * batch * m * n * k for batch, m, n, k, _ in dots)
    kernel = Kernel(name, what, 'gemm', flops, moved, 0.0)
    kernel.seconds = max(compute, moved / (self.gpu.memory_bandwidth * gpus.HBM_EFFICIENCY))
    return kernel

  def grouped(self, inst, operand_arrays, what: str, match) -> Kernel:
    """Our grouped matmul, forward (x[M, K] · w[G, K, N]) or weight gradient (x[M, K]ᵀ ·
    dy[M, N] → dw[G, K, N]): x is its first floating-point operand, N its output's last dim. Of
    the M-row operands it reads the filled rows only; it writes its whole output (the forward
    stores zeros in the padding)."""
    operands = [a for arrays in operand_arrays for a in arrays]
    (_, (M, K)) = next(a for a in operands if not a[0].startswith(('s', 'u')))
    filled = int(match.group(1)) / 1e4 if match.group(1) else 1.0
    rows = [a for a in operands if len(a[1]) == 2 and a[1][0] == M]
    moved = (filled * hlo.nbytes(rows) + hlo.nbytes(a for a in operands if a not in rows)
             + hlo.nbytes(inst.arrays))
    flops = 2 * M * filled * K * inst.arrays[0][1][-1]
    return self.timed(Kernel(inst.name, what, 'gemm', flops, moved, 0.0),
                      self.gpu.peak_bf16_flops * gpus.GROUPED_GEMM_EFFICIENCY)

  def attention(self, inst, kernel: str, operand_arrays, what: str, part: str = '') -> Kernel:
    (_, q), (_, k) = operand_arrays[0][0], operand_arrays[1][0]
    if kernel == 'cudnn':  # the scores' [B, N, L, S] is in its config; q's dims in any order
      B, N, L, S = _ints(_SCORES.search(inst.line.replace(' ', '')).group(1))
      H = math.prod(q) // (B * N * L)
      causal = 'CAUSAL' in inst.line
      backward = 'Backward' in inst.line
      share = 1.0
    else:  # ours: q[B, L, N, H], k[B, S, K, H]
      (B, L, N, H), S = q, k[1]
      causal = not _UNMASKED.search(inst.op_name)
      backward, share = part != 'fwd', BACKWARD_SHARE.get(part, 1.0)
    forward = 4 * B * N * L * S * H * ((1 - L / (2 * S)) if causal and L <= S else 1.0)
    if kernel != 'cudnn' and (windowed := _WINDOWED.search(inst.op_name)):
      forward *= int(windowed.group(1)) / 1000
    elif kernel == 'cudnn' and (window := _CUDNN_WINDOW.search(inst.line)) and int(window[1]):
      forward *= keys_seen(S, int(window[1])) / keys_seen(S)
    flops = forward * (2.5 * share if backward else 1.0)
    moved = hlo.nbytes(a for arrays in operand_arrays for a in arrays) + hlo.nbytes(inst.arrays)
    efficiency = attention_efficiency(kernel, backward, H, S)
    if kernel == 'cudnn' and 'Bias' in (_TARGET.search(inst.line) or [''])[0]:
      efficiency /= gpus.CUDNN_BIAS_SLOWDOWN[int(backward)]
    if kernel == 'pallas' and _segment_ids(operand_arrays):
      efficiency /= gpus.PALLAS_SEGMENT_SLOWDOWN[part]
    return self.timed(Kernel(inst.name, what, 'attention', flops, moved, 0.0,
                             implementation=kernel), self.gpu.peak_bf16_flops * efficiency)

  def dots(self, computation: str) -> list:
    """The dots of a fused computation (and of the fusions nested in it)."""
    found = []
    instructions = self.instructions(computation)
    types = {i.name: i.arrays for i in instructions}
    for inst in instructions:
      if inst.opcode == 'dot':
        dims = {(side, kind): _ints(value) for side, kind, value in _DIMS.findall(inst.line)}
        found.append(_dot(types[inst.operands[0]][0], types[inst.operands[1]][0],
                          inst.arrays[0], dims))
      elif inst.opcode == 'custom-call' and _TARGET.search(inst.line).group(1).startswith(
          '__cublas'):  # a GEMM XLA fused with the slicing of its operands or output
        dims = {(side, kind): _ints(value) for side, kind, value in _GEMM_DIMS.findall(inst.line)}
        found.append(_dot(types[inst.operands[0]][0], types[inst.operands[1]][0],
                          inst.arrays[0], dims))
      elif inst.opcode == 'fusion':
        found += self.dots(dict(inst.callees()).get('calls', ''))
    return found

  def fusion_bytes(self, computation: str) -> tuple[float, float, float]:
    """(HBM bytes read, bytes written, element-wise FLOPs) of one run of a fused computation."""
    instructions = self.instructions(computation)
    by_name = {i.name: i for i in instructions}
    users = {}
    for inst in instructions:
      for position, operand in enumerate(inst.operands):
        users.setdefault(operand, []).append((inst, position))

    def read(name: str) -> float:
      whole, part = hlo.nbytes(by_name[name].arrays), 0.0
      for user, position in users.get(name, ()):
        if user.opcode in ('dynamic-slice', 'slice', 'gather') and position == 0:
          part += hlo.nbytes(user.arrays)
        elif user.opcode in ('dynamic-update-slice', 'scatter') and position == 0:
          continue  # written in place: only the update moves
        elif user.opcode == 'bitcast':
          part += read(user.name)
        else:
          return whole
      return min(part, whole)

    def written(inst: hlo.Instruction) -> float:
      if inst.opcode == 'tuple':
        return sum(written(by_name[name]) for name in inst.operands)
      if inst.opcode == 'bitcast':
        return written(by_name[inst.operands[0]])
      if inst.opcode == 'dynamic-update-slice':
        return hlo.nbytes(by_name[inst.operands[1]].arrays)
      if inst.opcode == 'scatter':
        return hlo.nbytes(by_name[inst.operands[-1]].arrays)
      return hlo.nbytes(inst.arrays)

    root = next((i for i in instructions if i.root), instructions[-1] if instructions else None)
    reads = sum(read(i.name) for i in instructions if i.opcode == 'parameter')
    arithmetic = sum(math.prod(i.arrays[0][1]) if i.opcode in _ARITHMETIC else
                     math.prod(by_name[i.operands[0]].arrays[0][1]) if i.opcode == 'reduce' else 0
                     for i in instructions if i.arrays)
    return reads, written(root) if root else 0.0, arithmetic


def _ints(text: str) -> list[int]:
  return [int(x.strip('" ')) for x in text.split(',') if x.strip('" ')]


def _dot(lhs, rhs, out, dims) -> tuple[int, int, int, int, str]:
  """(batch, m, n, k, lhs dtype) of a dot from its operands' and result's (dtype, shape)."""
  (dtype, lhs_shape), _ = lhs, rhs
  batch_dims = dims.get(('lhs', 'batch'), [])
  contracting = dims.get(('lhs', 'contracting'), [])
  batch = math.prod(lhs_shape[d] for d in batch_dims)
  k = math.prod(lhs_shape[d] for d in contracting)
  m = math.prod(s for d, s in enumerate(lhs_shape) if d not in batch_dims and d not in contracting)
  n = math.prod(out[1]) // max(batch * m, 1)
  return batch, m, n, k, dtype
