"""Serve a policy through the OpenAI-compatible endpoint: a run's checkpoint, or any model.

    python -m streamrl_jax.serve --config=configs/agent.py --checkpoint=workdir/agent/checkpoints
    python -m streamrl_jax.serve --config=configs/agent.py --config.model.source=model.gguf

The config is the run's (its model, LoRA adapters, prompt and response bounds and engine
settings); `--checkpoint` (a checkpoint root: its latest step, or one step directory)
is read as a run of that config reads `init_from` (LoRA-aware: `checkpoint.policy`);
without it the model the config starts from is served. The endpoint is the training
run's (docs/endpoint.md), with the same trust boundary: loopback unless
`--allow_remote`, a bearer token on every route (`$STREAMRL_ENDPOINT_TOKEN`, or a fresh
one written to `--token_file` (mode 0600) or printed), the request bounds of
`endpoint.api.Limits`: each turn at most `generation.max_new_tokens`, and with an
environment's config (`environment.name`) each episode at most its run's budget after
its first prompt as the run's episodes (`config.episode_tokens`:
`environment.max_episode_tokens`, or what `model.max_context` leaves after
`generation.max_prompt_len`; a request past it: `context_length_exceeded`); without one,
the engine's context only. Each token comes with up to `--top_logprobs` (20)
alternatives (`top_logprobs`; the run's training engines keep none unless
`generation.top_logprobs` asks). A request without an episode id is an episode of its
own; kept KV is given up at once when requests wait (`generation.kv_hold_s=0`: no
request waits on an idle episode). It serves until SIGINT or SIGTERM; `--ready_file`
receives `{"url", "model"}` once it listens (for harnesses that start it).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

from streamrl_jax import platforms

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN_ENV = "STREAMRL_ENDPOINT_TOKEN"

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(_REPO, "configs", "agent.py"),
    "The run's config file (its model, adapters, bounds and engine); :variant for a variant.",
    lock_config=True,
)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "", "A run's checkpoint root or step directory; empty: the config's model."
)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback by default).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free one).")
_ALLOW_REMOTE = flags.DEFINE_bool(
    "allow_remote", False, "Listen on a non-loopback address (anyone who can reach it and "
    "holds the token can generate)."
)  # fmt: skip
_TOKEN_FILE = flags.DEFINE_string(
    "token_file", "", f"Write the bearer token here (mode 0600) instead of printing it; "
    f"${TOKEN_ENV} gives one instead."
)  # fmt: skip
_MODEL_NAME = flags.DEFINE_string("served_model", "policy", "The model name requests give.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Sequences generating at once (engine slots).")
_MAX_N = flags.DEFINE_integer("max_n", 8, "Most choices (`n`) a request may ask for.")
_KV_HOLD = flags.DEFINE_float(
    "kv_hold_s", 0.0, "Seconds an idle episode's KV is kept while requests wait for a slot."
)
_TOP_LOGPROBS = flags.DEFINE_integer(
    "top_logprobs", 20, "Most alternatives per token a request may ask for (`top_logprobs`; "
    "0: none, and prefill and decode compute none)."
)  # fmt: skip
_READY_FILE = flags.DEFINE_string(
    "ready_file", "", 'Write {"url", "model"} here (JSON) once listening.'
)


def _user_error(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _token() -> tuple[str, bool]:
    """The bearer token and whether it was made here."""
    given = os.environ.get(TOKEN_ENV, "")
    if given:
        if len(given) < 16:
            _user_error(f"${TOKEN_ENV}: the token must be at least 16 characters")
        return given, False
    return secrets.token_urlsafe(32), True


def _write_private(path: str, text: str) -> None:
    """`text` at `path` (owner-only), whole or not at all: written beside it and renamed,
    so a script polling for the file never reads it half written."""
    part = f"{path}.{os.getpid()}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(part, path)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from streamrl_jax import config as config_lib
    from streamrl_jax.errors import UserError

    value = _CONFIG.value
    if (failure := getattr(value, "_error", None)) is not None:
        _user_error(f"--config: {failure}")
    if _CHECKPOINT.value and not os.path.exists(_CHECKPOINT.value):
        _user_error(f"--checkpoint={_CHECKPOINT.value}: no such directory")
    if _SLOTS.value < 1 or _KV_HOLD.value < 0:
        _user_error("--slots must be >= 1 and --kv_hold_s >= 0")
    if not 0 <= _TOP_LOGPROBS.value <= 64:
        _user_error(f"--top_logprobs={_TOP_LOGPROBS.value} must be in [0, 64]")
    if not _ALLOW_REMOTE.value:
        import ipaddress

        try:
            loopback = ipaddress.ip_address(_HOST.value).is_loopback
        except ValueError:
            _user_error(f"--host={_HOST.value}: not an IP address")
        if not loopback:
            _user_error(f"--host={_HOST.value} is not loopback: pass --allow_remote to serve it")
    try:
        cfg = config_lib.from_config_dict(value)
    except UserError as e:
        _user_error(str(e))
    import jax

    if (names := platforms.jax_platforms(os.environ)) is not None:
        jax.config.update("jax_platforms", names)
    jax.config.update("jax_num_cpu_devices", cfg.mesh.generate_devices + cfg.mesh.train_devices)
    if jax.config.jax_compilation_cache_dir:  # the environment's: shared as launch shares it
        from streamrl_jax.distributed import compile_cache

        compile_cache.configure()
        compile_cache.heal(jax.config.jax_compilation_cache_dir)
    token, made = _token()
    try:
        endpoint, server = _serve(cfg, token)
    except (UserError, FileNotFoundError) as e:
        _user_error(str(e))
    where = f"{server.url}/v1"
    if made and _TOKEN_FILE.value:
        _write_private(_TOKEN_FILE.value, token)
    print(f"serving {_MODEL_NAME.value!r} at {where}", flush=True)
    if made and not _TOKEN_FILE.value:
        print(f"bearer token: {token}", flush=True)
    if _READY_FILE.value:
        _write_private(_READY_FILE.value, json.dumps({"url": where, "model": _MODEL_NAME.value}))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logging.info("serve: stopping (%s)", endpoint.counts)
    server.stop()
    endpoint.backend.close()


def _serve(cfg, token: str):
    """The endpoint over the policy at `--checkpoint` of a run of `cfg`, listening."""
    from streamrl_jax.config import episode_tokens
    from streamrl_jax.endpoint import api
    from streamrl_jax.endpoint.kit import serve
    from streamrl_jax.pipeline import components

    parts, params, tokenizer = components.served(
        cfg, checkpoint=_CHECKPOINT.value, slots=_SLOTS.value, kv_hold_s=_KV_HOLD.value,
        top_logprobs=_TOP_LOGPROBS.value,
    )  # fmt: skip
    service = parts.service(
        params, 0, on_chunk=lambda r: None, precompile=False, continuations=False
    )
    # With an environment, its episodes' budget as the run's episodes have it (a served
    # evaluation then plays what the run's in-process one plays); none otherwise.
    limits = api.Limits(
        max_tokens=cfg.generation.max_new_tokens, max_n=max(1, _MAX_N.value),
        episode_tokens=episode_tokens(cfg) if cfg.environment.name else 0,
    )  # fmt: skip
    return serve(
        service, tokenizer, token, limits, served=_MODEL_NAME.value, host=_HOST.value,
        port=_PORT.value, allow_remote=_ALLOW_REMOTE.value,
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
