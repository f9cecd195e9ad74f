"""Shared test setup: offline hub, deterministic float64 maths, few threads (the machine has 2 cores)."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The run history of the tests (live runs the app keeps; servers they start inherit it), never the user's.
_HOME = tempfile.TemporaryDirectory(prefix="lmc-test-home-")
os.environ["LMC_EXPLORER_HOME"] = _HOME.name

import torch

torch.set_num_threads(1)
