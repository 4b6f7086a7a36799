"""Plumbing every part shares: NATS streams and connections, Redis clients, Lua loading, time
formats. It imports only `schemas`; producers, consumers and router import it (README.md)."""
