"""gpucourse — the helper package of an interactive course on parallel training with PyTorch.

Every name exported here is part of the course's stable public API: notebooks, exercises and
outside checks rely on it. The package has one folder per part of the course (see
``gpucourse/README.md``); import from the top level::

    import gpucourse as gc
    gc.launch(fn, 2)

The names are loaded on first use (PEP 562): ``import gpucourse`` itself is cheap and imports
neither torch nor any part; ``gc.launch`` imports ``runtime/``, ``gc.TinyGPT`` imports ``data/``,
and so on. So ``python -m gpucourse grade`` (whose ``grading/`` needs no torch) stays small, while
``gc.<name>``, ``from gpucourse import <name>``, ``dir(gc)`` and ``gpucourse.__all__`` are as if
every name had been imported here.
"""

import importlib as _importlib

__version__ = "0.1.0"

#: part → its public names re-exported at the top level (the course's stable API), grouped by part
_PARTS = {
    # --- runtime/: start ranks (once: launch; live between cells: start_ranks, ranks), devices, timing
    # and rank-aware printing
    "runtime": """
        LiveRanks RankError RankTimeout WorkerError Timing bf16_hardware_note cpu_cores
        cpu_supports_bf16 default_backend format_comparison free_port has_bf16_units launch measure
        print0 print_ordered rank_device rank_prefix ranks speedup start_ranks virtual_devices visible_devices""",
    # --- data/: offline datasets and the course's small models -----------------------------------
    "data": """
        CIFAR10_CLASSES MLP CausalSelfAttention FeedForward Net SmallConvNet SyntheticCIFAR10 TinyGPT
        TinyText ToyModel TransformerBlock cifar10_or_synthetic load_cifar10""",
    # --- basics/ (chapter 01): serial vs parallel, Amdahl, vectorisation, roofline ----------------
    "basics": """
        ChunkRecord SharedTotal ThroughputPoint Trace accumulate_in_threads amdahl_speedup amdahl_widget
        arithmetic_intensity chunk_sizes cpu_capability dot_loop fit_serial_fraction gustafson_speedup
        intra_op_threads karp_flatt matmul_flops measure_scaling measure_throughput op_cost parallel_map
        parallel_reduce pinned_to_cpus plot_amdahl plot_roofline plot_throughput plot_timelines
        python_work roofline split_into_chunks time_with_cpu_capability torch_work""",
    # --- data_parallel/ (chapters 02-03): DataParallel from scratch, balanced, memory per device --
    "data_parallel": """
        BalancedDataParallel DataParallel MemoryReport MemoryTracker balanced_chunk_sizes chunk_sizes_of
        current_device_index dp_step_memory gather memory_explorer parallel_apply plot_memory
        plot_timeline record_timeline replicate scatter scatter_kwargs""",
    # --- distributed/ (chapter 04): DDP, ring all-reduce, sampler, checkpoints -------------------
    "distributed": """
        DistributedSampler MiniDDP StepTrace all_reduce_timings average_gradients load_checkpoint
        naive_all_reduce plot_step_trace ring_all_reduce ring_schedule save_checkpoint sync_batch_stats""",
    # --- cluster/ (chapter 05): multi-node environment, rendezvous, emulated nodes, α-β model -----
    "cluster": """
        LINKS AlphaBeta DistEnv EmulatedLink InitMethod NodeError NodeResult StepPrediction
        checked_init_process_group dist_env_from emulated_link expand_slurm_nodelist fit_alpha_beta
        global_rank launch_nodes measure_all_reduce measure_point_to_point netns_support
        network_interfaces parse_init_method predict_step_time rank_layout ring_all_reduce_bytes
        ring_all_reduce_time scaling_table torchrun_command""",
    # --- precision/ (chapter 06): number formats, autocast, loss scaling, measured speed ---------
    "precision": """
        AmpStepResult AutocastModule BitFields CastReport ElementwiseNet FloatFormat LossScaler OpRecord
        OpTimes PrecisionRun activation_gradients amp_step autocast_op_dtypes bit_fields cast_report
        compare_precisions explain_bf16_speedup float_format format_op_table format_table
        lost_update_fraction op_time_shares plot_log2_histogram plot_ranges plot_time_split
        training_step underflow_fraction update_scale""",
    # --- pipeline/ (chapter 07): model split, GPipe, schedules, pipelines across processes ------
    "pipeline": """
        GPipe ModelParallel ParallelGrid PipelineComm PipelineOp PipelineRun PipelineSchedule
        SavedActivationMeter Timeline TimelineEvent TwoDeviceToyModel balanced_partition bubble_fraction
        clock_cycles gpipe_schedule layer_costs make_schedule merge_microbatches one_f_one_b_schedule
        pipeline_step run_pipeline split_microbatches split_sequential train_pipeline train_sequential
        train_torch_pipelining training_state_bytes""",
    # --- sharding/ (chapter 08): ZeRO-1/2/3 from scratch, p2p reduce-scatter/all-gather, memory per rank
    "sharding": """
        STRATEGIES CheckpointedSequential FullyShardedModule MLPBlock RankMemory RecomputePoint
        ShardedRun ZeroOptimizer activation_bytes all_gather measure_step_memory measure_zero_comm
        plot_zero_memory plot_zero_stages recompute_sweep reduce_scatter residual_mlp shard_ranges
        shard_size train_sharded wrap_for zero_comm_bytes zero_comm_time zero_memory zero_memory_parts
        zero_memory_widget""",
    # --- tensor_parallel/ (chapter 09): Megatron f/g, column/row split, vocab-parallel loss, 2-D mesh
    "tensor_parallel": """
        ColumnParallelLinear CommMeter CommRecord RowParallelLinear TensorParallelAttention
        TensorParallelGPT TensorParallelMLP VocabParallelEmbedding column_parallel comm_meter
        copy_to_tensor_parallel gather_from_tensor_parallel parallelism_comm reduce_from_tensor_parallel
        row_parallel scatter_to_tensor_parallel tensor_parallel_attention tensor_parallel_gpt
        tensor_parallel_mlp tensor_split_sizes tp_comm_bytes tp_comm_time tp_comm_widget train_tinygpt
        train_tinygpt_2d vocab_parallel_cross_entropy""",
    # --- observability/ (chapter 10): profiler traces, DDP options, resume, DCP, Join ------------
    "observability": """
        MESH_DIMS BucketOverlap DDPOptionResult OverlapReport PipelineStage3D ResumableSampler
        allreduce_overlap dcp_load dcp_save full_model_state fully_shard_model hidden_fraction
        latest_checkpoint load_training_state measure_ddp_option mesh_coordinates profile_ddp_steps
        read_trace_events rng_states run_3d save_training_state set_rng_states step_traces
        trace_timeline train_3d train_reference_3d train_uneven""",
    # --- long_context/ (chapter 11, part A): blockwise/ring/Ulysses attention, zig-zag, bytes ------
    "long_context": """
        CPMeter CPStep attention_block attention_block_backward blockwise_attention cp_comm_bytes
        cp_comm_time cp_meter merge_attention ring_attention ring_kv_chunks ring_tiles ring_traces
        ulysses_attention zigzag_chunks zigzag_merge zigzag_split""",
    # --- experts/ (chapter 11, part B): mixture of experts, expert parallelism, the five axes -----
    "experts": """
        ExpertParallelMoE MoE Routing ep_comm_bytes ep_comm_time expert_parallel load_balance_run
        parallelism_axes""",
    # --- planning/ (chapter 12): predict memory and step time of a split, rank the splits ------------
    "planning": """
        ClusterSpec MemoryPrediction ModelSpec ParallelConfig Plan Prediction TimePrediction
        activation_terms bubble_time compute_time expert_imbalance_flops cp_step_comm_time dp_step_comm_time ep_step_comm_time
        exposed inflight_microbatches korthikanti_layer_bytes layer_activation_bytes mfu
        model_state_bytes outside_activation_bytes plan plan_widget plot_plan pp_step_comm_time predict
        split_problem stage_layers stage_params step_flops tp_step_comm_time training_flops_per_token""",
    # --- grading/: check cells (judged outside the kernel), self-check a notebook ------------------
    "grading": """
        CheckFailed ForbiddenCall check check_exercise check_hidden check_this_notebook expect
        expect_close expect_equal set_check_seed""",
}

