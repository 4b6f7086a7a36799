"""`kvtier bench ...`: benchmarks. Figures and the exact commands live in BENCHMARKS.md."""
