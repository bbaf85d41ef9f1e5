"""Loaded by every Python process when this folder is on PYTHONPATH: puts the fake CuPy
of ``tests/fake_cupy.py`` in ``sys.modules``, so ``jobs/gpu_check.sh --dry-run`` can walk
through the whole GPU check on a machine without a GPU (its numbers mean nothing).
"""

import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import fake_cupy  # noqa: E402


class _Patch:
    def setitem(self, mapping, key, value):
        mapping[key] = value


_cp = fake_cupy.install(_Patch(), jitter=1e-5)
_rng = np.random.default_rng(0)
_cp.random = types.SimpleNamespace(
    standard_normal=lambda size=None, dtype=np.float64: fake_cupy._dev(_rng.standard_normal(size).astype(dtype)))
if os.environ.get("FAKE_CUPY_GPU_PER_RANK") == "1":  # one "GPU" per rank, so NCCL is allowed
    fake_cupy._state.bus_id = f"0000:{int(os.environ.get('PMI_RANK', '0')):02x}:00.0"