#: name → the part (sub-package) it comes from
_WHERE = {name: part for part, names in _PARTS.items() for name in names.split()}
for _part, _names in _PARTS.items():
    _PARTS[_part] = tuple(_names.split())
del _part, _names

__all__ = list(_WHERE)


def __getattr__(name: str):
    """Load ``name`` from its part on first use, then keep it here (later lookups are plain)."""
    part = _WHERE.get(name)
    if part is None:
        if name in _PARTS:                   # a part itself: gc.runtime, gc.grading, …
            return _importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{part}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What an eager package would list: dunders, every public name, every part."""
    here = {n for n in globals() if n.startswith("__") or not n.startswith("_")}
    return sorted(here | set(__all__) | set(_PARTS))


def _offer_ranks_magic() -> None:
    """In IPython, ``import gpucourse`` makes ``%%ranks`` known (a fresh or restarted kernel then
    says "no live ranks: run gc.start_ranks(n)" instead of "Cell magic `%%ranks` not found"). The
    magic imports the live ranks (and torch) only when a cell uses it."""
    import sys

    ipython = sys.modules.get("IPython")            # only where IPython already runs: no import here
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    if shell is None or "ranks" in shell.magics_manager.magics.get("cell", {}):
        return

    def ranks(line: str, cell: str):
        """%%ranks [RANKS] [--timeout SECONDS]: run this cell on the live ranks (gc.start_ranks first)."""
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the traceback
        from .runtime.live_ranks import _ranks_magic

        return _ranks_magic(line, cell)

    shell.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")


_offer_ranks_magic()
