"""Real servers for tests, demos and local runs: embedded nats-server and Redis-protocol
servers, a real Mooncake master. Never needed in production (README.md)."""
