# syntax=docker/dockerfile:1
#
# Mooncake master (the shared L3 pool's control plane) from PyPI, for docker-compose.yml:
#
#   docker build -f deploy/mooncake.Dockerfile -t kvtier-mooncake deploy
#
# The wheel ships `mooncake_master` (a Python launcher that execs the binary inside the
# package). It exists for linux/x86_64 only, and its binary links Debian's RDMA verbs library
# even when the transport is TCP, plus libcurl and libnuma, none of which python:*-slim has.
# Keep MOONCAKE_VERSION equal to the mooncake-transfer-engine inside your SGLang image: the
# master's RPC is not guaranteed to be compatible across versions (kvtier's tests pin
# 0.3.13.post1, whose flags and /batch_query_keys reply are the ones used here).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG MOONCAKE_VERSION=0.3.13.post1
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libcurl4 libnuma1 \
 && rm -rf /var/lib/apt/lists/*
# `--version` as root at build time: fails the build if a shared library is missing, and the
# launcher sets the binary's exec bit if the wheel lost it (it could not as the runtime user).
RUN pip install --no-cache-dir --disable-pip-version-check "mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}" \
 && mooncake_master --version
RUN groupadd --system --gid 10002 mooncake \
 && useradd --system --uid 10002 --gid mooncake --create-home --home-dir /home/mooncake --shell /usr/sbin/nologin mooncake
USER mooncake
WORKDIR /home/mooncake

# 50051: RPC (clients: SGLang's HiCache Mooncake backend, kvtier sim-worker --mooncake-rpc)
# 9003:  HTTP admin/metrics: /metrics and /batch_query_keys (kvtier router --mooncake-master)
# 8080:  HTTP metadata server (clients' MOONCAKE_TE_META_DATA_SERVER=http://HOST:8080/metadata)
EXPOSE 50051 9003 8080
# The probe is left to the deployment (docker-compose.yml), which knows the admin port.
ENTRYPOINT ["mooncake_master"]
CMD ["--rpc_address=0.0.0.0", "--rpc_port=50051", \
     "--metrics_host=0.0.0.0", "--metrics_port=9003", \
     "--enable_http_metadata_server=true", \
     "--http_metadata_server_host=0.0.0.0", "--http_metadata_server_port=8080"]
