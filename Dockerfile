#
# Two images from one file (compose names the target):
#   --target slim    producer, beat, Flower, the bucket job and the dry-run worker
#   --target worker  GPU worker: genfleet on a pinned SGLang image (compose service `worker`)
#
# No `# syntax=` line: it makes BuildKit fetch a frontend image, and offline builds fail.
# `slim` comes first: the classic builder (DOCKER_BUILDKIT=0) builds every stage up to the
# target, so with `worker` first it would fetch the multi-GB SGLang image for `--target slim`.
#
# SGLANG_IMAGE_TAG pins the engine. v0.5.19-cu129 is the last CUDA 12 tag; newer tags are
# built for CUDA 13 and need a driver that supports it (R580 or newer).

ARG SGLANG_IMAGE_TAG=v0.5.19-cu129
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/genfleet
# Dependencies first, in a layer of their own, so a change to genfleet's code rebuilds in
# seconds. worker: the emulator's HTTP server and NVML for the dry-run worker and beat;
# formats: Parquet in and out; flower: the dashboard.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; \
wanted = p['dependencies'] + extras['worker'] + extras['formats'] + extras['flower']; \
print('\n'.join(wanted))" > /tmp/requirements.txt \
 && python3 -m pip install -r /tmp/requirements.txt
COPY README.md ./
COPY common ./common
COPY producer ./producer
COPY workers ./workers
COPY genfleet ./genfleet
RUN python3 -m pip install ".[worker,formats,flower]" --no-deps \
 && genfleet --help >/dev/null \
 && useradd --create-home --uid 1000 --user-group genfleet \
 && mkdir -p /data \
 && chown genfleet:genfleet /data
USER genfleet
WORKDIR /data
ENTRYPOINT ["genfleet"]
CMD ["--help"]

FROM lmsysorg/sglang:${SGLANG_IMAGE_TAG} AS worker
# SGLang, torch and CUDA come with the base image; pip keeps what already satisfies
# genfleet's requirements. The worker stays root: the image's kernel and JIT caches live
# under /root and SGLang needs memlock and IPC settings that compose grants to the container.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /opt/genfleet
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY workers ./workers
COPY genfleet ./genfleet
RUN python3 -m pip install ".[worker,formats]" \
 && python3 -c "import genfleet.workers.app, genfleet.cli" \
 && genfleet --help >/dev/null
ENTRYPOINT ["genfleet"]
CMD ["worker"]
