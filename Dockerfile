# syntax=docker/dockerfile:1
# headbudget inference API, CPU only.
#
#   docker build -t headbudget .                                            # model mounted at run time:
#   docker run -p 127.0.0.1:8000:8000 -v "$PWD/checkpoints/ag_news-quick:/models/current" headbudget
#   docker build --build-arg MODEL_DIR=checkpoints/ag_news-quick -t headbudget:quick .   # model baked in
#
# MODEL_DIR is a path inside the build context (.dockerignore lets checkpoints/ through, ONNX caches excepted).
# Configuration: /etc/headbudget/service.toml (docker/service.toml: tiers, no keys); mount your own over it.
# WORKERS: uvicorn worker processes, one engine thread each; more than one needs [state] redis_url.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with CPU torch and the project; compilers stay in this stage -------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# Versions and hashes from the project's lock (requirements/main.txt, the file `make install` and CI install): the
# base (client) dependencies and the `serve` and `torch` extras, which are what `headbudget serve` imports for every
# checkpoint type (torch: `--backend torch` and the adaptive types); training, plots and tests stay out. The lock
# is uv's constraints file, so each package is the locked version and its download must match a locked hash. torch
# is the CPU wheel, downloaded from the CPU-only index under the lock's version (its hash is locked too); nothing
# pulls the multi-GB CUDA build. In their own layer, so code changes do not reinstall them.
COPY pyproject.toml /src/pyproject.toml
COPY requirements/main.txt /src/requirements/main.txt
RUN pip install "$(grep -o '^uv==[^ ]*' /src/requirements/main.txt)" \
    && pip download --no-deps -d /tmp/wheels "$(grep -o '^torch==[^ ]*' /src/requirements/main.txt)" \
        --index-url https://download.pytorch.org/whl/cpu \
    && python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['serve'] + p['optional-dependencies']['torch']))" \
        > /tmp/requirements.txt \
    && uv pip install --no-cache --python /opt/venv/bin/python -r /tmp/requirements.txt \
        -c /src/requirements/main.txt --verify-hashes --find-links /tmp/wheels \
    && pip uninstall -y uv && rm -rf /tmp/wheels

COPY README.md LICENSE /src/
COPY headbudget /src/headbudget
RUN pip install --no-deps /src && headbudget --help > /dev/null

# ---- runtime: the virtual environment, a non-root user, the config and (optionally) a baked model ---------
# Everything the process writes goes to /tmp (metrics of the workers, caches, the ONNX graph cache when the
# model folder is read-only), so the root filesystem can be mounted read-only.
FROM ${PYTHON_IMAGE} AS runtime
ARG MODEL_DIR=docker/no-model
LABEL org.opencontainers.image.title="headbudget" \
      org.opencontainers.image.description="Budget-conditioned attention: one checkpoint, every compute budget, over HTTP."
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    OMP_NUM_THREADS=1 \
    MKL_NUM_THREADS=1 \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/cache \
    WORKERS=1
RUN groupadd --system --gid 10001 headbudget \
    && useradd --system --uid 10001 --gid headbudget --create-home --home-dir /home/headbudget \
        --shell /usr/sbin/nologin headbudget
COPY --from=build /opt/venv /opt/venv
COPY docker/service.toml /etc/headbudget/service.toml
# Owned by the service user: the engine writes its ONNX graph cache next to the checkpoint on first start.
COPY --chown=10001:10001 ${MODEL_DIR}/ /models/current/

USER 10001:10001
WORKDIR /home/headbudget
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
STOPSIGNAL SIGTERM
# `exec` replaces the shell, so the server is PID 1 and gets SIGTERM itself: in-flight requests finish.
# Extra arguments to `docker run IMAGE ...` are appended to `headbudget serve`.
ENTRYPOINT ["/bin/sh", "-c", "exec headbudget serve --model /models/current --config /etc/headbudget/service.toml --host 0.0.0.0 --port 8000 --workers \"${WORKERS}\" \"$@\"", "headbudget-serve"]
