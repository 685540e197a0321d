"""The default run: a small byte-level Llama that visibly learns Python source on a 2-core CPU.

Run:
  python train.py --config=configs/default.py --config.workdir=/tmp/meshlm-default
Should reach: train loss ≈ 1.5 and eval loss ≈ 1.9 nats per byte token (≈ 2.8 bits per byte)
after its 200 steps (from ln(384) ≈ 5.95 at step 0; ln(256) ≈ 5.55 is a uniform guess over bytes),
in about 3 minutes on a quiet 2-core CPU (≈ 0.75 s/step, 3.3M parameters, 4,096 tokens a step). The
first run also prepares the corpus (the stdlib's .py files, about a second). Then
  python sample.py --workdir=/tmp/meshlm-default --prompt='def '
writes Python-looking text (docs/sampling.md).
"""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = '/tmp/meshlm-default'
  c.train_steps = 200
  c.log_every = 20
  c.eval_every = 100
  c.eval_batches = 16  # 65k validation tokens
  c.checkpoint_every = 100
  c.batch_size = 16
  c.seq_len = 256
  c.model.d_model = 256
  c.model.n_layers = 4
  c.model.n_heads = 8
  c.model.n_kv_heads = 4
  c.model.head_dim = 32
  c.model.d_ff = 768
  c.optimizer.learning_rate = 2e-3
  c.optimizer.warmup_steps = 20
  return c
