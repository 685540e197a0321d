"""Llama-shaped presets with real sizes: 125m (GPT-2-small sized, 124M), 1b (1.24B, the config of
Hugging Face's meta-llama/Llama-3.2-1B: tied head, llama3 RoPE), 8b (8.03B,
meta-llama/Meta-Llama-3-8B's) and 70b (70.6B, meta-llama/Llama-3.1-70B's); 8b-128k, the 8b on
one row of 131,072 tokens split over sequence=8 with our kernel's ring attention
(docs/parallelism.md); and 70b-1node, the 70b fully trained on one node of 8 H100s, its fp32
master weights and Adam's moments on the node's NVMe (docs/memory.md: tiers).

Run (pick the preset after the colon; attention is auto: cuDNN's on an H100, ours under a split
sequence, as the time model ranks them):
  python train.py --config=configs/llama.py:125m --config.workdir=/tmp/meshlm-125m
  python train.py --config=configs/llama.py:1b --config.workdir=/tmp/meshlm-1b
  python train.py --config=configs/llama.py:8b --config.workdir=/tmp/meshlm-8b
Time a step instead of training:
  python -m benchmarks.train_step --config=configs/llama.py:1b
Plan on any machine, compiled for the H100s each preset is meant for (GPUS below):
  python train.py --config=configs/llama.py:8b --config.dry_run=True --config.plan.target=H100 \
      --config.plan.devices=8
  python train.py --config=configs/llama.py:8b-128k --config.dry_run=True \
      --config.plan.target=H100 --config.plan.devices=8
  python -m benchmarks.partition --config=configs/llama.py:70b --devices=32,64  # 4, 8 nodes
  python train.py --config=configs/llama.py:70b-1node --config.dry_run=True \
      --config.plan.target=H100 --config.plan.devices=8
Train the 70b-1node with its state on your node's NVMe (788.5 GiB of files there, each process
its own; the three tiers may name the same directory):
  python train.py --config=configs/llama.py:70b-1node --config.optimizer.master_tier=nvme:/nvme/x \
      --config.optimizer.mu_tier=nvme:/nvme/x --config.optimizer.nu_tier=nvme:/nvme/x
The 1b's and the 8b's layers are unrolled (UNROLLED below); scanned
(--config.model.scan_layers=True) the 8b was predicted at 3.24 s a step for 45.7 GiB a GPU
(remat dots, jaxlib 0.11.2).
Start from the weights they mirror (docs/huggingface.md), which brings
the checkpoint's tokenizer and settings (Llama 3.1's rope scaling, for one):
  python train.py --config=configs/llama.py:1b --config.init_from=hf:/path/to/Llama-3.2-1B
Should reach: the loss falls as the default run's does (without init_from they train
byte-level on the default corpus; --config.data.tokenizer=hf with a Llama 3 tokenizer.json gives
them their real vocabulary). Compiled for H100 (cudnn attention, gradients reduced in bf16 across
GPUs), a step needs 8.7 GiB (125m, dots), 44.8 GiB (1b, dots_attention_except_out: cuDNN's
output and softmax statistics kept, so its forward runs once, and the output projection redone
from them) and 46.2 GiB a GPU (8b, dots_attention over 4 microbatches, FSDP over 8), within the
59.7 GiB JAX's allocator takes of each. The time model predicts (the dry run prints it) 84.6 ms,
525 ms and 2.89 s a step: MFU 31%, 52% and 59% (jaxlib 0.12.0.1, the model fitted to an H200's
and an H100's measurements; docs/time-model.md, docs/memory.md).
Measured on one H200: the 125m's step 71.4 ms, the 1b's 561 ms scanned and 528 ms unrolled
(benchmarks/results/calibrate_steps_*-h200.json); on one H100 the 1b preset's 530.0 ms, against
523.5 ms keeping the output projection (dots_attention) and 543.1 ms with dots
(calibrate_steps_1b-h100.json; jax 0.11.2).
On jaxlib 0.10.2 the 8b-128k (full) needed 25.4 GiB. The 70b, FSDP over 32 H100s (remat full),
each layer's weights gathered during the layer before, needs 51.4 GiB a GPU and is predicted at
11.9 s a step (MFU 31%), 40% of it waiting on the links between nodes: docs/parallelism.md has
it under each partition across nodes. The 70b-1node (batch 256 × 8,192 over 64 microbatches, FSDP
over 4 × sequence over 2) needs 59.55 GiB a GPU and is predicted at 366.5 s a step (MFU 32.5%),
67.7 s of it the update streaming the state through the node's NVMe at 25 GB/s. MaxText's steps,
compiled beside them by the same XLA: benchmarks/peers.py (docs/time-model.md).
On GPU, compare the benchmark's measured MFU with those and with the peers' 33–50% (MaxText,
torchtitan).
"""

from configs import base

