"""Tests run on 8 CPU devices: XLA_FLAGS must be set before jax is first imported. Prepared
datasets go to a temporary TFDS data dir (TFDS_DATA_DIR, also seen by subprocesses), removed at
the end, so tests never write under the user's home. The processes tests start share a temporary
persistent compilation cache: each compiles the same tiny steps again (a killed run and its
restart, two processes of one job); the test processes (pytest-xdist's workers) share one of
their own."""

import os
import re
import shutil
import socket
import sys
import sysconfig
import tempfile

# Tests compile far more than they compute: without LLVM's optimisations a tiny step compiles in
# about half the time (4.6 s against 8.5 s for configs/base.py) and runs about 3× slower, which
# pays for itself up to some 20 steps. So in this process, whose programs are compiled once and
# run a few steps; not in the processes tests start, which run train.py for tens of steps and
# share a compilation cache, so that each program is compiled once and run again and again
# (tests/test_checkpoint.py: 237 → 204 CPU-seconds). FAST_COMPILE is taken out below. The
# programs this process compiles for GPUs that are not here are read, never run: ptxas assembles
# them without its optimisations too (some 10% of such a compile; their HLO, memory and PTX are
# the same, and a kernel's registers and spills are read by ptxas -v of its own:
# planning/gpu_compiler.py: kernels).
FAST_COMPILE = ' --xla_backend_optimization_level=0 --xla_gpu_disable_gpuasm_optimizations=true'
for inherited in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                  'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'):  # set below for the subprocesses
  os.environ.pop(inherited, None)  # of a pytest that started this one (a pytest-xdist worker)
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8' + FAST_COMPILE).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
DATA_DIR = tempfile.mkdtemp(prefix='meshlm-tests-tfds-')
os.environ['TFDS_DATA_DIR'] = DATA_DIR
STDLIB = sysconfig.get_paths()['stdlib']
SMALL_CORPUS = f'{STDLIB}/json/*.py,{STDLIB}/email/*.py'  # 25 real files, ~330 kB

from planning import gpu_compiler  # noqa: E402  (imports no jax)

# This process compiles for GPUs too (tests/test_gpu_compile.py): the GPU compiler must be on the
# path before jax is imported; the processes tests start do not get it.
if os.environ['JAX_PLATFORMS'] == 'cpu' and 'jax' not in sys.modules:
  gpu_compiler.put_on_path()

import jax  # noqa: E402
import pytest  # noqa: E402

from configs import base  # noqa: E402

assert jax.device_count() == 8, 'tests expect 8 CPU devices (XLA_FLAGS was set too late)'

# The caches below are made once, by the first process of the session (pytest's own, or its
# only one with -n 0), and shared with pytest-xdist's workers, which inherit its environment:
# the two workers build many of the same tiny programs, each in the files it is given. Only the
# process that made them removes them, once every worker has ended.
CACHES = 'MESHLM_TEST_CACHES'
MADE_CACHES = CACHES not in os.environ
if MADE_CACHES:
  os.environ[CACHES] = os.pathsep.join(tempfile.mkdtemp(prefix='meshlm-tests-xla-cache-')
                                       for _ in range(2))
CACHE_DIR, OWN_CACHE_DIR = os.environ[CACHES].split(os.pathsep)

