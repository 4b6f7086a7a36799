"""Harnesses for tests, demos and local runs: embedded nats-server and Redis-protocol servers,
a real Mooncake master, `kvtier demo`. Never needed in production (README.md)."""
