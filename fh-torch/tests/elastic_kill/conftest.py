"""The random-kill elastic stage (see README.md): the harness imports the example, and with it
torch, in the pytest process: one OpenMP thread, set before anything imports torch."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
