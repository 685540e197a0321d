"""The GPU compiler without a GPU (planning/gpu_compiler.py): our kernels and every preset's train
step compiled for H100s that are not here, by XLA's own GPU pipeline. These need the GPU compiler
(`python -m planning.gpu_compiler install`, part of the README's test command); they fail, never
skip, without it."""

import json
import pathlib
import subprocess
import sys

import pytest

from configs import llama
from kernels.flash_attention import default_blocks
from planning import gpu_compiler, gpus
from planning import plan as plan_lib
from training import loop
from training.state import build

REPO = pathlib.Path(__file__).resolve().parents[1]
H100 = gpus.GPUS['H100']


@pytest.fixture(scope='module')
def h100():
  assert gpu_compiler.in_this_process(), (
      f'the GPU compiler is not installed; run `{gpu_compiler.INSTALL}` (the README test command '
      'does)')
  device, = gpu_compiler.devices(H100, 1)
  assert device.device_kind == H100.device_kind and gpu_compiler.is_deviceless(device)
  return device


@pytest.mark.parametrize('head_dim', [64, 128, 256])
@pytest.mark.parametrize('segments', [False, True])
def test_flash_attention_compiles_for_h100_with_no_spills(h100, head_dim, segments):
  """The three Triton kernels (fwd, dq, dkv) at the default tiles: assembled for sm_90a, within
  the H100's shared memory, and no register spills (ptxas -v on XLA's PTX)."""
  result = gpu_compiler.flash_attention_kernels(h100, head_dim, segments,
                                                default_blocks(head_dim))
  assert 'error' not in result, result.get('error')
  assert sorted(result['kernels']) == sorted(gpu_compiler.FLASH_KERNELS)
  for name, k in result['kernels'].items():
    assert k['spill_stores'] == k['spill_loads'] == 0, (name, k)
    assert 0 < k['registers'] <= 255 and k['threads'] == 32 * default_blocks(head_dim)[2]
    assert 0 < k['shared_memory'] <= H100.shared_memory_per_block_optin, (name, k)


def test_a_tile_too_big_for_shared_memory_is_refused_by_the_compiler(h100):
  result = gpu_compiler.flash_attention_kernels(h100, 128, False, (128, 128, 8, 3))
  assert 'Shared memory size limit exceeded' in result['error']
  assert str(H100.shared_memory_per_block_optin) in result['error']


def preset(name: str, attention: str):
  config = llama.get_config(name)
  config.model.attention = attention
  config.plan.target, config.plan.devices = 'H100', llama.GPUS[name]
  return config


@pytest.mark.parametrize('name', sorted(llama.PRESETS))
@pytest.mark.parametrize('attention', ['pallas', 'cudnn'])
def test_every_preset_compiles_for_its_h100s_and_fits(h100, name, attention):
  config = preset(name, attention)
  devices = plan_lib.target_devices(config)
  compiled, plan = plan_lib.compile_and_plan(build(config, devices), config)
  assert plan.deviceless and plan.compiled_for == H100.device_kind
  assert plan.n_devices == llama.GPUS[name] and plan.compiled_flops is None
  assert plan.memory_bytes == gpus.usable_memory_bytes(H100)
  assert plan.fits, (plan.total_bytes / 2**30, plan.memory_bytes / 2**30)
  hlo = compiled.as_text()
  if attention == 'pallas':  # our kernel, lowered by Triton, not interpreted
    assert 'xla.gpu.triton' in hlo and 'flash_attention_fwd' in hlo
  else:
    assert '__cudnn$fmha' in hlo
  if plan.n_devices > 1:  # FSDP: the GPU compiler reduce-scatters gradients (the CPU one cannot)
    assert plan.collectives['reduce-scatter']['count'] > 0


def test_cudnn_attention_with_a_sequence_split_is_refused_before_compiling(h100):
  """cuDNN's partitioner rejects q split along the length while k, v are gathered; the GPU
  compile found it, and the config check names it first."""
  config = preset('125m', 'cudnn')
  config.mesh.update(fsdp=4, sequence=2)
  config.plan.devices = 8
  with pytest.raises(ValueError, match="attention='cudnn' cannot run with config.mesh.sequence=2"):
    build(config, plan_lib.target_devices(config))


def test_xla_attention_on_one_h100_does_not_fit_the_1b_step(h100):
  """The [L, S] scores of 8 × 4096 tokens: the plan says no, as a real H100 would."""
  config = preset('1b', 'xla')
  plan = plan_lib.compile_and_plan(build(config, plan_lib.target_devices(config)), config)[1]
  assert plan.fits is False and plan.total_bytes > 70 * 2**30


def test_dry_run_plans_for_h100s_from_train_py(h100):
  """The README's command, in a process of its own: a plan compiled for 8 H100s that are not
  here, said so in its JSON line, and no CUDA plugin noise on stderr."""
  result = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/llama.py:8b', '--config.dry_run=True',
       '--config.plan.target=H100', '--config.model.attention=cudnn'], cwd=REPO,
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(result.stdout.strip().splitlines()[-1])
  assert figures['compiled_for'] == H100.device_kind and figures['deviceless'] is True
  assert figures['n_devices'] == 8 and figures['fits'] is True  # conftest's 8 CPU devices
  assert 'deviceless: the GPU compiler' in result.stdout
  assert 'Traceback' not in result.stderr and 'plugin' not in result.stderr.lower()


def test_without_the_gpu_compiler_the_plan_is_a_labelled_cpu_stand_in(monkeypatch, capsys,
                                                                         tmp_path):
  from tests.conftest import tiny_config
  monkeypatch.setattr(gpu_compiler, 'installed', lambda: False)
  monkeypatch.setattr(gpu_compiler, 'in_this_process', lambda: False)
  config = tiny_config(fsdp=8)
  config.dry_run, config.plan.target, config.workdir = True, 'H100', str(tmp_path)
  figures = loop.run(config)[0]
  assert figures['compiled_for'] == 'cpu' and figures['deviceless'] is False
  assert 'a stand-in for H100' in capsys.readouterr().out
  config.plan.devices = 4  # another count than the devices here needs the GPU compiler
  with pytest.raises(ValueError, match='config.plan.devices=4 needs the GPU compiler'):
    loop.run(config)


def test_plan_target_is_for_planning_only_and_must_be_known():
  from tests.conftest import tiny_config
  config = tiny_config()
  config.plan.target = 'H100'  # a real run on CPU devices
  with pytest.raises(ValueError, match=r"config.plan.target='H100' plans for NVIDIA H100.*"
                                       r'config.dry_run=True'):
    loop.run(config)
  config.plan.target, config.dry_run = 'H800', True
  with pytest.raises(ValueError, match=r"config.plan.target='H800' is not a GPU meshlm knows"):
    loop.run(config)
