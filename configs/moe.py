"""Mixture-of-experts presets (docs/moe.md).

tiny: the default run's model with each MLP made 8 SwiGLU experts of half its width, 2 a token,
so it has the dense model's active parameters and 3.5× its MLP parameters. On a CPU its experts
multiply through XLA's ragged_dot: our kernel's interpret mode, which the tests run, is too slow
for a run; on GPUs set expert_matmul=pallas.
mixtral-8x7b: Mixtral-8x7B's shapes (46.7B parameters, 12.9B active), planned for two nodes of
H100s (16).
qwen3-30b-a3b: a fine-grained MoE, Qwen3-30B-A3B's shapes (30.5B parameters, 3.3B active: 128
experts of width 768, 8 a token, q/k norms), planned for 16 H100s too.

Run:
  python train.py --config=configs/moe.py:tiny --config.workdir=/tmp/meshlm-moe-tiny
  python train.py --config=configs/moe.py:mixtral-8x7b --config.dry_run=True \
      --config.plan.target=H100 --config.plan.devices=16
  python train.py --config=configs/moe.py:qwen3-30b-a3b --config.dry_run=True \
      --config.plan.target=H100 --config.plan.devices=16
Should reach: tiny, a loss falling as the default run's does (configs/default.py), with the
load-balancing loss (moe_load_balance in metrics.jsonl) near 1 and each expert's share
(moe_tokens_per_expert/*) near 1/8; measured on a 2-core CPU at 2.8 s a step (about 9 minutes
for the 200), with the curve beside the dense model's in docs/moe.md. mixtral-8x7b and
qwen3-30b-a3b: the plans docs/moe.md gives.
"""

from configs import base, default

PRESETS = {
    # name: config.model's fields
    'tiny': dict(experts=8, experts_per_token=2, expert_d_ff=384, expert_matmul='ragged_dot'),
    # transformers' MixtralConfig for Mixtral-8x7B; its router_aux_loss_coef 0.02 weighs a loss k
    # times meshlm's (model/moe.py), so 0.04 here
    'mixtral-8x7b': dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, d_ff=14336, rope_theta=1e6, tie_embeddings=False,
                         experts=8, experts_per_token=2, expert_d_ff=14336,
                         load_balance_loss=0.04, router_z_loss=0.0),
    # transformers' Qwen3MoeConfig for Qwen3-30B-A3B (router_aux_loss_coef 0.001, k = 8)
    'qwen3-30b-a3b': dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, d_ff=6144, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                          tie_embeddings=False, experts=128, experts_per_token=8,
                          expert_d_ff=768, router_renormalize=True, load_balance_loss=0.008,
                          router_z_loss=0.0),
}
RUNS = {  # global batch, seq_len, remat, microbatches
    'mixtral-8x7b': (16, 4096, 'full', 1),
    'qwen3-30b-a3b': (16, 4096, 'full', 1),
}
GPUS = {'mixtral-8x7b': 16, 'qwen3-30b-a3b': 16}  # H100s a preset is planned for


def get_config(preset: str = 'tiny'):
  if preset not in PRESETS:
    raise ValueError(f'configs/moe.py: unknown preset {preset!r}; use one of {sorted(PRESETS)}, '
                     'e.g. --config=configs/moe.py:tiny')
  c = default.get_config() if preset == 'tiny' else base.get_config()
  c.workdir = f'/tmp/meshlm-moe-{preset}'
  if preset in RUNS:
    c.train_steps, c.eval_every = 10_000, 1000
    c.batch_size, c.seq_len, c.model.remat_policy, c.microbatches = RUNS[preset]
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 3e-4, 500
  c.model.update(PRESETS[preset])
  return c
