#!/bin/sh
# `pip install ARGS` inside the image build, with the build's arguments: INDEX_URL (the index), FIND_LINKS
# (more places with wheels, space-separated URLs) and CERT_URL (a CA bundle for pip to trust, for a machine
# whose traffic passes a TLS proxy; fetched for this one command, so it never stays in the image).
set -e
for link in $FIND_LINKS; do set -- "$@" --find-links "$link"; done
if [ -n "$CERT_URL" ]; then
    python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], '/tmp/pip-ca.pem')" "$CERT_URL"
    export PIP_CERT=/tmp/pip-ca.pem # the environment, not --cert: the build-isolation pip reads it too
fi
pip install -q --index-url "$INDEX_URL" "$@"
rm -f /tmp/pip-ca.pem
