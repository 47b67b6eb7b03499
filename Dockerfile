# r4t: multi-stage image. The builder builds the default bundle as `make serve` does: the
# catalog stages from apt's wordnet-base, stages 1-3 adopted from models/shipped/default (no
# torch; a recipe that no longer matches them fails the build: rebuild and ship them first,
# README); the runtime holds only the service (no training/: `r4t` is service.command, which
# imports training only for the subcommands that build), its dependencies, the bundle and a
# non-root user.
#   docker build -t r4t .                          # CPU runtime
#   docker build -t r4t:gpu --build-arg RUNTIME=gpu \
#     --build-arg RUNTIME_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 .  # onnxruntime-gpu
ARG RUNTIME=cpu
ARG RUNTIME_IMAGE=python:3.11-slim-bookworm

FROM python:3.11-slim-bookworm AS builder
# libgomp1: OpenMP, which lightgbm's wheel (the ranker) links and the slim image lacks
RUN apt-get update && apt-get install -y --no-install-recommends wordnet-base git libgomp1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md deploy/serve.lock ./
COPY service service
COPY training training
COPY models/shipped models/shipped
RUN python -m venv /opt/train \
    && /opt/train/bin/pip install --no-cache-dir -c serve.lock -e .
RUN /opt/train/bin/r4t --bundle /bundle/default bundle

# One runtime stage on a base chosen by RUNTIME_IMAGE (a stage named by an ARG is a BuildKit
# feature buildah/podman lack): python's slim image, or CUDA's, which lacks python.
FROM ${RUNTIME_IMAGE} AS runtime
ARG RUNTIME
# libgomp1: OpenMP, which lightgbm's wheel (the ranked route) links and the slim image lacks
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
       $(if [ "$RUNTIME" = gpu ]; then echo python3 python3-venv; fi) \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md deploy/serve.lock ./
COPY service service
# pinned as the tests ran (deploy/serve.lock, `make lock`); onnxruntime-gpu replaces the CPU
# wheel (both install the `onnxruntime` module)
RUN pip install --no-cache-dir -c serve.lock '.[milvus]' \
    && if [ "$RUNTIME" = gpu ]; then pip uninstall -y onnxruntime \
       && pip install --no-cache-dir onnxruntime-gpu; fi \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin r4t
# root owns the bundle (files 644, folders 755): read-only to the service's user
COPY --from=builder /bundle/default /app/models/default
USER 10001
ENV R4T_HOST=0.0.0.0 R4T_PORT=8000 R4T_BUNDLE=/app/models/default
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz').status != 200)"
ENTRYPOINT ["r4t", "serve"]
