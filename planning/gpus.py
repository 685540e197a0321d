"""The GPUs meshlm knows: one table of what each device is, for planning, MFU and compiling for a
GPU that is not there (planning/gpu_compiler.py), and what kernels reach of its peaks (the time
model's efficiencies, planning/timing.py).

Figures come from NVIDIA's public datasheets and the CUDA programming guide's compute-capability
tables; `memory_bytes` and `l2_bytes` are what the device itself reports (nvidia-smi, CUDA device
properties), which is a little less than the datasheet's "80 GB". `target_config` writes a
device's description as XLA's GpuTargetConfigProto text, which is all a deviceless compile knows
about the device: compute capability, SMs, shared memory and registers (these bound what a Triton
kernel may use), memory size and bandwidth, L2, clock, CUDA 13 (the plugin's; XLA rewrites fp8
matmuls into cuBLASLt's fp8 GEMMs only from CUDA 12 on) and cuDNN 9.12 (the oldest the CUDA
plugin accepts).
"""

import dataclasses
import os

MiB = 2**20
CUDA_VERSION = '13.0.0'  # the jax[cuda13] plugin's runtime, as a device on it would report it


@dataclasses.dataclass(frozen=True)
class GPU:
  name: str  # what config.plan.target takes
  device_kind: str  # what jax reports as device.device_kind for this device
  compute_capability: tuple[int, int]
  sms: int
  clock_ghz: float  # boost clock
  fp32_units_per_sm: int
  shared_memory_per_sm: int  # bytes
  shared_memory_per_block_optin: int  # bytes a kernel may ask for (opt-in above 48 KiB)
  registers_per_sm: int  # 32-bit registers; also the most one block may use
  l2_bytes: int
  memory_bytes: int  # HBM as the device reports it
  memory_bandwidth: float  # bytes/s
  peak_bf16_flops: float  # dense tensor-core FLOP/s, no sparsity
  peak_fp8_flops: float  # likewise for fp8 operands; 0 where there are no fp8 tensor cores
  link_bandwidth: float  # bytes/s per direction to each other GPU of a node (NVLink or PCIe)
  node_bandwidth: float  # bytes/s per direction from each GPU to other nodes (its NIC's share)
  host_bandwidth: float  # bytes/s each way between the GPU and host memory (its PCIe link)
  host_duplex_bandwidth: float  # bytes/s the two ways carry together while both are busy (less
  # than twice one way: the link's two ways share the host's memory and the GPU's copy engines)
  gpus_per_node: int = 8

  @property
  def vector_flops(self) -> float:
    """FP32 FLOP/s of the CUDA cores (an FMA is two): what a fusion's arithmetic runs at."""
    return 2 * self.fp32_units_per_sm * self.sms * self.clock_ghz * 1e9


