# pop-vlm for GPU hosts: the web app and the OpenAI-style API on one port.
#   docker build -t pop-vlm .                          (SDPA attention)
#   docker build --build-arg FLASH_ATTN=1 -t pop-vlm . (flash-attention-2, compiled in a CUDA devel stage)
# Every pip install goes through constraints.txt (PIP_CONSTRAINT), the versions CI tests. torch 2.13.0's Linux wheel
# on PyPI is its CUDA 13.0 build, hence CUDA 13.0 bases; the runtime needs an NVIDIA driver >= 580.
ARG CUDA_IMAGE_VERSION=13.0.2
ARG FLASH_ATTN=0

# ---- base: Python, the pinned torch and the project's dependencies -----------------------------------------------
FROM nvidia/cuda:${CUDA_IMAGE_VERSION}-cudnn-runtime-ubuntu24.04 AS base

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_CONSTRAINT=/opt/pop-vlm/constraints.txt \
    HF_HOME=/data/hf \
    XDG_CACHE_HOME=/data/cache \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/pop-vlm
COPY constraints.txt ./
RUN pip install --constraint constraints.txt torch

# ---- flash-attn: compiled against that torch with the CUDA compiler of the matching devel image -------------------
FROM nvidia/cuda:${CUDA_IMAGE_VERSION}-cudnn-devel-ubuntu24.04 AS flash-attn-build

# GPU architectures to compile for (8.0 A100, 9.0 H100/H200; add 10.0 / 12.0 for Blackwell); MAX_JOBS bounds the
# compiler's memory (each job can take several GB)
ARG FLASH_ATTN_CUDA_ARCHS=80;90
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_CONSTRAINT=/opt/pop-vlm/constraints.txt \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} \
    MAX_JOBS=${MAX_JOBS} \
    FLASH_ATTENTION_FORCE_BUILD=TRUE

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=base /opt/venv /opt/venv
WORKDIR /opt/pop-vlm
COPY --from=base /opt/pop-vlm/constraints.txt ./
RUN pip install --constraint constraints.txt ninja packaging psutil wheel setuptools \
    && pip wheel --constraint constraints.txt --no-build-isolation --no-deps --wheel-dir /wheels flash-attn

# ---- the wheels the final stage installs: none, or flash-attn (chosen by FLASH_ATTN; BuildKit builds only that one)
FROM base AS flash-attn-0
RUN mkdir -p /wheels

FROM flash-attn-build AS flash-attn-1

# a stage of this file, not an image (hadolint reads it as an untagged image)
# hadolint ignore=DL3006
FROM flash-attn-${FLASH_ATTN} AS flash-attn

# ---- the image -------------------------------------------------------------------------------------------------
FROM base

COPY pyproject.toml README.md ./
COPY pop_vlm ./pop_vlm
COPY app ./app
COPY assets ./assets
COPY --from=flash-attn /wheels /tmp/wheels

RUN pip install --constraint constraints.txt -e . \
    && if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install --constraint constraints.txt /tmp/wheels/*.whl; fi \
    && rm -rf /tmp/wheels

RUN useradd --create-home --uid 1000 pop \
    && mkdir -p /data \
    && chown -R pop:pop /data
USER 1000
VOLUME ["/data"]
EXPOSE 7860

# Loading a multi-GB model from a cold cache takes minutes: a long start period before health counts.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:7860/healthz"]

# The served models and the API key come from the environment (POP_VLM_MODELS, POP_VLM_API_KEY; see
# docker-compose.yml), or from arguments after the image name, which replace this CMD: `--model M --api-key K`.
# Without a key the server warns at start, since it listens on all interfaces.
ENV POP_VLM_MODELS=Qwen/Qwen3-VL-2B-Instruct
ENTRYPOINT ["pop-vlm", "serve", "--host", "0.0.0.0", "--port", "7860"]
CMD ["--log-level", "info"]
