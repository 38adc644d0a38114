"""Which of vLLM 0.32.0's scheduler tests helix_kv's adapter is expected to pass, and why the
others are not (``run_vllm_suites.py`` checks it; ``docs/vllm.md`` lists the same tests).

Every test that builds the adapter and exercises behaviour through vLLM's scheduler interface
or its read-only views (``running``, ``waiting``, ``requests``, ``finished_req_ids``) must
pass. A test listed here is one that cannot: it needs an option helix_kv refuses, reads or
patches a private member of vLLM's own ``Scheduler``, or checks a policy helix_kv decides
differently on purpose. Tests are named by function (every parametrization), or by one
parametrization where the others pass.
"""

from __future__ import annotations

#: The test files run, relative to the root of vLLM's source distribution.
SUITES = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
)

_KV_CONNECTOR = "needs a KV connector (`kv_transfer_config`), which helix_kv refuses"
_MULTIMODAL = (
    "needs a multimodal model or encoder inputs (refused; its Hugging Face config is not "
    "in the offline cache either)"
)
_ARRIVAL = (
    "a policy helix_kv decides differently on purpose: under `policy='priority'` equal "
    "priorities go in the order vLLM adds the requests (its engine adds them as they "
    "arrive), not by the `arrival_time` field; these tests give arrival times out of the "
    "order they add the requests"
)

