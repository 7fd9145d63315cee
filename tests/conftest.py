"""Shared fixtures: gloo worlds started once per session and shared by the test modules (see dist_harness.py).

The same suite runs on CPU machines and on GPU hosts:

* ds-usp's Triton kernels run on CPU tensors in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, before
  any test imports triton (ds-usp still compiles the kernels for CUDA tensors, see ``triton_attn._kernels``);
* on a GPU host this process keeps the GPU for the ``gpu`` tests, and every process it starts (gloo worlds,
  launchers, jobs) sees none: the multi-rank tests are CPU tests over gloo wherever they run. A ``gpu`` test is
  skipped here when there is no CUDA device; test modules do not decide that themselves (see :data:`CUDA`).

``python -m pytest -m fast`` runs the quick subset listed in :data:`FAST` (no gloo world, no launcher, no build of
the native op; under 3 minutes on 2 cores) for local work; CI (``.ci/run``) runs the whole suite.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
# Read before the children's variable is cleared: on the H100 host (torch 2.11) the test modules' own import-time
# torch.cuda.is_available() answered False once it was cleared, and every gpu test was skipped. The ``gpu`` tests
# are skipped here when there is none (pytest_collection_modifyitems) and run with the variable as it was
# (pytest_runtest_protocol).
CUDA = torch.cuda.is_available()
CUDA_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
if CUDA:
    torch.cuda.init()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # children: CPU ranks

sys.path.insert(0, os.path.dirname(__file__))
# benchmarks some tests run in part (step_work, family_sweep; ranks started here get this sys.path); the measuring
# instruments are the package's (ds_usp.instruments)
_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, _BENCHMARKS)
from dist_harness import World  # noqa: E402

# The ``fast`` subset: a test file -> "*" (all its tests) or the names of its quick test functions (every
# parametrization of a name). Nothing here starts a gloo world, a launcher or a native-op build (the plan tests
# run the planner's command line, one short process at a time).
FAST: dict[str, object] = {
    "test_docs.py": "*",
    "test_layers.py": "*",
    "test_patches.py": "*",
    "test_kernels.py": "*",  # CPU kernels on small tensors (the gpu ones skip without CUDA)
    "test_flash_attn4.py": "*",  # the FA4 adapter against a stand-in of its API, in one process
    "test_config_topology.py": {
        "test_bad_config_names_the_key", "test_head_constraints_are_checked_when_heads_are_known",
        "test_timeout_default_and_value", "test_file_path_and_missing_file", "test_modes_and_defaults",
        "test_ranks_per_node_from_either_launcher", "test_automatic_degrees_follow_the_paper",
        "test_plan_partitions_the_world_for_every_factorization", "test_shipped_configs_load",
        "test_reliability_doc_counts_the_bad_configs", "test_config_docs_table_is_the_schema"},
    "test_native_op.py": {  # the ones that need neither the built op nor a world
        "test_twin_packing_matches_a_hand_written_layout", "test_native_op_true_without_compiler_is_an_error",
        "test_native_op_auto_without_compiler_warns_once", "test_native_op_false_never_builds",
        "test_native_op_bad_setting", "test_unsupported_device_type", "test_cuda_builder_takes_arch_specific_entries",
        "test_builders_load_from_a_source_checkout", "test_the_cpu_flags_are_probed_once_per_process"},
    "test_triton.py": {  # the kernels in Triton's interpreter on small shapes; not the sm_90 compile (a subprocess)
        "test_matches_exact_attention_cpu", "test_half_precision_cpu",
        "test_plain_entries_are_the_causal_and_full_bands", "test_unavailable_reason_on_cpu",
        "test_bad_inputs_are_refused", "test_interpreter_is_chosen_per_tensor_not_per_process"},
    "test_hf_trainer.py": {"test_hook_check_names_what_is_missing", "test_the_patched_hf_function_is_still_hfs"},
    "test_models.py": {  # tiny models in one process; not the 4-rank family runs
        "test_reference_variants_agree", "test_logits_tail_is_found_in_every_training_dtype",
        "test_every_interface_keyword_is_classified", "test_non_interface_families_are_refused_by_name",
        "test_unknown_keywords_are_refused", "test_models_doc_lists_the_tested_families",
        "test_masks_are_read_from_transformers_mask_functions", "test_default_positions_follow_the_model"},
    "test_linear.py": {
        "test_segments_combine_to_the_recurrence", "test_response_and_transition_are_the_affine_map",
        "test_other_recurrent_families_are_refused_by_name", "test_linear_heads_the_degree_cannot_split_are_refused"},
    "test_memory.py": {"test_chunked_loss_equals_cross_entropy",
                       "test_auto_takes_the_fastest_features_that_fit_the_budget",
                       "test_only_dense_mlp_blocks_become_zero3_leaves"},
    "test_plan.py": {  # the cost model and its command line; not the measured 4-rank steps
        "test_cli_ranks_plans_and_writes_the_json", "test_cli_answers_impossible_requests",
        "test_cli_prices_one_split", "test_model_shapes_from_hf_configs",
        "test_auto_degrees_are_priced_at_the_models_length", "test_predicted_peak_within_15_percent_of_the_h200_rows",
        "test_auto_takes_no_feature_the_gpu_does_not_need", "test_offloaded_layer_inputs_fit_the_host"},
    "test_usp_attention.py": {"test_fp8_codec_error_bound"},
    "test_packed.py": {"test_balanced_layout_balances_packed_rows", "test_reference_masks_documents"},
    "test_reliability.py": {"test_low_precision_keeps_fp32_lse_and_accumulators"},
    "test_comm_volume.py": {"test_closed_form_hand_values"},
}


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`FAST` ``fast``; skip the ``gpu`` tests without CUDA; warn about listed names a test
    module no longer has."""
    modules = {}
    for item in items:
        if not CUDA and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        wanted = FAST.get(item.path.name)
        name = getattr(item, "originalname", item.name)
        if wanted == "*" or (wanted is not None and name in wanted):
            item.add_marker(pytest.mark.fast)
        if wanted is not None and wanted != "*" and getattr(item, "module", None) is not None:
            modules[item.path.name] = item.module
    for file, module in modules.items():
        stale = sorted(name for name in FAST[file] if not hasattr(module, name))
        if stale:
            warnings.warn(f"tests/conftest.py FAST lists tests {file} no longer has: {', '.join(stale)}",
                          pytest.PytestWarning)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A ``gpu`` test runs with CUDA_VISIBLE_DEVICES as this process found it (cleared again afterwards)."""
    if not (CUDA and item.get_closest_marker("gpu")):
        yield
        return
    gpu_visible(True)
    try:
        yield
    finally:
        gpu_visible(False)


def gpu_visible(visible: bool) -> None:
    """Give this process's CUDA_VISIBLE_DEVICES its original value (``visible``) or the children's empty one."""
    if visible and CUDA_VISIBLE is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = CUDA_VISIBLE if visible else ""


_SHARED: dict[int, World] = {}  # world size -> the world every module of this session that asks for it shares
_LIVE: list[World] = []  # every world not closed yet
# a world whose ranks run more threads than this after a test is restarted before the next test: a case that succeeds
# releases the gloo groups it built (dist_harness._release_groups), a failed one leaves them, each with threads that
# poll while idle (see World.threads)
MAX_WORLD_THREADS = 250


def _last_user(session, fixture: str):
    """The last collected module whose tests ask for ``fixture`` (None if none does)."""
    users = [item.module for item in session.items if fixture in getattr(item, "fixturenames", ())]
    return users[-1] if users else None


def _world(request, size: int):
    """A world of ``size`` ranks; a module may set ``WORLD_TIMEOUT`` (seconds a case may take, default 180).

    A world is shared by the modules in turn and closed after the last module that asks for it (an idle rank holds
    about 270 MB): its ranks' first cases import what the fork server did not (dist_harness.PRELOAD), and 20 modules
    ask for 4 ranks, 3 for 8. A case that hangs restarts the world."""
    timeout = getattr(request.module, "WORLD_TIMEOUT", 180.0)
    w = _SHARED.get(size)
    if w is None:
        w = _SHARED[size] = World(size, timeout=timeout)
        _LIVE.append(w)
    w.timeout = timeout
    yield w
    if request.module is _last_user(request.session, f"world{size}"):
        w.close()
        _LIVE.remove(w)
        del _SHARED[size]


@pytest.fixture(autouse=True)
def _restart_crowded_worlds():
    """After each test, a world crowded with the idle threads of process groups its failed cases left is restarted."""
    yield
    for w in _LIVE:
        if w.threads() > MAX_WORLD_THREADS:
            w.restart()


@pytest.fixture(scope="session", autouse=True)
def _close_shared_worlds():
    yield
    for w in _LIVE:
        w.close()


@pytest.fixture(scope="module")
def world2(request):
    """A 2-rank gloo world (shared by the session's modules, one module at a time)."""
    yield from _world(request, 2)


@pytest.fixture(scope="module")
def world4(request):
    """A 4-rank gloo world (shared by the session's modules, one module at a time)."""
    yield from _world(request, 4)


@pytest.fixture(scope="module")
def world8(request):
    """An 8-rank gloo world (shared by the session's modules, one module at a time)."""
    yield from _world(request, 8)
