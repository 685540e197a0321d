"""The GPUs meshlm knows: one table of what each device is, for planning, MFU and compiling for a
GPU that is not there (planning/gpu_compiler.py).

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
  link_bandwidth: float  # bytes/s per direction to each other GPU of a node (NVLink or PCIe)
  node_bandwidth: float  # bytes/s per direction from each GPU to other nodes (its NIC's share)
  gpus_per_node: int = 8


GPUS = {gpu.name: gpu for gpu in (
    GPU(name='A100', device_kind='NVIDIA A100-SXM4-80GB', compute_capability=(8, 0), sms=108,
        clock_ghz=1.41, fp32_units_per_sm=64, shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024, registers_per_sm=65536,
        l2_bytes=40 * MiB, memory_bytes=81920 * MiB, memory_bandwidth=2.039e12,
        peak_bf16_flops=312e12, link_bandwidth=300e9,  # NVLink 3: 600 GB/s both ways
        node_bandwidth=25e9),  # DGX A100: a 200 Gb/s HDR InfiniBand NIC per GPU
    GPU(name='H100', device_kind='NVIDIA H100 80GB HBM3', compute_capability=(9, 0), sms=132,
        clock_ghz=1.98, fp32_units_per_sm=128, shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024, registers_per_sm=65536,
        l2_bytes=50 * MiB, memory_bytes=81559 * MiB, memory_bandwidth=3.35e12,
        peak_bf16_flops=989e12, link_bandwidth=450e9,  # H100 SXM; NVLink 4: 900 GB/s
        node_bandwidth=50e9),  # DGX H100: a 400 Gb/s NDR InfiniBand NIC per GPU
    GPU(name='H100-PCIe', device_kind='NVIDIA H100 PCIe', compute_capability=(9, 0), sms=114,
        clock_ghz=1.755, fp32_units_per_sm=128, shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024, registers_per_sm=65536,
        l2_bytes=50 * MiB, memory_bytes=81559 * MiB, memory_bandwidth=2.0e12,
        peak_bf16_flops=756e12, link_bandwidth=64e9,  # PCIe Gen5 x16 between cards
        node_bandwidth=25e9),  # a 200 Gb/s NIC per card
    GPU(name='H200', device_kind='NVIDIA H200', compute_capability=(9, 0), sms=132,
        clock_ghz=1.98, fp32_units_per_sm=128, shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024, registers_per_sm=65536,
        l2_bytes=60 * MiB, memory_bytes=143771 * MiB, memory_bandwidth=4.8e12,
        peak_bf16_flops=989e12, link_bandwidth=450e9,  # H200 SXM; NVLink 4
        node_bandwidth=50e9),  # HGX H200: a 400 Gb/s NDR NIC per GPU
)}

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
  device_memory_size: {gpu.memory_bytes}
  registers_per_core_limit: {gpu.registers_per_sm}
  registers_per_block_limit: {gpu.registers_per_sm}
  runtime_version: "{CUDA_VERSION}"
  compile_time_toolkit_version: "{CUDA_VERSION}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
device_description_str: "{gpu.device_kind}"
'''
