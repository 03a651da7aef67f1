"""examples/train_dma_lm.py: as a script (one device) and in-process on the test session's 8 host
devices (with jax_enable_x64 on, as conftest sets it)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import jax
import numpy as np
import pytest

import jax_dmattn

for _module in ("flax", "equinox", "optax"):  # the example's dependencies, optional for the package
    pytest.importorskip(_module)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_dma_lm.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_dma_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (equinox modules) look their module up
    spec.loader.exec_module(module)
    return module


def test_script_trains_on_one_device():
    """A short run whose loss falls (settings where it is fast: ~15 s on 2 CPU cores)."""
    env = dict(os.environ)
    # the jax_dmattn this session imported, and one device (drop conftest's 8 host devices)
    package_root = str(Path(jax_dmattn.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "")
    args = ["--steps", "15", "--batch", "8", "--seq-len", "32", "--window", "16", "--layers",
            "1", "--log-every", "5"]
    run = subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on 1 device(s)" in run.stdout, run.stdout
    found = re.search(r"final loss (\S+) \(initial (\S+),", run.stdout)
    assert found, run.stdout
    final, initial = float(found.group(1)), float(found.group(2))
    assert math.isfinite(final) and math.isfinite(initial), run.stdout
    assert final < 0.9 * initial, run.stdout
    assert "tokens/s" in run.stdout


def test_in_process_on_8_devices_equinox():
    """The batch sharded over the 8 host devices; the Equinox twin; x64 on."""
    assert jax.device_count() == 8 and jax.config.jax_enable_x64
    result = load_example().main(["--framework", "equinox", "--steps", "2", "--batch", "16",
                                  "--seq-len", "16", "--window", "4", "--layers", "1",
                                  "--width", "32"])
    assert result["devices"] == 8
    assert math.isfinite(result["initial_loss"]) and math.isfinite(result["final_loss"])


def test_packed_in_process_on_8_devices():
    """``--packed``: rows of several documents trained with causal + segment ids (the batch
    sharded over the 8 host devices); the loss falls. The packed data: within a document each
    target is the next input, documents take 4 to L/2 tokens (the last of a row may be cut)."""
    example = load_example()
    data = example.MotifData(vocab=32, seq_len=32, seed=0)
    inputs, targets, ids = data.packed_batch(8, np.random.default_rng(1))
    assert inputs.shape == targets.shape == ids.shape == (8, 32)
    same = ids[:, 1:] == ids[:, :-1]
    np.testing.assert_array_equal(inputs[:, 1:][same], targets[:, :-1][same])
    assert (ids[:, 0] == 0).all() and (np.diff(ids, axis=1) >= 0).all()
    assert ids.max() >= 2  # at least three documents in some row
    for row in ids:
        lengths = np.bincount(row)
        assert (lengths[:-1] >= 4).all() and (lengths <= 16).all()

    result = example.main(["--packed", "--steps", "15", "--batch", "8", "--seq-len", "32",
                           "--window", "8", "--layers", "1", "--log-every", "5"])
    assert result["devices"] == 8
    assert math.isfinite(result["initial_loss"]) and math.isfinite(result["final_loss"])
    assert result["final_loss"] < 0.9 * result["initial_loss"]
