"""Moved to ``jax_dmattn.parallel.context_parallel``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn.parallel import context_parallel

sys.modules[__name__] = context_parallel
