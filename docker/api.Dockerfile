# syntax=docker/dockerfile:1
#
# The gemq API and dashboard: `gemq serve`, FastAPI + uvicorn on port 8000, serving web/.
# It needs torch too: creating a run initialises the model's parameters, and
# GET /api/runs/{id}/model returns a torch state_dict.
# Build from the repository root (docker/README.md):
#   docker build -f docker/api.Dockerfile -t gemq-api:0.1.0 .

# Pinned by tag; add the digest when you mirror it (see worker.Dockerfile).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# ---- build: torch (CPU), then gemq with the bundled datasets ---------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# Every other dependency (the bundled datasets' packages included) at the releases
# docker/constraints.txt pins: a layer rebuilt only when that file changes.
COPY docker/constraints.txt /tmp/constraints.txt
RUN pip install --requirement /tmp/constraints.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gemq ./gemq
COPY services ./services
COPY web ./web
# The dashboard (web/) is package data of gemq (gemq.web); the check fails the build if the
# installed package lacks it (`python -P`: the installed package, not the source tree here).
RUN pip install --constraint /tmp/constraints.txt "./[datasets]" \
 && pip check \
 && python -P -c "from gemq.services.api.app import WEB_DIR as w; assert (w / 'index.html').is_file(), w"

# ---- runtime: the environment only, as an unprivileged user -----------------------------
FROM ${PYTHON_IMAGE}
# uid/gid 10001, the runAsUser of k8s/base; numeric USER lets runAsNonRoot verify it.
RUN groupadd --system --gid 10001 gemq \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
            --shell /usr/sbin/nologin gemq
COPY --from=build /opt/venv /opt/venv
# Settings are GEMQ_* variables given at run time (k8s/base/config/api.env): without
# GEMQ_API_TOKEN the API listens on 127.0.0.1 only, so `docker run` needs
# -e GEMQ_API_TOKEN=... -e GEMQ_HOST=0.0.0.0 to be reachable (docker/README.md).
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib NUMBA_CACHE_DIR=/tmp/numba
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
STOPSIGNAL SIGTERM
# Liveness: /healthz answers while the process serves (readiness, /readyz, also needs
# Redis; Kubernetes uses both, see k8s/base/api.yaml).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:' + os.environ.get('GEMQ_PORT', '8000') + '/healthz', timeout=3)"]
ENTRYPOINT ["gemq"]
CMD ["serve"]
