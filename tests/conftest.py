import os
import sys

# TVM's pool spins on its cores: with pytest-xdist's workers (one per core) each gets one thread,
# run alone the suite uses the CI machine's two.
os.environ.setdefault("TVM_NUM_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2")
sys.path.insert(0, os.path.dirname(__file__))


# The tests marked slow (60-160 s each on the CI machine: tuning, whole networks, the wheel; `make
# test-fast` leaves them out) start first: with two workers, a long test collected last ran alone
# for minutes at the end of the suite while the other worker idled.
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: each group keeps its order
