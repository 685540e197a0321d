"""Fine-tuning an imported Hugging Face model on chat records, trained on the answers only
(docs/fine-tuning.md walks through it: records, the chat template, export).

Run, on the tiny Llama of tests/data given a chat template, and the standard library's
docstrings as answers:
  python -m data.stdlib_chat --output=/tmp/stdlib-chat.jsonl
  cp -r tests/data/hf-llama-untied /tmp/tiny-llama && cp tests/data/hf-chat/llama3/* /tmp/tiny-llama/
  python train.py --config=configs/finetune.py --config.init_from=hf:/tmp/tiny-llama \
      --config.data.paths=/tmp/stdlib-chat.jsonl --config.workdir=/tmp/meshlm-finetune
  python export.py --workdir=/tmp/meshlm-finetune --output=/tmp/tiny-llama-tuned
Should reach: the loss on the answers falls from about ln(320) ≈ 5.8 (the tiny model's weights
are random) to about 2.6 nats per token in its 150 steps, eval about 2.8, in under a minute on a
2-core CPU, the tokenizer's files kept in the workdir. A real model: point init_from at its
directory (its own tokenizer and template come with it) and paths at your .jsonl or .parquet.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = '/tmp/meshlm-finetune'
  c.train_steps = 150
  c.log_every = 10
  c.eval_every = 75
  c.eval_batches = 0  # all of the held-out records
  c.checkpoint_every = 75
  c.batch_size = 16
  c.seq_len = 256
  c.data.paths = '/tmp/stdlib-chat.jsonl'  # python -m data.stdlib_chat --output=...
  c.data.record = 'messages'
  c.data.validation_fraction = 0.05
  c.model.compute_dtype = 'float32'  # the tiny model; a real one trains in bfloat16
  c.optimizer.learning_rate = 3e-3  # random tiny weights; a real model wants about 2e-5
  c.optimizer.warmup_steps = 10
  c.optimizer.weight_decay = 0.0
  return c
