"""Moved to ``jax_dmattn.layers.equinox``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn.layers import equinox

sys.modules[__name__] = equinox
