"""Moved to ``jax_dmattn.layers.flax``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn.layers import flax

sys.modules[__name__] = flax