GPUS = {gpu.name: gpu for gpu in (
    GPU(name='A100', device_kind='NVIDIA A100-SXM4-80GB', compute_capability=(8, 0), sms=108,
        clock_ghz=1.41, fp32_units_per_sm=64, shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024, registers_per_sm=65536,
        l2_bytes=40 * MiB, memory_bytes=81920 * MiB, memory_bandwidth=2.039e12,
        peak_bf16_flops=312e12, peak_fp8_flops=0,
        link_bandwidth=300e9,  # NVLink 3: 600 GB/s both ways
        node_bandwidth=25e9,  # DGX A100: a 200 Gb/s HDR InfiniBand NIC per GPU
        # PCIe Gen4 x16; both ways at once: the H100's measured share of two ways
        host_bandwidth=32e9, host_duplex_bandwidth=50e9),
    GPU(name='H100', device_kind='NVIDIA H100 80GB HBM3', compute_capability=(9, 0), sms=132,
        clock_ghz=1.98, fp32_units_per_sm=128, shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024, registers_per_sm=65536,
        l2_bytes=50 * MiB, memory_bytes=81559 * MiB, memory_bandwidth=3.35e12,
        peak_bf16_flops=989e12, peak_fp8_flops=1979e12,
        link_bandwidth=450e9,  # H100 SXM; NVLink 4: 900 GB/s both ways
        node_bandwidth=50e9,  # DGX H100: a 400 Gb/s NDR InfiniBand NIC per GPU
        # PCIe Gen5 x16 (64 GB/s nominal) as measured: 55.1 GB/s each way, to or from pinned host
        # memory, and 86 GB/s both ways at once (benchmarks/results/calibrate_host-h100.json)
        host_bandwidth=55e9, host_duplex_bandwidth=86e9),
    GPU(name='H100-PCIe', device_kind='NVIDIA H100 PCIe', compute_capability=(9, 0), sms=114,
        clock_ghz=1.755, fp32_units_per_sm=128, shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024, registers_per_sm=65536,
        l2_bytes=50 * MiB, memory_bytes=81559 * MiB, memory_bandwidth=2.0e12,
        peak_bf16_flops=756e12, peak_fp8_flops=1513e12,
        link_bandwidth=64e9,  # PCIe Gen5 x16 between cards
        node_bandwidth=25e9,  # a 200 Gb/s NIC per card
        host_bandwidth=64e9, host_duplex_bandwidth=100e9),  # both ways: the H100's share
    GPU(name='H200', device_kind='NVIDIA H200', compute_capability=(9, 0), sms=132,
        clock_ghz=1.98, fp32_units_per_sm=128, shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024, registers_per_sm=65536,
        l2_bytes=60 * MiB, memory_bytes=143771 * MiB, memory_bandwidth=4.8e12,
        peak_bf16_flops=989e12, peak_fp8_flops=1979e12,
        link_bandwidth=450e9,  # H200 SXM; NVLink 4
        node_bandwidth=50e9,  # HGX H200: a 400 Gb/s NDR NIC per GPU
        # PCIe Gen5 x16, as the H100's measured (not yet on an H200)
        host_bandwidth=55e9, host_duplex_bandwidth=86e9),
)}

# A device not in the table (the CPU): the time model ranks layouts for it against these round
# figures, and says so; it never prints them as a GPU's time.
NOMINAL = GPU(name='nominal device', device_kind='', compute_capability=(0, 0), sms=100,
              clock_ghz=1.0, fp32_units_per_sm=128, shared_memory_per_sm=0,
              shared_memory_per_block_optin=0, registers_per_sm=0, l2_bytes=0, memory_bytes=0,
              memory_bandwidth=1e12, peak_bf16_flops=100e12, peak_fp8_flops=200e12,
              link_bandwidth=100e9, node_bandwidth=100e9, host_bandwidth=30e9,
              host_duplex_bandwidth=47e9)


