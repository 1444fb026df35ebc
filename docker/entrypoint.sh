#!/bin/sh
# The image's entrypoint: gpt serve on every interface, the model at $GPT_MODEL (default /model), the port
# $GPT_PORT (default 8000, the one HEALTHCHECK asks), the API key from $GPT_SERVE_API_KEY (gpt serve reads it).
# Arguments after the image name are more `gpt serve` flags: docker run ... gpt --quantize int8 --threads 4
exec gpt serve --host 0.0.0.0 --port "${GPT_PORT:-8000}" --ckpt "${GPT_MODEL:-/model}" "$@"
