"""Dynamic Mask Attention layers for Flax (``layers.flax``) and Equinox (``layers.equinox``),
built on their shared pieces (``layers.common``). Each needs its framework installed, so this
package imports neither."""
