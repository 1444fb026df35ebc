"""The server's settings, checked once (`gpt serve` flags are the field names with dashes)."""

from __future__ import annotations

from dataclasses import dataclass

from gpt.serve import ServeError

MAX_SPECULATE = 32  # guesses a step: each costs a position of every row's forward


@dataclass
class ServeConfig:
    """The server's settings (`gpt serve` flags are the field names with dashes)."""

    model_name: str
    api_key: str | None = None  # None: no authentication
    max_batch: int = 32  # rows (samples) decoded together
    max_queue: int = 64  # requests waiting for rows; beyond that, 429
    adapters: tuple[str, ...] = ()  # LoRA adapters served beside the model (gpt serve --lora NAME=DIR), by name
    prefix_cache_mb: int = 0  # keys and values of prompt prefixes kept across requests (gpt/infer/prefix.py); 0: off
    speculate: int = 0  # guesses a row checks a step (speculative decoding, gpt/infer/speculative_batch.py); 0: off
    draft_ckpt: str | None = None  # the draft model's checkpoint (its guesses); None: prompt lookup
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # None: the model's block_size
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds a request body may take to arrive; then 408
    body_idle_timeout: float = 5.0  # seconds a request body may go without a byte; then 408
    header_timeout: float = 5.0  # seconds a connection may wait before a whole request head; then it is closed
    send_timeout: float = 30.0  # seconds an answer may sit unread (the send buffer full); then the connection drops
    max_connections: int | None = None  # uvicorn's limit_concurrency (503 beyond); None: 2 x (max_batch + max_queue)
    max_connections_per_client: int | None = None  # connections one client address may hold; None: half the above + 1
    max_logprob_values: int = 1 << 17  # log-probabilities one answer may carry: tokens x (logprobs + 1); beyond, 400
    allowed_hosts: tuple[str, ...] = ()  # Host names answered without an API key besides the loopback ones; "*": any
    docs: bool = False  # serve /docs and /openapi.json (Swagger UI loads its script from a CDN)
    fingerprint: str = ""  # system_fingerprint: what the backend runs (device, dtype, quantisation)

    def __post_init__(self):
        problems = [
            f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}"
            for name in ("max_batch", "max_queue", "max_tokens", "max_body_bytes", "max_logprob_values")
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1
        ]
        if not isinstance(self.prefix_cache_mb, int) or self.prefix_cache_mb < 0:
            problems.append(f"--prefix-cache-mb must be an integer >= 0 (0 = off), got {self.prefix_cache_mb!r}")
        if not isinstance(self.speculate, int) or not 0 <= self.speculate <= MAX_SPECULATE:
            problems.append(f"--speculate must be a number of tokens from 1 to {MAX_SPECULATE}, got {self.speculate!r}")
        elif self.draft_ckpt is not None and not self.speculate:
            problems.append("--draft-ckpt needs --speculate K (the guesses a row checks a step)")
        for name in ("max_prompt_tokens", "max_connections", "max_connections_per_client"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("body_timeout", "body_idle_timeout", "header_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                problems.append(
                    f"--{name.replace('_', '-')} must be a number of seconds > 0, got {getattr(self, name)!r}"
                )
        if not self.model_name:
            problems.append("--model-name must not be empty")
        names = [self.model_name, *self.adapters]
        if len(set(names)) != len(names) or not all(names):
            problems.append(f"--lora names must be non-empty and differ from each other and --model-name, got {names}")
        if problems:
            raise ServeError("invalid server settings: " + "; ".join(problems))
        if self.max_connections is None:
            self.max_connections = 2 * (self.max_batch + self.max_queue)
        if self.max_connections_per_client is None:
            self.max_connections_per_client = min(self.max_connections, self.max_connections // 2 + 1)