def tile_waves(m: int, n: int, batch: int, sms: int) -> float:
  """The share of its SMs' time a GEMM's output tiles keep busy: tiles of GEMM_TILE are dealt to
  the SMs in waves, and the last wave may leave most of them idle (wave quantization)."""
  tiles = batch * -(-m // GEMM_TILE[0]) * -(-n // GEMM_TILE[1])
  return tiles / (-(-tiles // sms) * sms)


# What kernels reach of the peaks above: the time model's efficiencies (planning/timing.py), each
# fitted to what GPUs measured: benchmarks/results/calibrate_<part>-<gpu>.json, whose rows are named
# beside each constant. `python -m benchmarks.calibrate --check` re-predicts every banked program
# with these and tests/test_timing.py holds the fit (docs/time-model.md: how to refit).
#
# GEMMs: cuBLAS on random data, bf16 and fp8, the geometric mean over the banked GEMMs of at least
# 4096³ on both GPUs (calibrate_gemm-h100 and -h200: 4096³, 8192³, 32768×4096×14336; bf16
# 694–777 TFLOP/s, fp8 772–1263): each within 0.93–1.08 of its prediction. Output tiles of
# 128×256 (cuBLAS's Hopper tile) are dealt to the SMs in waves; the efficiency is of full waves.
GEMM_TILE = (128, 256)
GEMM_EFFICIENCY = 0.753
FP8_GEMM_EFFICIENCY = 0.734
# Our grouped matmul (kernels/grouped_matmul.py), a Triton kernel not yet measured: until
# `benchmarks/moe.py --measure` gives its TFLOP/s on a GPU, the share of the bf16 peak JAX's
# bundled Pallas Triton attention forward publishes for the H100 (≈360 of 989 TFLOP/s).
GROUPED_GEMM_EFFICIENCY = 360 / 989
# HBM: XLA's element-wise pass over 2 GiB moved 4.18 of the H200's 4.8 TB/s, read and written
# (calibrate_copy-h200, `pass over 2048 MiB`); PyTorch's copy moved 3.0 of the H100's 3.35.
HBM_EFFICIENCY = 0.873
# XLA moves the slices a scanned layer reads and writes of its stacked arrays (the saved
# activations forward, the weight gradients backward) with memcpy kernels, alongside: they reach
# less of HBM than fused kernels. Their bytes over their measured time in the banked scanned
# train steps (calibrate_steps_125m-h200 and _1b-h200: 2.7–3.8 TB/s).
ASYNC_COPY_EFFICIENCY = 0.61
# Fused attention, causal, bf16: (forward, backward) TFLOP/s by kernel, head dim and keys per
# query, as FlashAttention counts FLOPs (forward 4·B·N·L·S·H, halved when causal; backward 2.5 ×
# forward). The mean of the H100 and H200 banks (calibrate_attention-h100 and -h200: GQA 32/8,
# 16k tokens a call; the two GPUs agree within 8%); geometric between lengths, flat beyond 8k.
ATTENTION_TFLOPS = {
    'cudnn': {64: {2048: (357.6, 273.4), 4096: (409.2, 341.7), 8192: (427.3, 378.3)},
              128: {2048: (485.7, 334.3), 4096: (556.5, 407.2), 8192: (590.4, 468.5)}},
    'pallas': {64: {2048: (173.9, 202.3), 4096: (189.9, 219.6), 8192: (196.1, 233.9)},
               128: {2048: (219.7, 222.5), 4096: (239.8, 243.2), 8192: (253.8, 256.7)}}}
# Ours in Mosaic GPU (kernels/flash_attention_hopper.py), not yet measured: until
# `benchmarks/calibrate.py --parts=attention` times it on an H100, a prior no faster than ours in
# Triton (its figures above), so nothing is predicted faster for it than has been measured.
ATTENTION_TFLOPS['hopper'] = ATTENTION_TFLOPS['pallas']
ATTENTION_MEASURED_ON = 989e12  # both GPUs' bf16 peak: the figures above are shares of it
# Below the shortest measured keys, shares of its figure as in the FlashAttention-3 paper's
# non-causal head-dim-128 sweep (Shah et al. 2024: cuDNN 497, 574, 617 TFLOP/s at 512, 1k, 2k
# keys), proportional below 512.
ATTENTION_LENGTH_FACTOR = {512: 0.83, 1024: 0.95, 2048: 1.0}
# cuDNN with a bias (our document mask over packed rows): the forward and backward kernels took
# 1.70–1.75 and 1.52–1.63 × their time without it (calibrate_steps_1b-h200 and _125m-h200,
# `cudnn default packed` against `cudnn default`, from their kernel profiles).
CUDNN_BIAS_SLOWDOWN = (1.72, 1.57)
# Our kernels with segment ids (packed rows), by kernel: their time against the same step without
# them, one document a row (calibrate_steps_1b-h100 and _125m-h100, `pallas default packed` and
# `packed+model.cudnn_segments=0` against `pallas default`, from their kernel profiles: forward
# 1.24–1.28, dq 1.10–1.14, dk/dv 1.06–1.10; the geometric means).
PALLAS_SEGMENT_SLOWDOWN = {'fwd': 1.26, 'dq': 1.12, 'dkv': 1.07}
# Collectives: NCCL's ring all-gather and reduce-scatter on NVLink reach about 0.8 of the link
# (nccl-tests bus bandwidth on 8 × H100 SXM; all-reduce goes higher through NVLink SHARP); across
# nodes about 0.9 of the NIC. Each also pays a latency. One GPU cannot measure these: they are
# priors until a multi-GPU run times them.
LINK_EFFICIENCY, NETWORK_EFFICIENCY = 0.8, 0.9
LINK_LATENCY_S, NETWORK_LATENCY_S = 10e-6, 25e-6
# Every kernel pays a launch gap on its stream; XLA launches most of a step as CUDA graphs. In the
# banked train steps, a step's time beyond its kernels' sum came to 3.2 µs a launch (calibrate_
# steps_*-h200, each step waited for); back to back, a chain of tiny kernels took 1.3 µs each.
KERNEL_LAUNCH_S = 3.2e-6

# JAX's GPU allocator takes this fraction of the device's memory unless told otherwise; a run
# must fit in that, not in the whole HBM.
DEFAULT_MEMORY_FRACTION = 0.75


def get(name: str) -> GPU:
  """The GPU called `name` (config.plan.target), or a ValueError naming the setting."""
  if name not in GPUS:
    raise ValueError(f'config.plan.target={name!r} is not a GPU meshlm knows; use one of '
                     f'{sorted(GPUS)}, or config.plan.memory_gb for another device')
  return GPUS[name]


def find(name_or_kind: str) -> GPU | None:
  """The GPU with this name ('H100') or jax device_kind ('NVIDIA H100 80GB HBM3'); None for any
  other device (a CPU, a GPU not in the table)."""
  return GPUS.get(name_or_kind) or next(
      (gpu for gpu in GPUS.values() if gpu.device_kind == name_or_kind), None)


def memory_fraction() -> float:
  """What JAX's allocator will take of a GPU's memory: XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75."""
  return float(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', DEFAULT_MEMORY_FRACTION))


def usable_memory_bytes(gpu: GPU) -> int:
  """The memory a run on `gpu` gets from JAX's allocator (as `bytes_limit` would report it)."""
  return int(gpu.memory_bytes * memory_fraction())


# XLA's scheduler plans within this share of the memory beside a step's inputs and outputs, unless
# told otherwise (xla_gpu_memory_limit_slop_factor; config.model.scheduler_memory).
XLA_SCHEDULER_MEMORY = 0.95


def described_memory_bytes(gpu: GPU) -> int:
  """The device memory a compile-only GPU is described with: what makes XLA's scheduler plan for
  the memory it gets on a real GPU. There jaxlib hands XLA its allocator's limit
  (`usable_memory_bytes`, PyClient's compile sets `device_memory_size` from it), and XLA's
  scheduler and rematerialization plan within it less the program's inputs and outputs; a
  compile-only client has no allocator, so XLA takes 80% of the described memory instead
  (gpu_hlo_schedule.cc: GetSchedulerMemoryLimit). Described as usable ÷ 0.8, both plan within
  the same bytes."""
  return -(-usable_memory_bytes(gpu) * 100 // 80)  # rounded up: XLA's 80% of it rounds down


def target_config(gpu: GPU) -> str:
  """`gpu` as XLA's GpuTargetConfigProto text, for jax.experimental.topologies."""
  major, minor = gpu.compute_capability
  return f'''gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin}
  shared_memory_per_core: {gpu.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {gpu.sms}
  fpus_per_core: {gpu.fp32_units_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.memory_bandwidth)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {described_memory_bytes(gpu)}
  registers_per_core_limit: {gpu.registers_per_sm}
  registers_per_block_limit: {gpu.registers_per_sm}
  runtime_version: "{CUDA_VERSION}"
  compile_time_toolkit_version: "{CUDA_VERSION}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
device_description_str: "{gpu.device_kind}"
'''
