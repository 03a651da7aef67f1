"""Attention over a paged KV cache (issue 26): ``paged_attention`` against the float64 ``xla``
implementation of ``dot_product_attention`` over the same keys laid out contiguously (gathered
here with numpy, not by the code under test).

The pools hold more pages than the sequences use, each sequence's pages scattered and in no
order, with ``-1`` in the table past its length; lengths end inside a page, on a page boundary,
at 0 and at the full ``Lk``. Cases cover ``Lq`` 1 / 4 / 16, GQA groups 1 / 4 / 8, page sizes 64
to 256, masks and biases broadcast in several ways, softcap. The kernels must read the pages in
place and give the very bits of their contiguous path on the gathered cache (the same tiles in
the same order). Also: vmap over the queries and over the pools, shard_map, sharded jit (no
all-gather), validation errors, the example, and that differentiation raises.

The CPU kernels run every case (CI); on a GPU (``gpu``) implementation="cuda" runs them through
the decode forward (asserted by the dispatcher's name) and a prefill-sized call through the
gathered fallback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from form_checks import assert_close, require_cuda_kernel

import jax_dmattn
from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, paged_attention

Dims = tuple[str, ...]  # each dim of a mask or bias: "1", "B", "H", "Hk", "Lq" or "Lk"


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """One call: `pages` max_pages per sequence of `page_size` keys, `kv_lens` one per
    sequence (B = len(kv_lens)); `mask` / `bias` the dims of a mask / bias (None: absent)."""

    kv_lens: tuple[int, ...]
    Lq: int
    H: int
    Hk: int
    D: int
    page_size: int
    pages: int
    dtype: str
    mask: Dims | None = None
    bias: Dims | None = None
    softcap: float | None = None

    @property
    def B(self) -> int:
        return len(self.kv_lens)

    @property
    def Lk(self) -> int:
        return self.pages * self.page_size

    def resolve(self, dims: Dims) -> tuple[int, ...]:
        sizes = {"1": 1, "B": self.B, "H": self.H, "Hk": self.Hk, "Lq": self.Lq, "Lk": self.Lk}
        return tuple(sizes[d] for d in dims)

    def id(self) -> str:
        parts = [f"B{self.B}", f"Lq{self.Lq}", f"G{self.H // self.Hk}", f"D{self.D}",
                 f"ps{self.page_size}", f"Lk{self.Lk}", self.dtype]
        if self.mask:
            parts.append("mask" + "".join(self.mask))
        if self.bias:
            parts.append("bias" + "".join(self.bias))
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        return "-".join(parts)


KEYS: Dims = ("B", "1", "1", "Lk")
ROWS_KEYS: Dims = ("B", "H", "Lq", "Lk")
CASES = [
    PagedCase((1000, 0, 4096, 64), 1, 32, 8, 128, 64, 64, "bfloat16", bias=KEYS),
    PagedCase((1000, 4096, 64), 1, 32, 8, 128, 128, 32, "bfloat16", mask=ROWS_KEYS,
              bias=ROWS_KEYS),
    PagedCase((700, 2048), 4, 16, 4, 128, 256, 8, "float16", mask=("1", "Hk", "Lq", "Lk"),
              softcap=20.0),
    PagedCase((512, 300, 1), 16, 8, 8, 64, 64, 8, "bfloat16", mask=KEYS, bias=("1", "H", "1",
                                                                                "Lk")),
    PagedCase((333,), 16, 32, 4, 128, 64, 6, "float16", bias=ROWS_KEYS),
]


def _ids(cases: list[PagedCase]) -> list[str]:
    return [c.id() for c in cases]


# ---- inputs and the oracle --------------------------------------------------------------------


def scattered_table(rng: np.random.Generator, kv_lens: tuple[int, ...], pages: int,
                    page_size: int) -> tuple[np.ndarray, int]:
    """A page table ``[B, pages]`` naming distinct pages of a pool with spare pages, in random
    order, -1 past each sequence's length; and the pool's size."""
    used = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(used) + 3
    order = rng.permutation(num_pages)
    table = np.full((len(kv_lens), pages), -1, np.int32)
    at = 0
    for b, n in enumerate(used):
        table[b, :n] = order[at:at + n]
        at += n
    return table, num_pages


def inputs(case: PagedCase) -> dict:
    """Fresh random inputs of `case` (seeded by its id): q, the pools, the table, the lengths,
    mask, bias; and the contiguous k and v the table describes (numpy gathers)."""
    rng = np.random.default_rng(zlib.crc32(case.id().encode()))
    dtype = jnp.dtype(case.dtype)
    table, num_pages = scattered_table(rng, case.kv_lens, case.pages, case.page_size)
    pool_shape = (num_pages, case.page_size, case.Hk, case.D)
    q = rng.standard_normal((case.B, case.Lq, case.H, case.D))
    k_pages, v_pages = rng.standard_normal(pool_shape), rng.standard_normal(pool_shape)
    rows = np.maximum(table, 0)
    k, v = (x[rows].reshape(case.B, case.Lk, case.Hk, case.D) for x in (k_pages, v_pages))
    mask = None if case.mask is None else rng.random(case.resolve(case.mask)) < 0.8
    bias = None if case.bias is None else rng.standard_normal(case.resolve(case.bias))
    def cast(x):
        return None if x is None else jnp.asarray(x, dtype)

    return dict(q=cast(q), k_pages=cast(k_pages), v_pages=cast(v_pages),
                page_table=jnp.asarray(table), kv_lens=jnp.asarray(case.kv_lens, jnp.int32),
                mask=None if mask is None else jnp.asarray(mask), bias=cast(bias),
                k=cast(k), v=cast(v))


def paged(case: PagedCase, x: dict, implementation: str | None):
    return paged_attention(x["q"], x["k_pages"], x["v_pages"], x["page_table"], x["kv_lens"],
                           x["mask"], x["bias"], softcap=case.softcap, return_lse=True,
                           implementation=implementation)


def oracle(case: PagedCase, x: dict):
    """float64 ``xla`` dot_product_attention over the contiguous cache, with the lengths."""
    def f64(a):
        return None if a is None else jnp.asarray(a, jnp.float64)

    if case.softcap is not None:  # dot_product_attention takes no softcap: mask the lengths
        keys = jnp.arange(case.Lk) < x["kv_lens"][:, None]
        mask = keys[:, None, None, :] if x["mask"] is None else x["mask"] & keys[:, None, None]
        out, lse = flash_dmattn(f64(x["q"]), f64(x["k"]), f64(x["v"]), mask, f64(x["bias"]),
                                softcap=case.softcap, return_lse=True, implementation="xla")
        return out, lse
    out, res = dot_product_attention(f64(x["q"]), f64(x["k"]), f64(x["v"]), f64(x["bias"]),
                                     x["mask"], key_value_seq_lengths=x["kv_lens"],
                                     return_residual=True, implementation="xla")
    return out, jnp.swapaxes(res, -1, -2)


def check_against_reference(case: PagedCase, implementation: str) -> None:
    """The case's paged call against the float64 oracle, rows without keys exact zeros and lse
    -inf (a length of 0 has them); and bit for bit the contiguous kernel's result on the
    gathered cache (flash_dmattn with the lengths as a key mask would take another path: its
    kernel gets the lengths through dot_product_attention)."""
    x = inputs(case)
    out, lse = paged(case, x, implementation)
    ref_out, ref_lse = oracle(case, x)
    assert out.dtype == x["q"].dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, x["q"].dtype, "out")
    assert_close(lse, ref_lse, jnp.float32, "lse")
    dead = ~np.isfinite(np.asarray(ref_lse))
    assert dead.any() or 0 not in case.kv_lens
    np.testing.assert_array_equal(np.moveaxis(np.asarray(out, np.float32), 1, 2)[dead], 0.0)
    if case.softcap is None:
        contiguous, res = dot_product_attention(
            x["q"], x["k"], x["v"], x["bias"], x["mask"], key_value_seq_lengths=x["kv_lens"],
            query_seq_lengths=jnp.full_like(x["kv_lens"], case.Lq), return_residual=True,
            implementation=implementation)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(contiguous))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(jnp.swapaxes(res, -1, -2)))


# ---- the CPU kernels (CI) ---------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_cpu_matches_float64_reference(case):
    check_against_reference(case, "cpu")


@pytest.mark.parametrize("implementation, dtype", [
    ("cpu", "float32"), ("xla", "float32"),
    pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
def test_causal_rows_align_to_each_sequence(implementation, dtype):
    """is_causal: row i of sequence b is its token kv_lens[b] - Lq + i. Each sequence against
    float64 flash_dmattn(is_causal=True) over its own kv_lens[b] keys (bottom-right aligned
    there), a length shorter than Lq included (its first rows see no key: zeros)."""
    case = PagedCase((300, 2, 64, 129), 4, 8, 2, 64, 64, 5, dtype, bias=ROWS_KEYS)
    if implementation == "cuda":
        assert cuda_kernel_of(case) == "decode"
    x = inputs(case)
    out, lse = paged_attention(x["q"], x["k_pages"], x["v_pages"], x["page_table"],
                               x["kv_lens"], None, x["bias"], is_causal=True, return_lse=True,
                               implementation=implementation)
    f64 = {n: jnp.asarray(x[n], jnp.float64) for n in ("q", "k", "v", "bias")}
    for b, n in enumerate(case.kv_lens):
        want, want_lse = flash_dmattn(
            f64["q"][b:b + 1], f64["k"][b:b + 1, :n], f64["v"][b:b + 1, :n], None,
            f64["bias"][b:b + 1, ..., :n], is_causal=True, return_lse=True, implementation="xla")
        assert_close(out[b:b + 1], want, x["q"].dtype, f"out of sequence {b}")
        assert_close(lse[b:b + 1], want_lse, jnp.float32, f"lse of sequence {b}")
    assert not np.isfinite(np.asarray(lse[1, :, :2])).any()  # kv_lens 2 < Lq 4: rows 0, 1


def test_xla_reads_the_same_pages():
    """The reference implementation (gathered pages) against the oracle."""
    case = CASES[1]
    x = inputs(case)
    out, lse = paged(case, x, "xla")
    ref_out, ref_lse = oracle(case, x)
    assert_close(out, ref_out, x["q"].dtype, "out")
    assert_close(lse, ref_lse, jnp.float32, "lse")


def test_jit_and_vmap_over_queries_and_pools():
    """jit; vmap over the queries with one shared pool; vmap over pools (each example its own
    pages and table): each example as its own call."""
    case = PagedCase((200, 64, 0), 2, 8, 2, 64, 64, 4, "float32", bias=KEYS)
    x = inputs(case)

    def one(q, k_pages, v_pages, table, lens):
        return paged_attention(q, k_pages, v_pages, table, lens, None, x["bias"])

    args = (x["q"], x["k_pages"], x["v_pages"], x["page_table"], x["kv_lens"])
    np.testing.assert_array_equal(np.asarray(jax.jit(one)(*args)), np.asarray(one(*args)))
    qs = jnp.stack([x["q"], -x["q"], 2 * x["q"]])
    got = jax.vmap(one, in_axes=(0, None, None, None, None))(qs, *args[1:])
    for i in range(3):
        np.testing.assert_allclose(got[i], one(qs[i], *args[1:]), atol=1e-6, rtol=1e-6)
    pools = [jnp.stack([p, p[::-1] * 0.5]) for p in args[1:3]]
    tables = jnp.stack([x["page_table"], x["page_table"][::-1]])
    lens = jnp.stack([x["kv_lens"], x["kv_lens"][::-1]])
    got = jax.vmap(one, in_axes=(None, 0, 0, 0, 0))(x["q"], *pools, tables, lens)
    for i in range(2):
        want = one(x["q"], pools[0][i], pools[1][i], tables[i], lens[i])
        np.testing.assert_allclose(got[i], want, atol=1e-6, rtol=1e-6)


def test_shard_map_over_batch_and_heads():
    """shard_map with the batch over one mesh axis and the kv heads (the pools' third dim)
    over another: each shard reads its own heads of the shared pool."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    case = PagedCase((130, 64, 250, 1), 1, 8, 4, 64, 64, 4, "float32")
    x = inputs(case)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("b", "h"))
    fn = jax.shard_map(
        lambda q, k, v, t, n: paged_attention(q, k, v, t, n),
        mesh=mesh, in_specs=(P("b", None, "h"), P(None, None, "h"), P(None, None, "h"), P("b"),
                             P("b")),
        out_specs=P("b", None, "h"))
    args = (x["q"], x["k_pages"], x["v_pages"], x["page_table"], x["kv_lens"])
    np.testing.assert_allclose(fn(*args), paged_attention(*args), atol=1e-6, rtol=1e-6)


