# syntax=docker/dockerfile:1
#
# The gemq aggregator service: `gemq aggregator --serve`, an rq worker on the queue
# gemq-aggregator. numpy only: no torch, so the image stays small.
# Build from the repository root (docker/README.md):
#   docker build -f docker/aggregator.Dockerfile -t gemq-aggregator:0.1.0 .

# Pinned by tag; add the digest when you mirror it (see worker.Dockerfile).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# ---- build: a virtual environment with gemq and the aggregator's requirements ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# The service's requirements at the releases docker/constraints.txt pins: a layer that is
# rebuilt only when one of the two files changes.
COPY docker/aggregator-requirements.txt docker/constraints.txt /tmp/
RUN python -m venv /opt/venv \
 && pip install --constraint /tmp/constraints.txt --requirement /tmp/aggregator-requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gemq ./gemq
COPY services ./services
COPY web ./web
# --no-deps: pyproject.toml's dependencies include torch, which the aggregator never
# imports. Then fail the build if torch got in anyway, or if the service no longer imports
# without it. `python -P`: the checks import the installed package, not the source tree in
# the working directory (which lacks gemq.services and gemq.web).
RUN pip install --no-deps . \
 && python -P -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch'" \
 && python -P -c "import gemq.services.aggregator, gemq.services.telemetry, gemq.cli"

# ---- runtime: the environment only, as an unprivileged user ----------------------------
FROM ${PYTHON_IMAGE}
# uid/gid 10001, the runAsUser of k8s/base; numeric USER lets runAsNonRoot verify it.
RUN groupadd --system --gid 10001 gemq \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
            --shell /usr/sbin/nologin gemq
COPY --from=build /opt/venv /opt/venv
# Settings are GEMQ_* variables given at run time (k8s/base/config/aggregator.env).
# numba caches the compiled update loop here: /opt/venv is read-only at run time.
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/tmp/numba
WORKDIR /tmp
USER 10001:10001
# SIGTERM: rq's warm shutdown (an idle service exits at once; see k8s/base/aggregator.yaml).
STOPSIGNAL SIGTERM
# The service touches GEMQ_HEARTBEAT_FILE (default /tmp/gemq-heartbeat) every 5 s.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-m", "gemq.services.probe", "--max-age", "30"]
ENTRYPOINT ["gemq"]
CMD ["aggregator", "--serve"]
