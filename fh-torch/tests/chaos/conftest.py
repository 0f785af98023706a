"""The chaos suite: ranks killed, stopped or raising at random moments (see README.md).

The ranks of a run are forked from the pytest process (torch imported once here), so torch
must not start threads in it: one OpenMP thread, set before anything imports torch."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