def test_sharded_jit_keeps_batch_and_heads_local():
    """jit over inputs sharded by batch (q, table, lengths, bias) and heads (q, bias, the pools'
    kv heads): the call is partitioned (no all-gather: the pool is never gathered), its output
    keeps q's sharding and equals the unsharded call."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    case = PagedCase((130, 64, 250, 1), 1, 8, 4, 64, 64, 4, "float32", bias=ROWS_KEYS)
    x = inputs(case)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    specs = dict(q=P("data", None, "model"), k_pages=P(None, None, "model"),
                 v_pages=P(None, None, "model"), page_table=P("data"), kv_lens=P("data"),
                 bias=P("data", "model"))
    names = ("q", "k_pages", "v_pages", "page_table", "kv_lens", "bias")
    sharded = [jax.device_put(x[n], NamedSharding(mesh, specs[n])) for n in names]

    def call(q, k, v, table, lens, bias):
        return paged_attention(q, k, v, table, lens, None, bias)

    text = jax.jit(call).lower(*sharded).compile().as_text()
    assert "all-gather" not in text
    out = jax.jit(call)(*sharded)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs["q"]), 4), out.sharding
    np.testing.assert_allclose(out, call(*(x[n] for n in names)), atol=1e-6, rtol=1e-6)


def test_out_of_range_pages_past_the_lengths_are_never_read():
    """Entries past a sequence's length may be anything; under jit (tables unseen) an entry
    the length reaches outside the pool is clamped into it, like the reference's gather."""
    case = PagedCase((100, 64), 1, 4, 2, 64, 64, 3, "float32")
    x = inputs(case)
    args = (x["q"], x["k_pages"], x["v_pages"])
    junk = x["page_table"].at[:, 2].set(12345)
    want = paged_attention(*args, x["page_table"], x["kv_lens"])
    np.testing.assert_array_equal(np.asarray(paged_attention(*args, junk, x["kv_lens"])),
                                  np.asarray(want))
    wild = x["page_table"].at[0, 1].set(-7)
    jitted = jax.jit(paged_attention)(*args, wild, x["kv_lens"])
    clamped = paged_attention(*args, jnp.maximum(wild, 0), x["kv_lens"], implementation="xla")
    np.testing.assert_allclose(jitted, clamped, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("change, error, match", [
    (dict(page_size=48), ValueError, "power of two, at least 64"),
    (dict(page_size=192), ValueError, "power of two, at least 64"),
    (dict(table_dtype=jnp.int64), ValueError, "page_table must be int32"),
    (dict(kv_lens=(193, 1)), ValueError, r"kv_lens must lie in \[0, max_pages \* page_size"),
    (dict(kv_lens=(-1, 1)), ValueError, "kv_lens must lie"),
    (dict(bad_entry=(1, 0)), ValueError, r"page_table\[1, 0\] = 99 names no page"),
    (dict(pool_dtype=jnp.float16), TypeError, "key_pages dtype float16 differs"),
    (dict(kv_heads=3), ValueError, "multiple of key/value heads"),
])
def test_bad_inputs_raise(change, error, match):
    page_size, kv_heads = change.get("page_size", 64), change.get("kv_heads", 2)
    q = jnp.ones((2, 1, 4, 32), jnp.float32)
    pool = jnp.ones((5, page_size, kv_heads, 32), change.get("pool_dtype", jnp.float32))
    table = np.array([[0, 1, 2], [3, -1, -1]])
    if "bad_entry" in change:
        table[change["bad_entry"]] = 99
    table = jnp.asarray(table, change.get("table_dtype", jnp.int32))
    lens = jnp.asarray(change.get("kv_lens", (150, 1)), jnp.int32)
    with pytest.raises(error, match=match):
        paged_attention(q, pool, jnp.ones(pool.shape, jnp.float32), table, lens)


def test_example_decodes_with_a_paged_cache():
    """examples/paged_decode.py as a script (small settings): it decodes, prints its rate, and
    its paged attention matches the contiguous one."""
    example = Path(__file__).resolve().parents[1] / "examples" / "paged_decode.py"
    env = dict(os.environ)
    package_root = str(Path(jax_dmattn.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(example), "--batch", "3", "--context", "150",
                          "--steps", "5", "--layers", "2"], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"64-key pages: [\d,]+ tokens/s", run.stdout), run.stdout
    error = re.search(r"max \|paged - contiguous\| = (\S+)", run.stdout)
    assert error and float(error.group(1)) < 1e-5, run.stdout


def test_min_page_size_is_the_kernels():
    """The front end's page size rule mirrors the kernels' (csrc/common/params.h)."""
    assert jax_dmattn.paged.MIN_PAGE_SIZE == _ffi.build_info()["min_page_size"]


def test_differentiation_raises():
    case = PagedCase((64,), 1, 2, 1, 32, 64, 1, "float32")
    x = inputs(case)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: paged_attention(q, x["k_pages"], x["v_pages"], x["page_table"],
                                           x["kv_lens"]).sum())(x["q"])


# ---- the CUDA kernels -------------------------------------------------------------------------


def cuda_kernel_of(case: PagedCase) -> str:
    require_cuda_kernel(case.D, jnp.dtype(case.dtype))
    mask = None if case.mask is None else case.resolve(case.mask)
    bias = None if case.bias is None else case.resolve(case.bias)
    return _ffi.cuda_forward_kernel((case.B, case.Lq, case.H, case.D),
                                    (case.B, case.Lk, case.Hk, case.D), mask, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_cuda_decode_reads_pages_in_place(case):
    assert cuda_kernel_of(case) == "decode", case.id()
    check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_prefill_gathers_the_pages():
    """More query rows than the decode forward takes: the pages are gathered, then the
    contiguous forward runs (no decode kernel named)."""
    case = PagedCase((900, 2048), 40, 16, 4, 128, 128, 16, "bfloat16", mask=ROWS_KEYS,
                     bias=KEYS)
    assert cuda_kernel_of(case) != "decode"
    check_against_reference(case, "cuda")
