# syntax=docker/dockerfile:1
#
# The gemq worker service: `gemq worker --follow`, with a CPU-only build of torch.
# Build from the repository root (docker/README.md):
#   docker build -f docker/worker.Dockerfile -t gemq-worker:0.1.0 .
# CUDA: the same file with a CUDA build of torch, see docker/README.md.

# Pinned by tag. Pinning by digest (python:3.12.8-slim-bookworm@sha256:...) is better still;
# the digest could not be resolved where this file was written (no registry access), so
# add it when you mirror the image.
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# ---- build: a virtual environment with torch, gemq and its dependencies ----------------
FROM ${PYTHON_IMAGE} AS build
# The torch release constraints.txt pins, from PyTorch's index of CPU-only wheels: PyPI's
# Linux wheel depends on several GB of CUDA libraries a CPU worker never loads.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gemq ./gemq
COPY services ./services
# gemq itself, the bundled datasets and the rest of its dependencies (the torch above
# satisfies pyproject.toml's range, so pip keeps it).
RUN pip install "./[datasets]" \
 && python -c "import torch, gemq.training.worker, gemq.services.worker; print('torch', torch.__version__)"

# ---- runtime: the environment only, as an unprivileged user ----------------------------
FROM ${PYTHON_IMAGE}
# uid/gid 10001, the runAsUser of k8s/base; numeric USER lets runAsNonRoot verify it.
RUN groupadd --system --gid 10001 gemq \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
            --shell /usr/sbin/nologin gemq
COPY --from=build /opt/venv /opt/venv
# Settings are GEMQ_* variables given at run time (k8s/base/config/worker.env); nothing
# gemq reads is baked in here. /tmp is the one writable place (an emptyDir on Kubernetes,
# which also mounts the root filesystem read-only).
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib NUMBA_CACHE_DIR=/tmp/numba
WORKDIR /tmp
USER 10001:10001
# SIGTERM: finish (publish) or abandon the current gradient, then exit 0.
STOPSIGNAL SIGTERM
# The service touches GEMQ_HEARTBEAT_FILE (default /tmp/gemq-heartbeat) every 5 s.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-m", "gemq.services.probe", "--max-age", "30"]
ENTRYPOINT ["gemq"]
CMD ["worker", "--follow"]
