# EaaS images. One `eaas` CLI for every role; the pod's command line names the role
# (`eaas expert-server ...`, `eaas attention-client ...`, `eaas operator`).
#
# Targets:
#   operator   kopf + kubernetes + pydantic + prometheus-client, no torch (small):
#                docker build --target operator -t eaas-operator .
#   runtime    expert servers and attention clients (the default target).
#              CPU nodes (torch from the CPU wheel index, no CUDA libraries):
#                docker build -t eaas-runtime:cpu .
#              GPU nodes (CUDA runtime base; torch's CUDA wheels):
#                docker build -t eaas-runtime:cu124 \
#                  --build-arg RUNTIME_BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#                  --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
#
# Layers: dependencies (from pyproject.toml alone) before the source, so editing code does not
# re-download torch. Model checkpoints are mounted (hostPath / PVC) or baked into a derived
# image; none here. Bases are pinned to a patch release; pin by digest for release builds.

ARG PYTHON_BASE=python:3.11.11-slim-bookworm
ARG RUNTIME_BASE=python:3.11.11-slim-bookworm

# Prints the requirements of the given extras (plus the base dependencies) from pyproject.toml.
ARG REQS_PY="import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *[r for e in sys.argv[1:] for r in p['optional-dependencies'][e]], sep=chr(10))"

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_BASE} AS operator
ARG REQS_PY
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent eaas \
 && python -m venv /opt/venv
# The source is built in /build and removed after the install: run from a folder holding
# `operator/`, `python -c`/`-m` would import it instead of the standard library's `operator`.
WORKDIR /build
# dependency layer
COPY pyproject.toml ./
RUN python -c "$REQS_PY" operator > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
# source layer
COPY README.md ./
COPY eaas ./eaas
COPY runtime ./runtime
COPY operator ./operator
COPY native ./native
# the testbed (test infrastructure, eaas.testbed) is part of the package's file list
COPY testbed ./testbed
RUN pip install --no-deps /build \
 && cd / && rm -rf /build \
 && python -c "import sys, eaas.operator.handlers; assert 'torch' not in sys.modules"
WORKDIR /
USER 10001:10001
ENTRYPOINT ["eaas"]
CMD ["operator"]

# ---------------------------------------------------------------------------------------------
FROM ${RUNTIME_BASE} AS runtime
ARG REQS_PY
# CPU wheels by default: no CUDA libraries in the CPU image. GPU: the matching CUDA index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    EAAS_CACHE_DIR=/var/cache/eaas
# The nvidia/cuda bases have no Python 3.10+ with venv: install it there (a no-op on python:*).
RUN if ! python3 -c "import sys, venv; assert sys.version_info >= (3, 10)" 2>/dev/null; then \
        apt-get update \
     && apt-get install -y --no-install-recommends python3 python3-venv \
     && rm -rf /var/lib/apt/lists/*; \
    fi \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent eaas \
 && python3 -m venv /opt/venv \
 && mkdir -p /var/cache/eaas && chown 10001:10001 /var/cache/eaas
WORKDIR /build
# dependency layers: torch alone from its index (CPU or CUDA build), then the rest from PyPI
COPY pyproject.toml ./
RUN python -c "$REQS_PY" runtime > /tmp/requirements.txt \
 && pip install --index-url "$TORCH_INDEX" "$(grep '^torch' /tmp/requirements.txt)" \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
# source layer
COPY README.md ./
COPY eaas ./eaas
COPY runtime ./runtime
COPY operator ./operator
COPY native ./native
COPY testbed ./testbed
RUN pip install --no-deps /build \
 && cd / && rm -rf /build \
 && eaas --version
WORKDIR /
USER 10001:10001
ENTRYPOINT ["eaas"]
CMD ["--help"]
