"""Moved to ``jax_dmattn._primitives._ffi``; this former path names the same module
object, so that what is set on it (e.g. by monkeypatch) reaches the code."""

import sys

from jax_dmattn._primitives import _ffi

sys.modules[__name__] = _ffi
