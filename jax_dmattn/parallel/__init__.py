"""Attention over sharded inputs: the kernel calls' partitioning rules (``sharding``) and ring
attention over a sharded sequence (``context_parallel``)."""
