import os
import sys

# TVM's pool spins on its cores: with pytest-xdist's workers (one per core) each gets one thread,
# run alone the suite uses the CI machine's two.
os.environ.setdefault("TVM_NUM_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2")
sys.path.insert(0, os.path.dirname(__file__))

# The slowest tests (60-160 s each on the CI machine) start first: with two workers, a long test
# collected last ran alone for minutes at the end of the suite while the other worker idled.
_SLOW_FIRST = (
    "test_tutorials_and_bench.py::test_gpu_check_pipeline_without_gpu",
    "test_tuning.py::test_tune_a_network_then_build_with_its_records",
    "test_tuning.py::test_rpc_tuning_on_loopback_survives_a_dead_server",
    "test_tuning.py::test_sigkill_loses_no_finished_trial_and_the_rerun_continues",
    "test_tutorials_and_bench.py::test_cli_tune_an_onnx_model",
    "test_tutorials_and_bench.py::test_tutorial_03_autotune",
    "test_tutorials_and_bench.py::test_e2e_bench_smoke",
    "test_tuning.py::test_a_network_with_pooling_tunes_and_uses_its_pooling_record",
    "test_models.py::test_network_through_tvm_ext_matches_float64_reference",
    "test_tutorials_and_bench.py::test_tune_bench_smoke",
    "test_tuning.py::test_shipped_records_apply_only_to_their_target",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        node = item.nodeid.split("/")[-1]
        return next((i for i, slow in enumerate(_SLOW_FIRST) if node.startswith(slow)), len(_SLOW_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