#: reason -> the test functions it covers.
NOT_APPLICABLE: dict[str, tuple[str, ...]] = {
    _KV_CONNECTOR: (
        "test_connector_metadata_precedes_async_placeholder_advance",
        "test_kv_pressure_preempt_mid_handoff",
        "test_gate_enabled_for_async_consumer",
        "test_abort_request_finished_recving",
        "test_abort_request_waiting_for_remote_kvs",
        "test_async_load_reservation_prevents_wedge_e2e",
        "test_delayed_kv_connector_free_keeps_scheduler_active",
        "test_external_prefix_cache_metrics",
        "test_has_sync_kv_loads",
        "test_kv_connector_basic",
        "test_kv_connector_handles_preemption",
        "test_kv_connector_honors_skip_reading_prefix_cache",
        "test_kv_connector_records_external_cache_hit_sources",
        "test_kv_connector_unable_to_allocate",
        "test_pause_new_drains_async_kv_loads",
        "test_prefix_cache_query_not_inflated_by_connector_defer",
        "test_prepend_skipped_requests_order",
        "test_priority_scheduling_preemption_and_resumption_when_out_of_kv",
        "test_spec_decode_padding_resumed_request_without_running_requests",
        "test_throttle_prefills_defers_remote_kv_resume_with_local_prefill",
        "test_throttle_prefills_excludes_fully_transferred_remote_kv",
        "test_connector_finish_frees_on_settled_basis",
        "test_requires_kv_delivery_defaults_to_producer_role",
    ),
    "needs an encoder-cache connector (`ec_transfer_config`), which helix_kv refuses": (
        "test_encoder_input_skipped_when_connector_already_has_the_item",
        "test_encoder_instance_defers_stop_until_prompt_is_consumed",
        "test_encoder_instance_finishes_request_once_prompt_is_consumed",
    ),
    _MULTIMODAL: (
        "test_eagle3_mm_encoder_cache_with_shift",
        "test_ec_connector_allocate_encoder_tokens_with_external_load",
        "test_ec_connector_cache_hit_external_load",
        "test_ec_connector_cache_miss_computes_locally",
        "test_ec_connector_defers_running_request_for_async_reload",
        "test_ec_connector_ensure_cache_available_defers_request",
        "test_ec_connector_schedule_multiple_requests",
        "test_ec_connector_text_only_request",
        "test_ec_connector_unable_to_allocate",
        "test_ec_connector_update_connector_output_called",
        "test_ec_connector_with_partial_cache_hit_multi_round",
        "test_encoder_cache_accepts_matching_embed_count",
        "test_encoder_cache_embed_count_mismatch_restores_prior_hit_state",
        "test_encoder_cache_recomputed_when_evicted_during_preemption",
        "test_encoder_cache_rejects_mismatched_embed_count",
        "test_encoder_cache_rejects_mismatched_embed_count_within_request",
        "test_encoder_cache_retained_across_preemption_and_resume",
        "test_encoder_only_prompt_longer_than_budget_is_chunked",
        "test_free_encoder_inputs_defers_for_eagle_lookahead",
        "test_free_encoder_inputs_notifies_the_ec_connector",
        "test_free_encoder_inputs_respects_unconfirmed_placeholders",
        "test_free_encoder_inputs_unchanged_without_spec_decode",
        "test_no_mm_input_chunking",
        "test_no_mm_input_chunking_for_same_step_duplicate",
        "test_priority_scheduling_ec_connector_preemption_and_resumption",
        "test_same_step_duplicate_encoder_input_stays_cached",
        "test_schedule_multimodal_requests",
        "test_schedule_partial_requests",
        "test_unavailable_encoder_input_fails_the_request_as_retryable",
        "test_make_scheduled_encoder_input_stats_output_embeddings",
        "test_scheduled_encoder_input_stats_disabled_without_iteration_logging",
        "test_scheduled_encoder_input_stats_disabled_without_log_stats",
        "test_mamba_align_eagle_schedules_encoder_at_boundary",
        "test_mamba_align_encoder_cache_cap_makes_progress",
        "test_priority_scheduling_blast",
    ),
    "needs a hybrid, sliding-window or chunked-local KV cache, which helix_kv refuses": (
        "test_chunked_local_free_waits_for_in_flight_step",
        "test_swa_free_immediate_when_sync",
        "test_swa_free_waits_for_in_flight_step",
        "test_spec_decode_padding_dropped_when_recurrent_alignment_clips",
    ),
    "needs a diffusion, pooling or pipeline-parallel engine, which helix_kv refuses": (
        "test_diffusion_scheduler_is_selected_by_default",
        "test_pooling_chunked_prefill_can_finish_at_max_model_len",
        "test_async_scheduling_pp_allows_rescheduling_with_output_placeholders",
    ),
    "needs data parallelism (its prefill throttling, `throttle_prefills`), which helix_kv "
    "refuses": (
        "test_schedule_prefills_gating[True]",
        "test_throttle_defers_inflight_prefill_chunk",
        "test_throttle_capacity_bound_guard_admits",
        "test_dynamic_sd_is_disabled_with_data_parallel",
    ),
    "needs dynamic speculative decoding (`num_speculative_tokens_per_batch_size`) or "
    "parallel drafting, which helix_kv refuses": (
        "test_scheduler_clamps_dsd_k_to_runtime_num_speculative_tokens",
        "test_scheduler_initializes_dynamic_sd_lookup_from_speculative_config",
        "test_scheduler_passes_max_num_seqs_as_dsd_runtime_batch_limit",
        "test_scheduler_rejects_bad_dsd_config_at_construction",
        "test_scheduler_uses_dsd_k_based_on_number_of_scheduled_requests",
        "test_scheduler_uses_static_k_when_no_requests_are_scheduled",
        "test_scheduler_falls_back_to_static_k_when_dsd_not_configured",
        "test_draft_slots_budgeted_per_scheduled_request",
    ),
    "needs structured output (a grammar) or streaming input, which helix_kv refuses per request": (
        "test_update_draft_token_ids_in_output_strips_padding",
        "test_update_draft_token_ids_strips_ngram_padding",
        "test_fcfs_mixed_blocked_types_remote_load_drains_first",
        "test_remote_kv_promotion_drains_before_grammar_prefix",
        "test_schedule_skip_tokenizer_init_structured_output_request",
        "test_pause_new_ignores_streaming_session_waiting_for_input",
        "test_resumable_request_handoff",
        "test_streaming_pause_does_not_over_admit_worker_slot",
    ),
    "a request arriving with its KV computed (a disaggregated decode worker): refused per "
    "request": ("test_no_spec_decode_padding_up_to_max_model_len",),
    "mocks or reads vLLM's auxiliary-output or HiSparse connectors (refused)": (
        "test_finish_request",
        "test_routed_experts_prompt_start_at_prompt_end",
        "test_pending_hisparse_spill_keeps_scheduler_alive",
        "test_pending_hisparse_reclamation_defers_preemption",
        "test_preemption_processes_stale_aux_output",
        "test_aux_output_reset_follows_kv_reset_result",
    ),
    "reads or patches a private member of vLLM's own Scheduler (its KV cache manager, "
    "encoder cache manager, queues, deferred frees or helper methods)": (
        "test_abort_defers_free",
        "test_abort_mid_prefill_defers_free",
        "test_cow_retentions_deferred_until_copy_step_processed",
        "test_fence_held_across_multiple_inflight_steps",
        "test_finish_defers_free_until_inflight_step_done",
        "test_finish_frees_immediately_when_no_inflight_step",
        "test_max_tokens_finish_frees_immediately_with_other_inflight",
        "test_multiple_deferred_frees_drain_in_order",
        "test_non_async_abort_defers_via_last_sched_seq",
        "test_preempt_defers_free_and_clears_bookkeeping",
        "test_gate_disabled_without_connector",
        "test_kv_cache_release_after_keep_pause_preserves_requests",
        "test_preemption_re_records_prefix_cache_query",
        "test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request",
        "test_prefix_cache_stats_not_recorded_when_caching_disabled",
        "test_kv_pressure_preemption_with_inflight_output",
        "test_reset_prefix_cache_with_inflight_output_under_kv_pressure",
        "test_scheduler_stats_waiting_queues",
        "test_memory_leak",
        "test_cached_request_data_resumed_all_token_ids_mrv1_only",
        "test_allocation_retry_waits_for_fence_then_succeeds",
    ),
    "reads `Request.num_in_flight_tokens`, a counter only vLLM's own KV cache manager "
    "reads; the adapter does not keep it (two writes per request per step)": (
        "test_num_in_flight_tokens_accounting",
    ),
    "writes vLLM's scheduler state directly and hands `update_from_output` a "
    "SchedulerOutput no `schedule()` made": (
        "test_scheduler_ec_connector_stats",
        "test_scheduler_kv_connector_stats",
        "test_stop_via_update_from_output",
        "test_update_from_output_routes_multi_position_sampling_masks",
        "test_update_from_output_routes_sampling_masks_by_request",
    ),
    "`reset_prefix_cache(reset_running_requests=True)` preempts every running request: "
    "helix_kv offers no such preemption, so it resets nothing and returns False": (
        "test_scheduler_reset_prefix_cache",
        "test_reset_prefix_cache_same_step_resume_purges_then_re_adds",
        "test_reset_prefix_cache_priority_does_not_over_admit_worker_slot",
    ),
    _ARRIVAL: (
        "test_priority_scheduling_arrival_time_tiebreaker",
        "test_priority_scheduling_equal_priority_preemption",
        "test_priority_scheduling_fcfs_fallback",
        "test_priority_scheduling_mixed_priority_and_arrival",
    ),
    "a policy helix_kv decides differently on purpose: a second `schedule()` while a step "
    "is in flight plans the in-flight prefill's decode one step ahead (it takes the block "
    "the test expects a new request to get)": ("test_preempt_during_execution",),
    "a policy helix_kv decides differently on purpose: vLLM pads a first decode with "
    "placeholder drafts (for CUDA-graph batch shapes); helix_kv schedules the drafts a "
    "decode was proposed": ("test_spec_decode_padding_first_decode_step",),
}


def reasons_by_test() -> dict[str, str]:
    """test function -> why it is listed (each test is listed once)."""
    out: dict[str, str] = {}
    for reason, tests in NOT_APPLICABLE.items():
        for test in tests:
            assert test not in out, f"{test} is listed twice"
            out[test] = reason
    return out
