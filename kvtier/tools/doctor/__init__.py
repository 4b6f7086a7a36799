"""`kvtier doctor`: check a running deployment and say in plain words what is wrong and how to
fix it (the troubleshooting table of the Dynamo tier-aware routing guide, made executable).

Three layers, one module each, passing the plain values of `views.py`:
- observe (`observe.py`, I/O at the edge): `observe()` reads NATS, Redis, each router's
  /healthz and /metrics and the Mooncake master into plain views (`NatsView`, `RedisView`
  with a `WorkerRecord` per worker, `RouterView`, `MooncakeView`), each probe bounded by a
  timeout; a probe that fails is recorded, not raised.
- judge (`judge.py`, pure): one small function per check turns views into `Finding`s
  (status ok / warn / fail, a one-line finding, a fix). `diagnose()` runs them all; nothing
  there does I/O.
- report (`report.py`, with `run_doctor`): a compact table, then the problems with their
  fixes; `--json` adds one JSON object as the last line. Exit 0 when nothing failed (a
  warning fails only with --strict), else 1.
"""
