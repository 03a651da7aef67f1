"""The attention primitives and what JAX needs to run them: the compiled extension's FFI calls
(``_ffi``), the primitives with their shapes and lowering (``ops``), their vmap rules
(``batching``) and the differentiable operation the front ends call (``core``, a custom_vjp).
Internal: the public API is ``jax_dmattn``'s."""
