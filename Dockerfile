# EaaS runtime + operator image. One image for every role: the pod's command line names it
# (`eaas expert-server ...`, `eaas attention-client ...`, `eaas operator`).
# GPU nodes: build FROM an nvidia/cuda runtime base instead; torch's CUDA wheels bring the libs.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/eaas
COPY pyproject.toml README.md ./
COPY eaas ./eaas
COPY runtime ./runtime
COPY operator ./operator
# the testbed (test infrastructure) is its own package, eaas.testbed, apart from the operator
COPY testbed ./testbed
RUN pip install .

# Model checkpoints are mounted (hostPath / PVC) or baked into a derived image; none here.
ENTRYPOINT ["eaas"]
CMD ["--help"]
