# pop-vlm for GPU hosts: the web app and the OpenAI-style API on one port.
#   docker build -t pop-vlm .                          (SDPA attention)
#   docker build --build-arg FLASH_ATTN=1 -t pop-vlm . (flash-attention-2; needs the CUDA devel base)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ARG FLASH_ATTN=0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/data/hf \
    XDG_CACHE_HOME=/data/cache \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/pop-vlm
COPY pyproject.toml README.md ./
COPY pop_vlm ./pop_vlm
COPY app ./app
COPY assets ./assets

RUN pip install --index-url "${TORCH_INDEX}" "torch==2.9.1" \
    && pip install -e . \
    && if [ "${FLASH_ATTN}" = "1" ]; then pip install "flash-attn>=2.6" --no-build-isolation; fi

RUN useradd --create-home --uid 1000 pop \
    && mkdir -p /data \
    && chown -R pop:pop /data
USER 1000
VOLUME ["/data"]
EXPOSE 7860

# Loading a multi-GB model from a cold cache takes minutes: a long start period before health counts.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:7860/healthz"]

ENTRYPOINT ["pop-vlm", "serve", "--host", "0.0.0.0", "--port", "7860"]
CMD ["--model", "Qwen/Qwen3-VL-2B-Instruct"]
