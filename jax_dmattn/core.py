"""Moved to ``jax_dmattn._primitives.core``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn._primitives import core

sys.modules[__name__] = core
