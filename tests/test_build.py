"""The compiled extension against the installed jax: its XLA FFI handlers must not be newer than
the jaxlib that registers them (a build environment with a newer jax made such wheels)."""

from __future__ import annotations

import pytest

from jax_dmattn import _ffi


def test_compiled_ffi_api_is_accepted_by_installed_jaxlib():
    compiled = tuple(_ffi.build_info()["xla_ffi_api"])
    installed = _ffi.installed_ffi_api()
    assert installed is not None, "the installed jaxlib's FFI headers could not be read"
    assert compiled <= installed
    _ffi.check_ffi_api(compiled, installed)


def test_newer_compiled_ffi_api_raises_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"XLA FFI API 0\.5, newer .* 0\.4.*Reinstall"):
        _ffi.check_ffi_api((0, 5), (0, 4))
    _ffi.check_ffi_api((0, 3), (0, 4))
    _ffi.check_ffi_api((0, 5), None)
