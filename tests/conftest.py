import os
import sys

# Tests share the machine's cores with nothing else; keep TVM's pool at the CI size.
os.environ.setdefault("TVM_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(__file__))
