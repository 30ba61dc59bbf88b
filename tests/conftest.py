import os
import sys

# TVM's pool spins on its cores: with pytest-xdist's workers (one per core) each gets one thread,
# run alone the suite uses the CI machine's two.
os.environ.setdefault("TVM_NUM_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2")
sys.path.insert(0, os.path.dirname(__file__))
