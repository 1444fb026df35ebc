# gpt serve in a container: a slim Debian base, the CPU torch wheel, a non-root user.
#
#     docker build -t gpt .
#     docker run -d -p 8000:8000 -v "$PWD/out/shakespeare-char:/model:ro" -e GPT_SERVE_API_KEY=KEY gpt
#     docker build -t gpt-mine --build-arg MODEL=models/my-run .      # bake a run in (copied to models/my-run)
#
# docker/build.sh builds it on a machine that cannot pull the base image or reach the PyTorch index (a
# Debian base made by docker/base.sh, this machine's own wheels served to the build). docs/serving.md
# has the CUDA variant (BASE, TORCH_SPEC and TORCH_INDEX_URL) and how to scale it.
#
# Only the classic builder's syntax (no RUN --mount, no heredocs), so that `DOCKER_BUILDKIT=0` builds it too.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# Where pip finds things. INDEX_URL: the package index; TORCH_INDEX_URL: an extra index for torch alone (the
# CPU wheels by default; empty: none); FIND_LINKS: more places with wheels (space-separated URLs); CERT_URL: a
# CA bundle pip trusts during the build (behind a TLS proxy; empty: the base image's own CAs).
ARG INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG FIND_LINKS=
ARG CERT_URL=
# A run directory inside the build context baked in at /model; the default holds only a README (mount one).
ARG MODEL=docker/no-model

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, alone: the largest layer, rebuilt only when these arguments change.
COPY docker/pip-install.sh /usr/local/bin/pip-install
RUN python3 -m venv /opt/venv \
 && pip-install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

# The package's dependencies (read from pyproject.toml) before its code, so that a code change reinstalls no
# dependency. torch is there already, and torch>=2.1 keeps it.
COPY pyproject.toml /src/
RUN python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print('\\n'.join(p['dependencies'] + p['optional-dependencies']['serve']))" > /tmp/requirements.txt \
 && pip-install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# What the image is (its user, entrypoint, port, health check) before its code: these steps are cached, and
# a change to gpt/ (or README.md) rebuilds only the steps after them.
RUN useradd --create-home --uid 10001 gpt
COPY docker/entrypoint.sh /usr/local/bin/gpt-entrypoint
WORKDIR /home/gpt
ENV GPT_MODEL=/model GPT_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ['GPT_PORT'] + '/health', timeout=4)"
ENTRYPOINT ["gpt-entrypoint"]

COPY README.md /src/
COPY gpt /src/gpt
RUN pip-install --no-deps /src && rm -rf /src
COPY --chown=10001:10001 ${MODEL} /model
USER gpt
