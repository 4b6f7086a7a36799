"""Simulated SGLang HiCache engines for the demo, the replays, the benches and the tests (README.md)."""
