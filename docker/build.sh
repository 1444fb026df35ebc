#!/usr/bin/env bash
# Build the serving image on this machine, with what it can reach:
#
#     docker/build.sh                                   # -> image `gpt`
#     docker/build.sh gpt-mine --build-arg MODEL=models/my-run
#
# The base: $GPT_DOCKER_BASE if set, else python:3.11-slim-bookworm when it is here or can be pulled, else
# the Debian base that docker/base.sh makes from Debian's packages (gpt-base:bookworm). Pip's index: pip's own
# (PIP_INDEX_URL or pip config's index-url, when it is http(s)); directories of wheels that pip is told to
# find links in (PIP_FIND_LINKS, pip config's find-links: a local CPU torch wheel) are served to the build on
# 127.0.0.1 for as long as it runs (on the same ports each time where they are free, so that the layers'
# cache holds), and a torch wheel there replaces the PyTorch index. The build runs with
# --network host (to reach them), one at a time; layers are cached, so a second build of the same tree is
# seconds. The CA bundle pip trusts here (PIP_CERT, pip config's cert) is served the same way, for a TLS
# proxy between this machine and the index. Arguments after the tag go to `docker build`.
#
# Footguns: without the buildx plugin the classic builder runs (DOCKER_BUILDKIT=0; the Dockerfile keeps to
# its syntax); a file:// index URL cannot be served this way and is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-gpt}
shift || true

[ -n "${DOCKER_BUILDKIT:-}" ] || docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

slim=python:3.11-slim-bookworm
base=${GPT_DOCKER_BASE:-}
if [ -z "$base" ]; then
    if docker image inspect "$slim" >/dev/null 2>&1; then
        base=$slim
    elif docker image inspect gpt-base:bookworm >/dev/null 2>&1; then
        base=gpt-base:bookworm
    elif timeout 60 docker pull -q "$slim" >/dev/null 2>&1; then
        base=$slim
    else
        echo "cannot pull $slim: building a Debian base with docker/base.sh"
        docker/base.sh
        base=gpt-base:bookworm
    fi
fi

pip_config=$(python3 -m pip config list 2>/dev/null || true)
setting() { # the last value pip's configuration gives KEY (env beats files), quotes removed
    printf '%s\n' "$pip_config" | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | tail -n 1
}
index=${PIP_INDEX_URL:-$(setting index-url)}
case "$index" in http://* | https://*) ;; *) index=https://pypi.org/simple ;; esac

servers=()
cert_dir=$(mktemp -d)
trap 'for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$cert_dir"' EXIT
next_port=38470
serve() { # serve directory $1 on 127.0.0.1 while this script runs; its URL in $url
    # The same ports each time where they are free: the URLs are build arguments, part of the layers' cache key.
    local port
    port=$(python3 -c "import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds: a closed one's TIME_WAIT is no matter
try:
    s.bind(('127.0.0.1', int(sys.argv[1])))
except OSError:
    s.bind(('127.0.0.1', 0))
print(s.getsockname()[1])" "$next_port")
    next_port=$((next_port + 1))
    python3 -m http.server --bind 127.0.0.1 --directory "$1" "$port" >/dev/null 2>&1 &
    servers+=($!)
    for _ in $(seq 50); do # until it answers
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
        sleep 0.1
    done
    url="http://127.0.0.1:$port/"
}

# The CA bundle pip trusts here (PIP_CERT, pip config's cert): trusted by the build's pip too (a TLS proxy).
cert_args=()
cert=${PIP_CERT:-$(setting cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" "$cert_dir/ca.pem"
    serve "$cert_dir"
    cert_args=(--build-arg "CERT_URL=${url}ca.pem")
fi

links=""
torch_args=()
seen=" "
for dir in ${PIP_FIND_LINKS:-} $(setting find-links); do
    dir=${dir#file://}
    [ -d "$dir" ] && compgen -G "$dir/*.whl" >/dev/null || continue
    case "$seen" in *" $dir "*) continue ;; esac
    seen="$seen$dir "
    serve "$dir"
    links="$links $url"
    wheel=$(compgen -G "$dir/torch-*.whl" | sort | tail -n 1 || true)
    if [ -n "$wheel" ]; then # torch-2.13.0+cpu-cp311-...whl -> torch==2.13.0+cpu, and no PyTorch index
        version=$(basename "$wheel" | cut -d- -f2)
        torch_args=(--build-arg "TORCH_SPEC=torch==$version" --build-arg TORCH_INDEX_URL=)
    fi
done

echo "building $tag on $base (index $index${links:+, wheels from$links})"
docker build --network host -t "$tag" \
    --build-arg "BASE=$base" --build-arg "INDEX_URL=$index" --build-arg "FIND_LINKS=${links# }" \
    "${torch_args[@]}" "${cert_args[@]}" "$@" .
