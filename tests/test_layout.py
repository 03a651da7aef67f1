"""The package's layout: its modules import one another without a cycle, every public name keeps
the import path it had before the package was split into folders, and importing one front end
alone is enough to run the kernels."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_dmattn

PACKAGE = Path(jax_dmattn.__file__).resolve().parent

# Public names per module path as they were in the flat package (names defined without a leading
# underscore, and __init__'s public imports): each must still import from that path.
PUBLIC_NAMES: dict[str, tuple[str, ...]] = {
    "jax_dmattn": (
        "AttentionParams", "IMPLEMENTATIONS", "__version__", "available_implementations",
        "context_parallel", "dot_product_attention", "dynamic", "dynamic_attention",
        "flash_dmattn", "masks", "reference"),
    "jax_dmattn.__main__": ("gpu_summary", "main", "self_check", "timing_table"),
    "jax_dmattn._ffi": (
        "BACKWARD_TARGET", "FORWARD_TARGET", "MASK_MAP_TARGET", "MAX_BATCH_DIMS",
        "RANGE_MASK_TARGET", "SUM_LISTED_KEYS_TARGET", "TOPK_LEAVE_TARGET", "build_info",
        "call_backward", "call_forward", "call_mask_map", "call_range_mask",
        "call_sum_listed_keys", "call_topk_leave", "cuda_arch_runs_on", "cuda_dtypes",
        "cuda_forward_kernel", "cuda_forward_splits", "cuda_head_dims",
        "cuda_set_backward_kernel", "cuda_set_forward_kernel", "has_cuda_kernels",
        "local_gpu_compute_capability", "register_targets"),
    "jax_dmattn._timing": ("attention_flops", "back_to_back_ms", "median_ms"),
    "jax_dmattn.attention": ("dot_product_attention", "flash_dmattn"),
    "jax_dmattn.batching": (),
    "jax_dmattn.context_parallel": (
        "AxisName", "KERNEL_STEPS", "LAYOUTS", "Layout", "REFERENCE_STEPS", "StepFns",
        "from_zigzag", "ring_attention", "ring_backward", "ring_candidate", "ring_forward",
        "ring_supported", "to_zigzag", "zigzag_order"),
    "jax_dmattn.core": ("attention", "vary_alike"),
    "jax_dmattn.dynamic": ("default_query_block", "dynamic_attention"),
    "jax_dmattn.equinox": ("DynamicMaskAttention",),
    "jax_dmattn.flax": ("DynamicMaskAttention", "DynamicMaskAttentionLinen", "attention_fn"),
    "jax_dmattn.masks": (
        "BlockIndices", "KeyRanges", "RowRanges", "block_mask", "block_range_mask", "causal_mask",
        "key_ranges", "list_block_keys", "list_block_keys_and_slots", "padding_mask",
        "topk_block_keys", "topk_key_ranges", "topk_mask", "window_mask"),
    "jax_dmattn.ops": (
        "Optionals", "backward", "backward_p", "forward", "forward_p", "gradient_shape",
        "lse_shape", "sum_listed_keys", "sum_listed_keys_p", "uses_kernel"),
    "jax_dmattn.params": ("AttentionParams", "IMPLEMENTATIONS"),
    "jax_dmattn.reference": ("attention", "visibility"),
    "jax_dmattn.sharding": ("Axes", "kernel_backward", "kernel_forward", "kernel_sum_listed_keys"),
    "jax_dmattn.validation": (
        "Dims", "KERNEL_DTYPES", "as_array", "check_bias", "check_broadcast_operand",
        "check_implementation", "check_mask", "check_qkv", "check_scale", "check_seq_lengths",
        "check_softcap", "check_window", "dims_of"),
}

# Former module paths, now alias modules, and the modules they name.
MOVED = {
    "jax_dmattn._ffi": "jax_dmattn._primitives._ffi",
    "jax_dmattn.batching": "jax_dmattn._primitives.batching",
    "jax_dmattn.core": "jax_dmattn._primitives.core",
    "jax_dmattn.ops": "jax_dmattn._primitives.ops",
    "jax_dmattn.context_parallel": "jax_dmattn.parallel.context_parallel",
    "jax_dmattn.sharding": "jax_dmattn.parallel.sharding",
    "jax_dmattn.equinox": "jax_dmattn.layers.equinox",
    "jax_dmattn.flax": "jax_dmattn.layers.flax",
}

OPTIONAL_DEPENDENCIES = {"jax_dmattn.flax": "flax", "jax_dmattn.equinox": "equinox"}


def package_modules() -> dict[str, Path]:
    """Every Python module of the installed package by dotted name (a package by its __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def extension_modules() -> set[str]:
    """The compiled modules of the package (CMakeLists.txt's targets; they import nothing of it)
    by dotted name, wherever the install put them (an editable one keeps them out of the tree)."""
    found = {"jax_dmattn._dmattn"}
    missing = [name for name in found if importlib.util.find_spec(name) is None]
    assert not missing, f"compiled modules not importable: {missing}"
    return found


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules (of `modules`) that `name` imports anywhere in its source (function
    bodies too: a deferred import only hides a cycle). ``from p import x`` counts as ``p.x`` where
    that is a module, else as ``p``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None for a DAG (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        path.append(node)
        for successor in sorted(graph[node]):
            cycle = visit(successor)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_find_cycle_reports_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({**graph, "c": {"d"}}) is None


def import_graph() -> dict[str, set[str]]:
    """The package's modules (compiled ones too) and the package's modules each one imports."""
    sources = package_modules()
    modules = set(sources) | extension_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in sources.items()}
    graph.update((name, set()) for name in modules - set(sources))
    return graph


def test_package_imports_form_a_dag():
    graph = import_graph()
    assert graph.get("jax_dmattn.attention"), graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_package_imports_modules_where_they_live():
    """The alias modules at former paths are for users; the package imports the modules
    themselves."""
    graph = import_graph()
    aliased = sorted(f"{name} imports {alias}" for name, imported in graph.items()
                     for alias in imported & MOVED.keys())
    assert not aliased, aliased


@pytest.mark.parametrize("former", sorted(MOVED))
def test_former_paths_name_the_moved_modules(former):
    if former in OPTIONAL_DEPENDENCIES:
        pytest.importorskip(OPTIONAL_DEPENDENCIES[former])
    assert importlib.import_module(former) is importlib.import_module(MOVED[former])


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_keep_their_import_paths(module_name):
    if module_name in OPTIONAL_DEPENDENCIES:
        pytest.importorskip(OPTIONAL_DEPENDENCIES[module_name])
    module = importlib.import_module(module_name)
    missing = [name for name in PUBLIC_NAMES[module_name] if not hasattr(module, name)]
    assert not missing, f"{module_name} lost {missing}"


def test_importing_one_front_end_registers_the_kernels():
    """``import jax_dmattn.attention`` alone (a fresh interpreter) lowers flash_dmattn to the
    kernel's FFI call, not to the pure-JAX reference."""
    code = ("import jax, jax.numpy as jnp\n"
            "from jax_dmattn.attention import flash_dmattn\n"
            "q = jnp.zeros((1, 8, 2, 16), jnp.float32)\n"
            "print(jax.jit(lambda q: flash_dmattn(q, q, q)).lower(q).as_text())\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE.parent),
                                                      os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert "custom_call @dmattn_fwd" in run.stdout
