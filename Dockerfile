# r4t: multi-stage image. The builder builds the default bundle as `make serve` does: the
# catalog stages from apt's wordnet-base, stages 1-3 adopted from models/shipped/default (no
# torch; a recipe that no longer matches them fails the build: rebuild and ship them first,
# README); the runtime holds only the service (no training/: `r4t` is service.command, which
# imports training only for the subcommands that build), its dependencies, the bundle and a
# non-root user.
#   docker build -t r4t .                          # CPU runtime
#   docker build -t r4t:gpu --build-arg RUNTIME=gpu .   # onnxruntime-gpu on a CUDA base image
ARG RUNTIME=cpu

FROM python:3.11-slim-bookworm AS builder
# libgomp1: OpenMP, which lightgbm's wheel (the ranker) links and the slim image lacks
RUN apt-get update && apt-get install -y --no-install-recommends wordnet-base git libgomp1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY service service
COPY training training
COPY models/shipped models/shipped
RUN python -m venv /opt/train \
    && /opt/train/bin/pip install --no-cache-dir -c constraints.txt -e .
RUN /opt/train/bin/r4t --bundle /bundle/default bundle

FROM python:3.11-slim-bookworm AS runtime-cpu
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* && python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS runtime-gpu
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

FROM runtime-${RUNTIME} AS runtime
ARG RUNTIME
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service service
# onnxruntime-gpu replaces the CPU wheel (both install the `onnxruntime` module).
RUN pip install --no-cache-dir '.[milvus]' \
    && if [ "$RUNTIME" = gpu ]; then pip uninstall -y onnxruntime \
       && pip install --no-cache-dir onnxruntime-gpu; fi \
    && useradd --uid 10001 --create-home r4t
COPY --from=builder --chown=r4t /bundle/default /app/models/default
USER r4t
ENV R4T_HOST=0.0.0.0 R4T_PORT=8000 R4T_BUNDLE=/app/models/default
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz').status != 200)"
ENTRYPOINT ["r4t", "serve"]