# Set after jax read its configuration: the environment is for the processes tests start.
os.environ.update(XLA_FLAGS=os.environ['XLA_FLAGS'].replace(FAST_COMPILE, '').strip(),
                  JAX_COMPILATION_CACHE_DIR=CACHE_DIR,
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
# The test processes have one of their own: tests build the same tiny steps again and again
# (each loop.run jits anew), and a cached one loads in milliseconds. Never the started processes'
# cache: a program compiled here, with the GPU compiler loaded, is not one for them to run.
jax.config.update('jax_compilation_cache_dir', OWN_CACHE_DIR)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def tiny_config(**mesh):
  """A 2-layer GQA model small enough to compile in seconds, in fp32 for tight comparisons."""
  c = base.get_config()
  c.batch_size, c.seq_len = 8, 32
  c.model.d_model, c.model.n_layers, c.model.d_ff = 64, 2, 128
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 16
  c.model.compute_dtype = 'float32'
  c.optimizer.warmup_steps = 2
  c.train_steps = 10
  c.mesh.update(dict(data=1, stage=1, fsdp=1, expert=1, tensor=1, sequence=1))
  c.mesh.update(mesh)
  c.model.vocab_size = 384  # the byte tokenizer's, padded
  c.model.head_chunk = 24  # several chunks a device, the last padded (model/head.py)
  c.data.paths, c.data.validation_fraction = SMALL_CORPUS, 0.1
  return c


def f32_shapes(hlo: str) -> list[tuple[int, ...]]:
  """The shape of every fp32 array a compiled program's text names."""
  return [tuple(map(int, dims.split(','))) for dims in re.findall(r'f32\[([\d,]+)\]', hlo)]


def free_port() -> int:
  """A TCP port nobody listens on now, for a test's jax.distributed coordinator."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def with_file_size_limit(limit: int, args: list[str]) -> list[str]:
  """`args` (a python command) run where writes past `limit` bytes fail with EFBIG, as a full
  disk's fail with ENOSPC (SIGXFSZ ignored: the write returns the error instead of killing)."""
  return [sys.executable, '-c', 'import os, resource, signal, sys\n'
          'signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
          f'resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n'
          'os.execv(sys.executable, [sys.executable, *sys.argv[1:]])', *args[1:]]


# The inner loop's subset, `pytest -m fast` (≤ 2 minutes on 2 cores): tests that exercise every
# package, each cheap. Entries are node ids under tests/, or a test's name for all its parameters.
FAST = (
    'test_model.py::test_a_document_is_blind_to_what_is_packed_before_it',
    'test_model.py::test_a_tied_head_is_the_untied_head_holding_the_table',
    'test_model.py::test_bf16_compute_keeps_fp32_params_and_tied_head_has_no_unembed',
    'test_model.py::test_changing_token_t_changes_no_earlier_logit',
    'test_model.py::test_fully_masked_rows_give_zeros_not_nan',
    'test_model.py::test_layers_are_stacked_for_the_scan',
    'test_kernels.py::test_matches_reference_values_and_gradients[True-1-False]',
    'test_kernels.py::test_matches_reference_values_and_gradients[True-4-True]',
    'test_kernels.py::test_sharded_over_batch_and_heads_equals_unsharded',
    'test_flash_attention_hopper.py::test_matches_the_reference_in_values_and_log_sum_exp[True-1-True-128-128]',
    'test_head.py::test_losses_and_gradients_equal_the_plain_paths',
    'test_head.py::test_sharded_over_tokens_and_vocabulary_equals_one_device',
    'test_embedding.py::test_sharded_table_gradient_equals_one_devices',
    'test_grouped_matmul.py::test_values_and_both_gradients_equal_the_references[sizes0-float32]',
    'test_moe.py::test_an_moe_layer_equals_a_loop_over_its_experts[softmax+shared]',
    'test_moe.py::test_experts_over_an_expert_axis_drop_only_what_a_capacity_or_buffer_says'
    '[expert_buffer]',
    'test_fp8.py::test_forward_and_gradients_match_numpy',
    'test_fp8.py::test_overflow_cannot_reach_the_weights',
    'test_context_parallel.py::test_equals_unsharded_attention_values_and_gradients'
    '[all_gather-4-False-4-False]',
    'test_context_parallel.py::test_equals_unsharded_attention_values_and_gradients'
    '[ring-4-False-2-True]',
    'test_context_parallel.py::test_zigzag_gives_every_device_the_same_attention_work',
    'test_sharding.py::test_batch_is_split_over_data_and_fsdp_and_length_over_sequence',
    'test_sharding.py::test_fsdp_splits_every_large_parameter_and_its_adam_moments_8_ways',
    'test_sharding.py::test_tensor_parallel_hlo_has_row_parallel_all_reduce_and_no_full_weight_'
    'collective',
    'test_sharding.py::test_same_loss_curve_as_one_device[fsdp=8]',
    'test_pipeline.py::test_only_activations_cross_stages_in_the_compiled_step[gpipe]',
    'test_pipeline.py::test_a_checkpoint_moves_between_stage_counts[2]',
    'test_training.py::test_the_losses_sums_are_the_weighted_nll_and_log_z_squared',
    'test_training.py::test_weight_decay_skips_norm_scales_only',
    'test_training.py::test_schedule_warms_up_linearly_then_decays_to_the_floor',
    'test_training.py::test_clipping_bounds_the_update',
    'test_training.py::test_bad_config_fails_before_anything_is_built_naming_the_field',
    'test_training.py::test_unwritable_workdir_is_a_clear_error',
    'test_training.py::test_unknown_override_key_is_an_error_naming_it',
    'test_training.py::test_flops_per_token_matches_a_hand_count',
    'test_training.py::test_microbatches_must_split_each_devices_rows',
    'test_data.py::test_packing_keeps_every_pair_once_with_right_segments_and_positions',
    'test_data.py::test_training_rows_are_fully_packed_and_the_next_epoch_reshuffles',
    'test_data.py::test_resume_from_saved_state_continues_exactly[0]',
    'test_data.py::test_process_shares_are_disjoint_and_rebuild_the_global_batch',
    'test_data.py::test_global_array_shards_hold_the_rows_the_pipeline_built',
    'test_data.py::test_sentencepiece_trains_on_the_corpus_and_round_trips_exactly',
    'test_data.py::test_a_hugging_face_tokenizer_round_trips_and_counts_its_bytes',
    'test_data.py::test_bad_data_settings_fail_before_training_naming_the_setting',
    'test_tokens.py::test_prepared_batches_equal_tokenizing_on_the_fly',
    'test_tokens.py::test_an_interrupted_preparation_leaves_nothing_and_a_damaged_one_is_named',
    'test_tokens.py::test_a_killed_preparation_is_never_read_and_the_next_prepares_afresh',
    'test_data.py::test_a_truncated_prepared_split_is_one_line_naming_it_and_how_to_prepare_it_'
    'again',
    'test_generate.py::test_bad_generation_arguments_are_named',
    'test_generate.py::test_top_k_draws_only_the_k_most_likely',
    'test_generate.py::test_rows_stop_at_eos',
    'test_kv_cache.py::test_quantization_is_numpys',
    'test_speculate.py::test_greedy_speculation_gives_plain_greedy_tokens',
    'test_kv_cache.py::test_each_kinds_bytes_are_the_arrays_it_allocates',
    'test_plan.py::test_a_run_that_cannot_fit_stops_before_writing_anything_naming_the_settings',
    'test_plan.py::test_compiled_matmul_flops_are_the_formula_plus_what_remat_recomputes[none]',
    'test_plan.py::test_layout_tries_both_context_choices_where_the_kernel_meets_a_sequence_split',
    'test_plan.py::test_auto_attention_is_xla_on_cpus_and_the_time_models_fastest_that_runs_on_gpus',
    'test_structure.py::test_only_the_entry_points_take_the_config',
    'test_timing.py::test_known_kernels_take_their_known_times',
    'test_timing.py::test_a_loop_body_counts_once_per_trip',
    'test_timing.py::test_a_collective_with_no_compute_beside_it_is_exposed_and_one_overlapped_is_'
    'hidden',
    'test_timing.py::test_a_gemm_only_program_takes_its_flops_at_the_gemm_efficiency',
    'test_gpu_compile.py::test_flash_attention_compiles_for_h100_with_no_spills[False-64]',
    'test_gpu_compile.py::test_every_preset_compiles_for_its_h100s_and_fits[125m-auto]',
    'test_gpu_compile.py::test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused_before_compiling',
    'test_gpu_compile.py::test_plan_target_is_for_planning_only_and_must_be_known',
    'test_gpu_compile.py::test_a_tile_too_big_for_shared_memory_is_refused_by_the_compiler',
    'test_cli.py::test_an_empty_workdir_is_refused_and_nothing_lands_in_the_current_directory',
    'test_workdir.py::test_bad_data_paths_fail_before_the_workdir_is_created',
    'test_workdir.py::test_a_second_run_on_a_live_workdir_stops_at_once_naming_the_holder',
    'test_checkpoint.py::test_checksums_do_not_depend_on_the_sharding',
    'test_checkpoint.py::test_the_checksum_shares_of_an_arrays_pieces_add_up_to_its_checksum',
    'test_tiers.py::test_a_tier_setting_it_cannot_use_is_named_before_anything_is_built',
    'test_tiers.py::test_a_disk_that_refuses_the_tier_files_is_one_line_and_leaves_nothing',
    'test_checkpoint.py::test_restore_under_other_meshes_and_fall_back_past_a_corrupted_checkpoint',
    'test_checkpoint.py::test_a_resumed_run_that_changes_its_data_or_model_is_refused_before_'
    'compiling',
    'test_checkpoint.py::test_another_models_checkpoint_is_a_clear_error_before_training',
    'test_huggingface.py::test_an_imported_checkpoint_computes_what_transformers_computes',
    'test_huggingface.py::test_the_checkpoint_decides_the_model_and_says_what_it_cannot_import',
    'test_huggingface.py::test_a_failed_export_leaves_nothing_and_an_export_never_overwrites',
    'test_distributed.py::test_scheduler_detection_reads_what_jax_reads',
    'test_distributed.py::test_bad_distributed_settings_are_named',
    'test_preemption.py::test_a_signal_to_one_process_stops_all_at_the_same_step[SIGTERM]',
    'test_instruments.py::test_a_run_reports_tflops_to_stdout_metrics_and_tensorboard_and_traces_'
    'steps',
    'test_configs.py::test_every_config_file_loads_and_has_a_runnable_docstring',
    'test_structure.py::test_every_package_imports_only_the_floors_below_it',
    'test_structure.py::test_no_module_imports_itself_back_through_others',
    'test_structure.py::test_the_gpu_target_is_resolved_in_one_place',
    'test_structure.py::test_every_link_config_module_and_script_the_docs_name_exists',
    'test_configs.py::test_llama_presets_have_their_real_sizes_and_shard_over_8_devices',
    'test_configs.py::test_unknown_preset_names_the_choices',
    'test_configs.py::test_every_number_of_the_base_config_must_be_finite_and_in_range',
    'test_configs.py::test_every_setting_declares_what_changing_it_does_and_the_docs_show_the_'
    'table',
    'test_configs.py::test_a_change_of_every_kept_setting_is_refused_on_resume_and_no_other',
    'test_data.py::test_repeated_documents_land_on_one_side_of_the_split',
    'test_chat.py::test_a_conversation_starts_as_its_template_renders_it_and_blank_answers_are_'
    'not_records',
    'test_configs.py::test_small_configs_run_one_step_on_8_devices[base.py]',
    'test_benchmarks.py::test_the_fault_probe_runs_its_cases_and_counts_them',
    'test_benchmarks.py::test_every_benchmark_runs_as_a_script_too',
    'test_benchmarks.py::test_calibrate_stops_a_part_past_its_budget',
    'test_hierarchical.py::test_int8_blocks_match_numpy_and_stay_within_half_a_step',
    'test_hierarchical.py::test_a_replica_that_straddles_nodes_moe_lora_and_fp8_are_refused',
    'test_chat.py::test_chat_templates_render_and_tokenize_as_transformers_does',
    'test_chat.py::test_answer_weights_survive_packing_cut_anywhere',
    'test_chat.py::test_record_settings_and_files_that_hold_nothing_are_one_clear_error',
    'test_lora.py::test_a_peft_adapter_reads_in_and_writes_out_exactly_and_computes_what_peft_does',
    'test_lora.py::test_lora_settings_are_checked_before_anything_is_built',
    'test_evaluation.py::test_a_random_models_scores_are_its_own_log_softmax',
    'test_dpo.py::test_a_pair_takes_a_row_chosen_then_rejected_each_from_position_zero',
    'test_dpo.py::test_preference_settings_and_records_are_checked_before_anything_is_built',
)


LONGEST = {  # test-seconds on 2 cores, 2026-11-29 (a slow day: the suite took 35:40), the
    # checkpoint, notebook and GPU-compile files after that day's trims
    'test_gpu_compile.py': 600, 'test_checkpoint.py': 300, 'test_benchmarks.py': 254,
    'test_tiers.py': 210, 'test_distributed.py': 206, 'test_evaluation.py': 193,
    'test_flash_attention_hopper.py': 185, 'test_notebook.py': 130, 'test_dpo.py': 152,
    'test_plan.py': 141, 'test_moe.py': 129, 'test_pipeline.py': 111,
    'test_context_parallel.py': 105, 'test_model.py': 103, 'test_training.py': 93,
    'test_timing.py': 90, 'test_generate.py': 81, 'test_kv_cache.py': 76, 'test_chat.py': 72,
    'test_kernels.py': 69, 'test_cli.py': 63, 'test_speculate.py': 59, 'test_huggingface.py': 59,
    'test_sharding.py': 55, 'test_data.py': 52, 'test_configs.py': 47, 'test_hierarchical.py': 43,
    'test_lora.py': 34, 'test_tokens.py': 29, 'test_structure.py': 22, 'test_fp8.py': 22,
    'test_grouped_matmul.py': 20, 'test_head.py': 19, 'test_preemption.py': 12,
    'test_instruments.py': 6, 'test_workdir.py': 4, 'test_embedding.py': 4}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by it

def pytest_collection_modifyitems(config, items):
  """Marks the FAST tests `fast`; an entry of a wholly collected file that names no test is an
  error (a test renamed without its entry). Orders the files longest first (LONGEST; a file it
  lacks is an error too)."""
  unmatched = set(FAST)
  partly = {f'tests/{os.path.basename(arg.split("::")[0])}' for arg in config.args if '::' in arg}
  files = {item.nodeid.split('::')[0] for item in items} - partly
  for item in items:
    nodeid = item.nodeid.removeprefix('tests/')
    for entry in FAST:
      if nodeid == entry or nodeid.startswith(entry + '['):
        item.add_marker(pytest.mark.fast)
        unmatched.discard(entry)
  # The longest files first (their test seconds on 2 cores), so that the two workers, each
  # taking a file at a time, end on short ones together rather than one on a long one alone.
  items.sort(key=lambda item: -LONGEST.get(os.path.basename(item.nodeid.split('::')[0]), 0))
  if stale := [e for e in unmatched if f'tests/{e.split("::")[0]}' in files]:
    raise pytest.UsageError(f'tests/conftest.py FAST names tests that do not exist: {stale}')
  # A file LONGEST does not name runs last, where one worker may run it alone while the other
  # idles (test_flash_attention_hopper.py did so for some 100 s a run until 2026-11-29).
  if unranked := sorted(os.path.basename(f) for f in files
                        if os.path.basename(f) not in LONGEST):
    raise pytest.UsageError(f'tests/conftest.py LONGEST lacks {unranked}: add each with its '
                            'seconds (pytest --durations=0), so that it runs in its place')


def pytest_sessionfinish(session, exitstatus):
  shutil.rmtree(DATA_DIR, ignore_errors=True)
  if MADE_CACHES:
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    shutil.rmtree(OWN_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope='session')
def h100():
  """One H100 that is not here, to compile for (planning/gpu_compiler.py)."""
  from planning import gpus
  assert gpu_compiler.in_this_process(), (
      f'the GPU compiler is not installed; run `{gpu_compiler.INSTALL}` (the README test command '
      'does)')
  device, = gpu_compiler.devices(gpus.GPUS['H100'], 1)
  assert device.device_kind == gpus.GPUS['H100'].device_kind
  assert gpu_compiler.is_deviceless(device)
  return device


@pytest.fixture(scope='session')
def small_corpus():
  """A real corpus, small, prepared once: the json and email packages of the standard library."""
  from data import corpus
  return corpus.load(tiny_config().data)
