"""Every setting meshlm reads, with its default. Other configs start from this one.

Run (a tiny model for a few steps, a smoke test of the whole stack):
  python train.py --config=configs/base.py --config.workdir=/tmp/meshlm-base
Should reach: loss 2.41 and eval loss 2.78 (4.01 bits/byte; from 6.25 at step 1, ln(384) ≈ 5.95
being a uniform guess) after its 100 steps, in about 15 seconds on a 2-core CPU. Every step's loss
is in tests/data/curves/base.json (scripts/loss_curves.py), which a test holds a fresh run to.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = '/tmp/meshlm'  # metrics.jsonl and config.json go here
  c.seed = 0
  c.train_steps = 100
  c.log_every = 10
  c.eval_every = 50  # 0 turns evaluation off
  c.eval_batches = 4  # batches of the validation split per evaluation; 0: all of it
  c.checkpoint_every = 50  # steps between asynchronous checkpoints (and one at the end); 0: none
  c.keep_checkpoints = 3  # the newest this many are kept
  c.init_from = ''  # a run's workdir (or checkpoints/<step>): start from its parameters only;
  # or hf:DIR, a Hugging Face Llama checkpoint; either sets the base model (docs/huggingface.md).
  # '': fresh parameters; random: fresh ones on purpose, which a frozen base (LoRA) must say
  c.init_adapters = 'merge'  # init_from a run that trained LoRA adapters: merge (start from the
  # model they make, W + (alpha/r)·AB) | leave (from the base they adapted, without them)
  c.dry_run = False  # compile the step, print its memory/FLOPs/collectives plan, and stop
  c.max_bad_steps = 5  # this many steps in a row with a non-finite loss or gradient stop the run
  c.profile_steps = 0  # trace this many steps into workdir/profile (TensorBoard, Perfetto); 0: none
  c.profile_start = 5  # the trace starts this many steps into the run, after compilation and warm-up
  c.batch_size = 16  # global, in sequences
  c.microbatches = 1  # gradient accumulation: the batch runs as this many slices inside the step
  c.seq_len = 128

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 0  # 0: the tokenizer's size padded to a multiple of 128 (byte: 259 → 384)
  m.d_model = 64
  m.n_layers = 2
  m.n_heads = 4
  m.n_kv_heads = 2
  m.head_dim = 16
  m.d_ff = 192
  m.rope_theta = 10_000.0
  m.rope_type = 'default'  # default | llama3: Llama 3.1's frequency rescaling, with the four below
  m.rope_factor = 8.0  # llama3: low frequencies are divided by this
  m.rope_low_freq_factor = 1.0  # wavelengths above original_length / this are low frequencies
  m.rope_high_freq_factor = 4.0  # below original_length / this, high: kept; between, blended
  m.rope_original_length = 8192  # the context the frequencies were trained for
  m.max_position_embeddings = 0  # the context an export declares (hf:DIR's); 0: max(seq_len, rope's)
  m.norm_eps = 1e-5
  m.qk_norm = False  # queries and keys RMS-normalised per head before RoPE (Qwen3's, OLMoE's)
  m.tie_embeddings = False
  m.param_dtype = 'float32'
  m.compute_dtype = 'bfloat16'
  m.grad_reduce_dtype = 'auto'  # gradients are summed across devices in this; auto: the compute
                               # dtype on several GPUs, float32 on one and on CPUs (docs/precision.md)
  m.matmul_precision = 'default'  # default | fp8: the layers' projections on scaled fp8 (docs/precision.md)
  m.attention = 'auto'  # auto | xla | cudnn | pallas (ours) | hopper (ours for sm_90a); auto: xla on
                       # CPU, on GPU the fused one the time model predicts fastest (with_attention)
  m.attention_block_q = 0  # our kernels' query/key tile rows; 0: a default for the head_dim
  m.attention_block_k = 0
  m.cudnn_segments = 16  # cuDNN: a batch whose packed rows hold ≤ this many documents (padding one
                         # more) attends within each, skipping the blocks between; a fuller row
                         # takes the dense document mask that step (docs/attention.md); 0: always
  m.context_parallel = 'all_gather'  # all_gather | ring: attention over a sequence split (docs/parallelism.md)
  m.scan_layers = True  # False unrolls the layer scan (same parameters, longer compile)
  m.remat_policy = 'none'  # none | full | dots | dots_attention | dots[_attention]_except_out |
                           # save_qkv_proj | save_attention | offload_* (docs/memory.md)
  m.virtual_stages = 1  # pipeline chunks per stage, interleaved (docs/parallelism.md); shapes params
  m.prefetch_weights = False  # start each layer's weight all-gathers in the layer before (XLA's
  # collective pipeliner; one more layer's weights held): where they cross nodes (docs/parallelism.md)
  m.scheduler_memory = 0.95  # GPUs: the share of the memory beside a step's inputs and outputs
  # that XLA's scheduler may plan to fill while it overlaps communication with compute (0.95 is
  # XLA's own); less trades overlap for memory, the same numbers computed (docs/memory.md). XLA
  # counts a microbatch loop's gradient sums against it again: where they are most of the memory,
  # above 1 lets it overlap at all (configs/llama.py: 70b-1node)
  m.head_chunk = 4096  # tokens a device's head and loss take at once: logits never whole (docs/memory.md); 0: all
  # Mixture of experts (docs/moe.md): experts > 0 gives the layers routed SwiGLU experts.
  m.experts = 0  # routed experts per MoE layer; 0: a dense model
  m.experts_per_token = 2  # top-k
  m.shared_experts = 0  # experts every token also goes through (DeepSeek's)
  m.expert_d_ff = 0  # each expert's width; 0: d_ff
  m.dense_layers = 0  # the first this many layers keep a dense MLP (DeepSeek's first k)
  m.router = 'softmax'  # softmax: top-k of the softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
  m.router_renormalize = True  # the chosen experts' weights rescaled to sum to 1
  m.router_bias_rate = 0.0  # sigmoid: aux-loss-free balancing bias step (DeepSeek-V3: 0.001)
  m.capacity_factor = 0.0  # 0: dropless; else an expert takes at most this × its fair share
  # With config.mesh.expert > 1, the rows a device's experts can take in: 0, the worst case
  # (nothing dropped); f, f × what it takes when balanced (less memory and work; the excess is
  # dropped and counted in moe_dropped). docs/moe.md
  m.expert_buffer = 0.0
  m.load_balance_loss = 0.01  # weight of the load-balancing loss (1.0 when balanced)
  m.router_z_loss = 0.001  # weight of the router's mean log(Z)^2
  m.expert_matmul = 'pallas'  # pallas (ours; interpret mode off GPU) | ragged_dot | dense
  # LoRA (docs/fine-tuning.md): rank > 0 adds adapters to these projections and trains only them;
  # the base is frozen in compute_dtype, and the optimizer holds the adapters alone.
  m.lora_rank = 0  # r; 0: no adapters, every parameter trains
  m.lora_alpha = 16.0  # the adapters' output is scaled by alpha / r (PEFT's lora_alpha)
  m.lora_targets = 'q,k,v,o,gate,up,down'  # of q, k, v, o (attention), gate, up, down (MLP)
  # Draft heads (docs/sampling.md): K small heads guess the K tokens after the next, for sample.py's
  # speculative decoding; they train beside the base and never change it.
  m.draft_heads = 0  # K; 0: none
  m.draft_kind = 'clover'  # clover: each head sees the token the one before guessed | medusa
  m.draft_only = False  # only the heads train, the base frozen (start it with config.init_from)

  c.mesh = mesh = ml_collections.ConfigDict()
  mesh.data = 1  # pure data parallelism: parameters replicated
  mesh.stage = 1  # pipeline stages: each holds n_layers/stage consecutive layers (docs/parallelism.md)
  mesh.fsdp = -1  # ZeRO-3: parameters, gradients, optimizer state sharded; -1 takes the rest
  mesh.expert = 1  # E/expert of an MoE's experts a device, tokens sent to them; FSDP elsewhere
  mesh.tensor = 1  # Megatron column/row-parallel attention heads and MLP
  mesh.sequence = 1  # activations split along the length
  mesh.auto = False  # pick mesh, remat policy and microbatches that fit, fastest first (docs/memory.md)

  # Across nodes (docs/parallelism.md): `data` is the level that spans them (sharding/hierarchical.py)
  c.partition = part = ml_collections.ConfigDict()
  part.hierarchical = False  # state split over data too, gathered across it once a step (ZeRO++ hpZ)
  part.weights = 'exact'  # exact | int8: the compute copy crosses data in int8 blocks (qwZ)
  part.gradients = 'exact'  # exact | int8: gradients cross data in int8 blocks, summed in fp32 (qgZ)

  c.optimizer = o = ml_collections.ConfigDict()
  o.learning_rate = 3e-3
  o.warmup_steps = 10
  o.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio at train_steps
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1  # not applied to norm scales
  o.grad_clip = 1.0  # global-norm clipping; 0 turns it off
  o.offload_state = False  # keep Adam's moments in pinned host memory between steps (ZeRO-Offload)
  # Where the state lives between steps (docs/memory.md: tiers): 'device', 'host' or 'nvme:DIR'
  # (each process its own files under DIR). Off the device, the step computes the gradients and
  # training/tiers.py updates the state a group at a time, streaming it in and out (ZeRO-Infinity).
  o.master_tier = 'device'  # the fp32 master weights
  o.mu_tier = 'device'  # Adam's first moment
  o.nu_tier = 'device'  # Adam's second moment

  c.loss = ml_collections.ConfigDict()
  c.loss.z_loss = 1e-4  # weight of log(Z)^2, keeps the softmax normaliser near 1

  # Direct preference optimisation (docs/fine-tuning.md: DPO), the loss of config.data.record=
  # 'preference': −log σ(β·((log π − log π_ref)(chosen) − (log π − log π_ref)(rejected))); the
  # reference π_ref is the run's starting model: under LoRA the base without its adapters.
  c.dpo = ml_collections.ConfigDict()
  c.dpo.beta = 0.1  # β: how far from the reference the policy may move for a margin
  c.dpo.label_smoothing = 0.0  # ε: the share of pairs taken to be mislabelled (conservative DPO)

  c.distributed = dist = ml_collections.ConfigDict()  # multi-process jobs (runtime/distributed.py)
  dist.coordinator_address = ''  # process 0's host:port; '': SLURM/Open MPI if present, else 1 process
  dist.num_processes = 0  # with coordinator_address: how many processes the job has
  dist.process_id = -1  # with coordinator_address: this process's rank, 0 … num_processes-1
  dist.initialization_timeout_s = 300  # how long processes wait for each other at the start
  dist.heartbeat_timeout_s = 100  # a process silent this long is dead: the others stop with an error

  c.plan = ml_collections.ConfigDict()  # what the step compiles for, fits in (planning/target.py)
  c.plan.target = ''  # A100 | H100 | H100-PCIe | H200 (planning/gpus.py): plan for it; '': the devices here
  c.plan.devices = 0  # how many of config.plan.target to plan for; 0: as many as there are devices here
  c.plan.memory_gb = 0.0  # per-device memory to fit; 0: the target's, or the backend's own

  c.data = d = ml_collections.ConfigDict()
  d.paths = 'stdlib'  # files, dirs or globs, comma-separated; stdlib: the Python stdlib's .py files
  d.name = ''  # a TFDS dataset already prepared in data_dir (array_record); replaces `paths`
  d.text_key = 'text'  # the text feature of a named dataset, or field of a record
  # A .jsonl, .jsonl.gz or .parquet file in `paths` holds a document a record (docs/fine-tuning.md):
  d.record = 'text'  # text | prompt_completion | messages (chat: [{"role", "content"}, …])
  # | preference: a prompt, a chosen and a rejected answer, trained on by DPO (config.dpo)
  # | chat_preference: the same pair as conversations (prompt: messages; each answer: messages)
  d.prompt_field = 'prompt'  # prompt_completion and the preference kinds: the record's fields
  d.completion_field = 'completion'
  d.chosen_field = 'chosen'  # the preference kinds: the answer preferred, and the one not
  d.rejected_field = 'rejected'
  d.messages_field = 'messages'  # messages: the record's field
  d.chat_template = 'auto'  # auto: the tokenizer's own (tokenizer_config.json), else fallback | fallback | a .jinja file
  d.train_on = 'answers'  # answers: loss on the completion or assistant turns only | all
  d.train_split = 'train'  # splits of a named dataset (`paths` corpora have train and validation)
  d.eval_split = 'validation'
  d.validation_fraction = 0.02  # of the files in `paths` held out, chosen by a hash of the path
  d.data_dir = ''  # TFDS data dir; '' is TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
  d.tokenizer = 'byte'  # byte | sentencepiece | hf (a Hugging Face tokenizer.json)
  d.tokenizer_model = ''  # sentencepiece: a .model (data.train_tokenizer); hf: a tokenizer.json
  d.tokenize = 'auto'  # once: token ids stored at preparation | on_the_fly | auto: once, but byte
  d.workers = 0  # grain worker processes (0: in the training process); batches are the same
  d.prefetch = 2  # batches each worker prepares ahead

  # lm-eval's tasks during training (docs/evaluation.md): scored on the parameters in memory, each
  # task's metrics in metrics.jsonl and TensorBoard as <task>/<metric>. train.py adds the hook.
  c.lm_eval = ev = ml_collections.ConfigDict()
  ev.tasks = ''  # lm-eval task or group names, comma-separated (stdlib_next_line, …); '': none
  ev.every = 1000  # steps between scorings, and one at the last step (0: only that one)
  ev.limit = 0.0  # examples a task at most (a fraction below 1); 0: all of them
  ev.include_path = ''  # more directories of task YAMLs, comma-separated (evaluation/tasks/ always)
  ev.batch_size = 16  # rows a forward
  return c


# What changing each setting does to a run (configs/effects.py: the kinds, and what a resumed run
# or a run started from a checkpoint does with each). Every setting above is declared here once.
EFFECTS = {field: kind for kind, names in {
    'shape': """model.vocab_size model.d_model model.n_layers model.n_heads model.n_kv_heads
        model.head_dim model.d_ff model.qk_norm model.tie_embeddings model.virtual_stages
        model.experts model.shared_experts model.expert_d_ff model.dense_layers""",
    'function': """model.rope_theta model.rope_type model.rope_factor model.rope_low_freq_factor
        model.rope_high_freq_factor model.rope_original_length model.max_position_embeddings
        model.norm_eps model.experts_per_token model.router model.router_renormalize
        model.capacity_factor model.expert_buffer""",
    'added': """model.lora_rank model.lora_alpha model.lora_targets model.draft_heads
        model.draft_kind model.draft_only""",
    'data': """seed batch_size seq_len init_from init_adapters data.paths data.name
        data.text_key data.record data.prompt_field data.completion_field data.chosen_field data.rejected_field
        data.messages_field data.chat_template
        data.train_on data.train_split data.validation_fraction data.tokenizer
        data.tokenizer_model""",
    'schedule': """train_steps optimizer.learning_rate optimizer.warmup_steps
        optimizer.min_lr_ratio optimizer.b1 optimizer.b2 optimizer.eps optimizer.weight_decay
        optimizer.grad_clip loss.z_loss dpo.beta dpo.label_smoothing model.load_balance_loss model.router_z_loss
        model.router_bias_rate""",
    'numerics': """microbatches model.param_dtype model.compute_dtype model.grad_reduce_dtype
        model.matmul_precision model.attention model.attention_block_q model.attention_block_k
        model.cudnn_segments
        model.context_parallel model.scan_layers model.remat_policy model.head_chunk
        model.prefetch_weights model.scheduler_memory
        model.expert_matmul mesh.data mesh.stage mesh.fsdp mesh.expert mesh.tensor
        mesh.sequence mesh.auto partition.hierarchical partition.weights partition.gradients
        optimizer.offload_state optimizer.master_tier optimizer.mu_tier optimizer.nu_tier""",
    'none': """workdir log_every eval_every eval_batches checkpoint_every keep_checkpoints
        dry_run max_bad_steps profile_steps profile_start distributed.coordinator_address
        distributed.num_processes distributed.process_id distributed.initialization_timeout_s
        distributed.heartbeat_timeout_s plan.target plan.devices plan.memory_gb data.eval_split
        data.data_dir data.tokenize data.workers data.prefetch lm_eval.tasks lm_eval.every
        lm_eval.limit lm_eval.include_path lm_eval.batch_size""",
}.items() for field in names.split()}


def drops_tokens(config) -> bool:
  """Whether a config (or a saved one) routes tokens past an expert's room: an MoE with a
  capacity or an expert buffer (model/moe.py)."""
  model = config['model']
  return bool(model.get('experts', 0)) and (model.get('capacity_factor', 0) > 0
                                            or model.get('expert_buffer', 0) > 0)


# Where what a setting changes depends on the rest of the run: {field: (its kind then, when, why)}.
# An MoE that drops tokens keeps those an expert has room for among the tokens one device routes
# at once, which the mesh and the microbatches decide: there the layout is part of the function.
DEPENDS = {field: ('function', drops_tokens, "the run's MoE drops the tokens past an expert's room "
                   'among those each device routes at once')
           for field in """microbatches mesh.data mesh.stage mesh.fsdp mesh.expert mesh.tensor
               mesh.sequence mesh.auto""".split()}
