"""Flash Dynamic Mask Attention for JAX.

Fused kernels for ``softmax(scale · Q Kᵀ + bias, masked) V`` with a broadcastable boolean mask
and a trainable additive bias, skipping every tile the mask hides; differentiable and usable under
``jit``, ``grad``, ``vmap``, ``pmap``, ``shard_map`` and sharded ``jit``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from jax_dmattn import dynamic, masks, paged, reference

# Attributes of the package under the names they had before moving into _primitives/ and parallel/
# (``import jax_dmattn.ops`` and the like go through the alias modules at those paths).
from jax_dmattn._primitives import _ffi, batching, core, ops  # noqa: F401
from jax_dmattn.attention import dot_product_attention, flash_dmattn
from jax_dmattn.dynamic import dynamic_attention
from jax_dmattn.paged import paged_attention

# sharding lowers the primitives to the kernels when imported (ops, below it, cannot import it).
from jax_dmattn.parallel import context_parallel, sharding  # noqa: F401
from jax_dmattn.params import IMPLEMENTATIONS, AttentionParams

try:
    __version__ = version("jax_dmattn")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"


def available_implementations() -> tuple[str, ...]:
    """Implementations this build can run: ``xla`` always, ``cpu``, and ``cuda`` if compiled."""
    return tuple(i for i in IMPLEMENTATIONS if i != "cuda" or _ffi.has_cuda_kernels())


__all__ = [
    "AttentionParams",
    "__version__",
    "available_implementations",
    "context_parallel",
    "dot_product_attention",
    "dynamic",
    "dynamic_attention",
    "flash_dmattn",
    "masks",
    "paged",
    "paged_attention",
    "reference",
]
