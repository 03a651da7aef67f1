"""Train a small decoder-only language model built from Dynamic Mask Attention layers.

    python examples/train_dma_lm.py                      # Flax NNX; defaults: ~40 s, 2 CPU cores
    python examples/train_dma_lm.py --framework equinox  # the same model from the Equinox layer
    python examples/train_dma_lm.py --steps 1500 --seq-len 128 --batch 32 --window 48
    python examples/train_dma_lm.py --packed             # several documents per row

The data is generated here, no download: every sequence is a short "motif" (4-12 tokens drawn
from a fixed sparse Markov chain over the vocabulary) repeated to the sequence length. A model
learns the chain's bigrams first (the loss falls from ln(vocab) to about 1 nat within ~150 steps),
then to copy each motif's continuation from its previous period through attention (the loss goes
below the bigram level after a few hundred steps, ~0.5 after 1500).

With ``--packed`` each row instead packs several such documents of random lengths (4 to
``seq-len / 2`` tokens, the last one cut to fit), each with its own motif, and the model gets
their segment ids: every token attends causally within its own document only (its top-``window``
keys chosen there), and its RoPE position counts from the document's start, so a packed row
trains like its documents run one by one.

Model: token embedding, ``--layers`` pre-norm blocks of (RMSNorm, Dynamic Mask Attention with
RoPE, GQA and a causal top-``--window`` dynamic mask) and (RMSNorm, GELU MLP), a final RMSNorm
and an output head tied to the embedding. Trained with optax AdamW in one jit-compiled step.
With several devices (``jax.device_count() > 1``) the batch is sharded over a 1-D ``"data"``
mesh (parameters replicated) and the same jitted step runs on every device.

Prints the initial and final loss on a fixed held-out batch, training tokens/s and total time.
Parameters are float32 and tokens int32 explicitly (so it also runs with ``jax_enable_x64`` on);
the model computes in ``--dtype``: bfloat16 on GPU, where the CUDA kernels take half precision,
float32 elsewhere.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dmattn.equinox
import jax_dmattn.flax

F32 = jnp.float32

# ---- data -------------------------------------------------------------------------------------


class MotifData:
    """Sequences of repeated motifs drawn from a fixed sparse Markov chain.

    Each token has 3 possible successors (probabilities 0.6, 0.3, 0.1); a motif of 4-12 tokens is
    a walk on this chain, and a sequence repeats its motif. ``batch(n)`` returns int32
    ``inputs [n, L]`` and ``targets [n, L]`` (the inputs shifted by one).
    """

    def __init__(self, vocab: int, seq_len: int, seed: int):
        chain_rng = np.random.default_rng(seed)
        self.successors = np.stack([chain_rng.permutation(vocab)[:3] for _ in range(vocab)])
        self.probs = np.array([0.6, 0.3, 0.1])
        self.vocab, self.seq_len = vocab, seq_len

    def batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        max_motif = 12
        motif = np.empty((n, max_motif), np.int32)
        motif[:, 0] = rng.integers(0, self.vocab, n)
        for i in range(1, max_motif):
            choice = rng.choice(3, size=n, p=self.probs)
            motif[:, i] = self.successors[motif[:, i - 1], choice]
        period = rng.integers(4, max_motif + 1, n)
        pos = np.arange(self.seq_len + 1)
        seqs = motif[np.arange(n)[:, None], pos[None, :] % period[:, None]]
        return seqs[:, :-1], seqs[:, 1:]

    def packed_batch(self, n: int, rng: np.random.Generator,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of several documents: int32 ``inputs [n, L]``, ``targets [n, L]`` and
        ``segment_ids [n, L]`` (0, 1, 2, ... along each row). A document of ``m`` tokens is the
        first ``m`` of a :meth:`batch` sequence and its targets, so no target crosses into the
        next document."""
        length = self.seq_len
        min_doc = min(4, length)
        max_doc = max(min_doc, length // 2)
        rows = []  # the document lengths of each row
        for _ in range(n):
            lengths: list[int] = []
            while sum(lengths) < length:
                lengths.append(min(int(rng.integers(min_doc, max_doc + 1)), length - sum(lengths)))
            rows.append(lengths)
        doc_inputs, doc_targets = self.batch(sum(map(len, rows)), rng)
        inputs, targets = np.empty((n, length), np.int32), np.empty((n, length), np.int32)
        segment_ids = np.empty((n, length), np.int32)
        doc = 0
        for row, lengths in enumerate(rows):
            start = 0
            for segment, m in enumerate(lengths):
                inputs[row, start:start + m] = doc_inputs[doc, :m]
                targets[row, start:start + m] = doc_targets[doc, :m]
                segment_ids[row, start:start + m] = segment
                start, doc = start + m, doc + 1
        return inputs, targets, segment_ids


# ---- models -----------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    """Pre-norm residual block: x + DMA(norm(x)), then x + MLP(norm(x)); ``[B, L, d]``."""

    def __init__(self, d: int, heads: int, kv_heads: int, window: int,
                 implementation: str | None, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d, param_dtype=F32, rngs=rngs)
        self.attn = jax_dmattn.flax.DynamicMaskAttention(
            d, heads, num_kv_heads=kv_heads, window=window, param_dtype=F32,
            implementation=implementation, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, param_dtype=F32, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, param_dtype=F32, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, param_dtype=F32, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), segment_ids=segment_ids)
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class NNXLM(nnx.Module):
    """Decoder-only LM: int ``tokens [B, L]`` (and optionally their ``segment_ids [B, L]``,
    packed documents) -> float32 ``logits [B, L, vocab]``."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, window: int,
                 implementation: str | None, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, param_dtype=F32, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(d, heads, kv_heads, window, implementation, rngs)
                                for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, param_dtype=F32, rngs=rngs)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids)
        return self.embed.attend(self.norm(x))  # tied output head


class EqxBlock(eqx.Module):
    """The Equinox twin of :class:`NNXBlock`, on one sequence ``[L, d]``."""

    attn_norm: eqx.nn.RMSNorm
    attn: jax_dmattn.equinox.DynamicMaskAttention
    mlp_norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, heads: int, kv_heads: int, window: int,
                 implementation: str | None, key: jax.Array):
        k_attn, k_up, k_down = jax.random.split(key, 3)
        self.attn_norm = eqx.nn.RMSNorm(d, use_bias=False, dtype=F32)
        self.attn = jax_dmattn.equinox.DynamicMaskAttention(
            d, heads, num_kv_heads=kv_heads, window=window, dtype=F32,
            implementation=implementation, key=k_attn)
        self.mlp_norm = eqx.nn.RMSNorm(d, use_bias=False, dtype=F32)
        self.up = eqx.nn.Linear(d, 4 * d, dtype=F32, key=k_up)
        self.down = eqx.nn.Linear(4 * d, d, dtype=F32, key=k_down)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(jax.vmap(self.attn_norm)(x), segment_ids=segment_ids)
        hidden = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.mlp_norm)(x)))
        return x + jax.vmap(self.down)(hidden)


class EqxLM(eqx.Module):
    """The Equinox twin of :class:`NNXLM`: int ``tokens [L]`` (and optionally ``segment_ids
    [L]``) -> ``logits [L, vocab]`` (vmap it over the batch)."""

    embed: eqx.nn.Embedding
    blocks: list[EqxBlock]
    norm: eqx.nn.RMSNorm

    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, window: int,
                 implementation: str | None, key: jax.Array):
        k_embed, *k_blocks = jax.random.split(key, layers + 1)
        # N(0, 1/d) like nnx.Embed, so that the tied head starts near ln(vocab)
        self.embed = eqx.nn.Embedding(weight=jax.random.normal(k_embed, (vocab, d), F32) / d**0.5)
        self.blocks = [EqxBlock(d, heads, kv_heads, window, implementation, k) for k in k_blocks]
        self.norm = eqx.nn.RMSNorm(d, use_bias=False, dtype=F32)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        x = self.embed.weight[tokens]
        for block in self.blocks:
            x = block(x, segment_ids)
        return jax.vmap(self.norm)(x) @ self.embed.weight.T  # tied output head


Apply = Callable[[Any, jax.Array, jax.Array | None], jax.Array]


def build_model(args: argparse.Namespace) -> tuple[Any, Apply]:
    """The model's parameters (a pytree) and ``apply(params, tokens [B, L], segment_ids [B, L]
    or None) -> logits``."""
    sizes = dict(vocab=args.vocab, d=args.width, layers=args.layers, heads=args.heads,
                 kv_heads=args.kv_heads, window=args.window, implementation=args.implementation)
    if args.framework == "nnx":
        graphdef, params = nnx.split(NNXLM(**sizes, rngs=nnx.Rngs(args.seed)))
        return params, lambda params, tokens, ids: nnx.merge(graphdef, params)(tokens, ids)
    model = EqxLM(**sizes, key=jax.random.PRNGKey(args.seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return params, lambda params, tokens, ids: jax.vmap(eqx.combine(params, static))(tokens,
                                                                                        ids)


# ---- training ---------------------------------------------------------------------------------


def data_mesh(batch: int) -> Mesh:
    """A 1-D ``"data"`` mesh over as many devices as divide the batch (one device: trivial)."""
    n = max(d for d in range(1, jax.device_count() + 1) if batch % d == 0)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("nnx", "equinox"), default="nnx")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=32, help="keys kept per query row")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--packed", action="store_true",
                        help="pack several documents of random lengths into each row and train "
                             "with their segment ids (causal within each document)")
    parser.add_argument("--implementation", choices=("cuda", "cpu", "xla"), default=None,
                        help="flash_dmattn implementation (default: the best for the platform)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="compute dtype (default: bfloat16 on GPU, where the CUDA kernels "
                             "need half precision, else float32); parameters stay float32")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Trains and reports; returns ``initial_loss``, ``final_loss`` (held-out batch),
    ``tokens_per_s``, ``seconds`` and ``devices``."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    data = MotifData(args.vocab, args.seq_len, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    mesh = data_mesh(args.batch)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    params, apply = build_model(args)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 10, max(args.steps, 11)),
                     weight_decay=0.01)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    compute_dtype = jnp.dtype(args.dtype or ("bfloat16" if jax.default_backend() == "gpu"
                                             else "float32"))

    def loss_fn(params: Any, inputs: jax.Array, targets: jax.Array,
                segment_ids: jax.Array | None = None) -> jax.Array:
        # mixed precision: float32 parameters, the model run in compute_dtype
        logits = apply(jax.tree.map(lambda p: p.astype(compute_dtype), params), inputs,
                       segment_ids)
        logits = logits.astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def train_step(params, opt_state, inputs, targets, segment_ids=None):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, segment_ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # inputs, targets (and with --packed the segment ids), [batch, seq-len] each
    make_batch = data.packed_batch if args.packed else data.batch
    eval_loss = jax.jit(loss_fn)
    held_out = jax.device_put(make_batch(args.batch, np.random.default_rng(args.seed + 2)),
                              sharded)
    initial = float(eval_loss(params, *held_out))
    print(f"{args.framework}: {args.layers} layers, width {args.width}, heads {args.heads}/"
          f"{args.kv_heads}, window {args.window}, seq-len {args.seq_len}, batch {args.batch}"
          f"{' (packed documents)' if args.packed else ''}, "
          f"{compute_dtype.name} on {mesh.size} device(s) ({jax.default_backend()}); initial "
          f"loss {initial:.4f} (ln vocab = {np.log(args.vocab):.4f})")

    t_train, loss = time.perf_counter(), jnp.nan
    for step in range(1, args.steps + 1):
        batch = jax.device_put(make_batch(args.batch, rng), sharded)
        params, opt_state, loss = train_step(params, opt_state, *batch)
        if step == 1:  # the first step compiles; tokens/s counts the steps after it
            loss.block_until_ready()
            t_steady = time.perf_counter()
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  train loss {float(loss):.4f}")
    jax.block_until_ready(params)
    t_end = time.perf_counter()
    final = float(eval_loss(params, *held_out))
    steady = args.steps - 1
    tokens_per_s = steady * args.batch * args.seq_len / (t_end - t_steady) if steady else 0.0
    seconds = time.perf_counter() - t_start
    print(f"final loss {final:.4f} (initial {initial:.4f}, {100 * (1 - final / initial):.1f} % "
          f"lower); {tokens_per_s:,.0f} tokens/s; training {t_end - t_train:.1f} s, "
          f"total {seconds:.1f} s")
    return {"initial_loss": initial, "final_loss": final, "tokens_per_s": tokens_per_s,
            "seconds": seconds, "devices": mesh.size}


if __name__ == "__main__":
    main()
