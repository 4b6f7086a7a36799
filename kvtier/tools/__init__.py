"""Operator tools: `kvtier inspect`, `doctor`, `replay`, `replay explain`, `events tail`,
`report`, `probe hicache`. They read a running deployment; none of the services imports them
(README.md)."""
