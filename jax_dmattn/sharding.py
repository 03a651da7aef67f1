"""Moved to ``jax_dmattn.parallel.sharding``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn.parallel import sharding

sys.modules[__name__] = sharding
