"""kvtier: tier-aware KV-cache routing for SGLang HiCache clusters."""

__version__ = "0.1.0"
