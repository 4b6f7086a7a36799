# syntax=docker/dockerfile:1
#
# kvtier: one image for every long-running command (bridge, processor, router, sim-worker, ...).
#
#   docker build -t kvtier .
#   docker run --rm kvtier router --help
#   docker run --rm -p 8000:8000 kvtier router --redis redis://redis:6379/0 --http-port 8000
#
# The Mooncake master runs from its own image (deploy/mooncake.Dockerfile); SGLang from
# lmsysorg/sglang. docker-compose.yml wires them all together.
#
# Bookworm, not the floating python:3.11-slim (trixie today): the Debian package names of
# deploy/mooncake.Dockerfile (libcurl4, libibverbs1) are bookworm's, and both images share
# one base.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: install kvtier and its dependencies into a venv, from the source tree ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvtier
WORKDIR /src
# Only what the wheel is built from (pyproject's package-dir map, its readme and package
# data); tests/house/test_compose.py checks that this list matches pyproject.toml.
COPY pyproject.toml README.md ./
COPY kvtier/ kvtier/
COPY schemas/ schemas/
COPY producers/ producers/
COPY consumers/ consumers/
COPY router/ router/
# A regular (not editable) install: the venv no longer needs /src afterwards. The imports run
# from / (not /src, which would shadow the installed package) and fail the build when a module or
# a package-data file did not make it into the wheel, e.g. a subpackage missing from
# pyproject's `packages` list (kvtier.commands.errors imports kvtier.bench, kvtier.harness and kvtier.plumbing).
RUN /opt/kvtier/bin/pip install . \
 && cd / \
 && /opt/kvtier/bin/python -c "import importlib.resources as r, kvtier.cli, kvtier.eval.demo, kvtier.commands.errors, kvtier.tools.doctor.report, kvtier.producers.bridge, kvtier.sim.sim_worker, kvtier.consumers.processor, kvtier.router.service; assert r.files('kvtier.consumers').joinpath('apply.lua').is_file() and r.files('kvtier.router').joinpath('select_and_book.lua').is_file()" \
 && /opt/kvtier/bin/kvtier --help > /dev/null

# --- runtime ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtier" \
      org.opencontainers.image.description="Tier-aware KV-cache router for SGLang HiCache clusters" \
      org.opencontainers.image.licenses="Apache-2.0"
# Inside a container a listener on 127.0.0.1 is unreachable from other containers, so the
# image defaults every bind address to all interfaces (router --host, sim-worker --host,
# --metrics-host). A flag, or the same variable in `docker run -e` / compose, still wins.
ENV PATH=/opt/kvtier/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVTIER_HOST=0.0.0.0 \
    KVTIER_METRICS_HOST=0.0.0.0
COPY --from=build /opt/kvtier /opt/kvtier
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --create-home --home-dir /home/kvtier --shell /usr/sbin/nologin kvtier
USER kvtier
WORKDIR /home/kvtier

# No HEALTHCHECK here: one image runs several commands and none of them has a probe that fits
# all. The router serves GET /healthz on its --http-port and the sim-worker on its own
# --http-port; a processor or a bridge has no HTTP server at all unless --metrics-port is set,
# and every port is chosen per deployment. docker-compose.yml gives each service the probe
# that fits its command and ports.

# Every long-running command exits cleanly on SIGTERM (docker stop).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvtier"]
CMD ["--help"]
