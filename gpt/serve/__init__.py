"""An OpenAI-compatible completions server with a web playground, for any gpt checkpoint.

    gpt serve --ckpt out/shakespeare-char                  # http://127.0.0.1:8000, playground at /
    gpt serve --ckpt out/shakespeare-char --quantize int8 --port 0 --api-key "$KEY"

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="shakespeare-char", prompt="ROMEO:", max_tokens=100, stream=True)

The server room: `api.py` (the API's request shapes, validated, and OpenAI's error shape), `responses.py` (the
answers' and stream chunks' shapes), `config.py` (the
server's settings), `checks.py` (a request checked against the server's limits and model, one concern each),
`service.py` (the request handling, one method per route, over a `gpt.infer.batching` engine thread),
`answers.py` (the engine's pieces as a response or a stream), `app.py` (the FastAPI app wiring the routes, and
uvicorn around it), `guards.py` (the deadlines on request heads and bodies, the places under --max-connections
and each client address's share of them, the Host check, security headers and the last-resort 500),
`playground.html`; the command line is gpt/cli/serve.py (`gpt serve`). May import inference, checkpoints,
model, data and the foundations; never training or the command line.
FastAPI and uvicorn are the `serve` extra (`pip install -e ".[serve]"`); importing this package does
not import them.
"""

from gpt.errors import UserError


class ServeError(UserError, ValueError):
    """Server settings that cannot work, or a missing dependency (the message says what to do)."""
