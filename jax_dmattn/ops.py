"""Moved to ``jax_dmattn._primitives.ops``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn._primitives import ops

sys.modules[__name__] = ops