PRESETS = {
    # name: config.model's fields; 1b and 8b as the Hugging Face config.json of their namesakes
    '125m': dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, d_ff=2048,
                 vocab_size=50304, tie_embeddings=True, rope_theta=10_000.0),
    '1b': dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192,
               vocab_size=128256, tie_embeddings=True, rope_theta=500_000.0,
               rope_type='llama3', rope_factor=32.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_length=8192),
    '8b': dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
               vocab_size=128256, tie_embeddings=False, rope_theta=500_000.0),
    '70b': dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, d_ff=28672,
                vocab_size=128256, tie_embeddings=False, rope_theta=500_000.0,
                rope_type='llama3', rope_factor=8.0, rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0, rope_original_length=8192),
}
RUNS = {  # name: global batch (sequences), seq_len, remat policy, microbatches: the fastest the
          # time model predicts of those that fit the preset's H100s with a fifth of the memory
          # to spare, for what a GPU's own compile and its allocator add to the deviceless plan
          # (benchmarks/peers.py --search; docs/memory.md). The 1b keeps the policy GPUs measured:
          # it leaves the output projection's output to recompute (_except_out)
    '125m': (32, 1024, 'dots', 1),
    '1b': (8, 4096, 'dots_attention_except_out', 1),
    '8b': (32, 8192, 'dots_attention', 4),
    '70b': (32, 8192, 'full', 1),
}
# Layers unrolled (config.model.scan_layers=False) where a GPU measured it faster and it fits: on
# an H200 the 1b took 528 ms a step against 561 ms scanned, for 1.7 GiB more
# (benchmarks/results/calibrate_steps_1b-h200.json). The 8b's too, as predicted (no GPU has run
# it yet), with its head 1024 tokens at a time. The 70b's is slower; the 125m's is not measured.
UNROLLED = {'1b', '8b'}
# Tokens the head takes at once, where not configs/base.py's: the 1b's 2048 plans 1.5 GiB less
# than 4096 for 0.4 ms (jaxlib 0.12, one H100)
HEAD_CHUNK = {'1b': 2048, '8b': 1024}
# Each layer's weight gathers started in the layer before (config.model.prefetch_weights), where
# they cross nodes and the plan is faster for it: the 70b on 32 H100s, predicted 12.25 against
# 13.10 s, for 2.9 GiB more. The 8b over 16 is slower for it (docs/parallelism.md).
PREFETCHED = {'70b'}
GPUS = {'125m': 1, '1b': 1, '8b': 8, '70b': 32}  # H100s each run is meant for (tests compile it so)
LONG_CONTEXT = {  # name: shapes preset, seq_len, mesh; our kernel's ring over `sequence`
    '8b-128k': ('8b', 131072, dict(data=1, fsdp=1, tensor=1, sequence=8)),
}
# Past the GPUs' memory: the fp32 master weights and Adam's moments on each node's NVMe
# (ZeRO-Infinity; docs/memory.md: tiers), name: shapes preset, GPUs, global batch, microbatches,
# mesh. The 70b fully trained on one node of 8 H100s: 847 GB of state on NVMe, each GPU the bf16
# weights it owns and their fp32 gradient sums (49.3 GiB); the sequence split over 2 halves each
# GPU's saved layer inputs (FSDP over 8 with 32 microbatches plans 68.8 GiB, over the 59.7 JAX
# takes by default; it fits XLA_PYTHON_CLIENT_MEM_FRACTION=0.92, the SLURM script's)
TIERED = {'70b-1node': ('70b', 8, 256, 64, dict(data=1, fsdp=4, tensor=1, sequence=2))}
NVME_DIR = '/local_nvme/meshlm'  # each process its files under it; name your node's NVMe


def get_config(preset: str = '1b'):
  if preset in LONG_CONTEXT:
    shapes, seq_len, mesh = LONG_CONTEXT[preset]
    c = get_config(shapes)
    c.workdir = f'/tmp/meshlm-{preset}'
    c.batch_size, c.seq_len = mesh['data'] * mesh['fsdp'], seq_len  # one row per batch shard
    c.model.remat_policy, c.microbatches = 'full', 1  # dots needs 63 GiB a GPU here
    defaults = base.get_config().model  # one row a device: the 8b's step tuning is not this one's
    for key in ('scan_layers', 'head_chunk', 'scheduler_memory'):
      c.model[key] = defaults[key]
    c.model.context_parallel = 'ring'  # so attention='auto' takes our kernel
    c.mesh.update(mesh)
    return c
  if preset in TIERED:
    shapes, _, batch, microbatches, mesh = TIERED[preset]
    c = get_config(shapes)
    c.workdir = f'/tmp/meshlm-{preset}'
    c.batch_size, c.microbatches, c.model.remat_policy = batch, microbatches, 'full'
    c.model.prefetch_weights = False  # more memory, and no faster here (one node's NVLink)
    c.model.scheduler_memory = 5.0  # XLA's scheduler counts the gradient sums twice: without
    # room above 1 it overlaps none of the gathers (training/programs.py; 426.7 against 366.5 s)
    c.mesh.update(mesh)
    for tier in ('master_tier', 'mu_tier', 'nu_tier'):
      c.optimizer[tier] = f'nvme:{NVME_DIR}'
    return c
  if preset not in PRESETS:
    raise ValueError(f'configs/llama.py: unknown preset {preset!r}; use one of '
                     f'{sorted(PRESETS) + sorted(LONG_CONTEXT) + sorted(TIERED)}, '
                     'e.g. --config=configs/llama.py:1b')
  c = base.get_config()
  c.workdir = f'/tmp/meshlm-{preset}'
  c.train_steps = 10_000
  c.log_every = 10
  c.eval_every = 1000
  c.batch_size, c.seq_len, c.model.remat_policy, c.microbatches = RUNS[preset]
  c.model.update(PRESETS[preset])
  c.model.scan_layers = preset not in UNROLLED
  c.model.head_chunk = HEAD_CHUNK.get(preset, c.model.head_chunk)
  c.model.prefetch_weights = preset in PREFETCHED
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 500
  return c
