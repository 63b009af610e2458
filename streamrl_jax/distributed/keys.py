"""The run key: one secret per run, from which every channel's CURVE keys derive.

The cross-process channels (`peers.py`) are ZeroMQ sockets under CURVE
(CurveZMQ: X25519 key exchange, then every frame encrypted and authenticated
with XSalsa20-Poly1305). Each run has one secret of at least 16 bytes; from it
every process derives the same two long-term key pairs (`RunKey`):

* the *server* pair: servers (the training process's sample and weight
  ports) hold its secret half; clients must know its public half to connect,
  so a client only ever talks to a server of its own run;
* the *client* pair: clients hold its secret half; a server admits a client
  (through a ZAP handler) only if it proves it holds that half.

So a process without the secret can neither connect to a server nor pose as
one, and nothing it sends reaches the channel's decoder.

Where the secret comes from (`secret_from_env`): `STREAMRL_AUTHKEY_FILE`, a
file readable by its owner only (what the pod launchers write), else
`STREAMRL_AUTHKEY` in the environment (what `launch/local.py` sets for its
children). Neither ever appears on a command line (`ps` shows those to every
user); another user cannot read a process's environment or an owner-only file.
The launchers make the secret themselves (`secrets.token_hex(32)`) without
importing this package: `streamrl_jax.distributed` imports JAX (through the
engine's sample types), which a launcher does not need, and `launch/tpu_pod.sh`
runs on a workstation that may not have the package installed.
A multi-process run without a key refuses to start.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import stat
from collections.abc import Mapping

import zmq
from zmq.utils import z85

from streamrl_jax.errors import UserError

ENV_AUTHKEY = "STREAMRL_AUTHKEY"
ENV_AUTHKEY_FILE = "STREAMRL_AUTHKEY_FILE"
MIN_SECRET_BYTES = 16
_MAX_KEY_FILE_BYTES = 4096


class RunKeyError(UserError):
    """The run key is missing, too short, or its file is unsafe."""


@dataclasses.dataclass(frozen=True)
class RunKey:
    """The CURVE key pairs (Z85-encoded, as pyzmq takes them) derived from one secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def fingerprint(self) -> str:
        """A short public name of the key (logs, the ZAP domain); reveals nothing secret."""
        return hashlib.blake2b(self.server_public, digest_size=6).hexdigest()

    def __repr__(self) -> str:  # never print the secret halves
        return f"RunKey({self.fingerprint})"


@functools.lru_cache(maxsize=16)
def run_key(secret: bytes) -> RunKey:
    """The run's key pairs: X25519 secrets from BLAKE2b(secret, role), publics from those."""
    if not isinstance(secret, bytes):
        raise TypeError(f"the run secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise RunKeyError(
            f"the run secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
            f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )

    def pair(role: bytes) -> tuple[bytes, bytes]:
        raw = hashlib.blake2b(secret, digest_size=32, person=b"streamrl-" + role).digest()
        sec = z85.encode(raw)
        return zmq.curve_public(sec), sec

    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return RunKey(server_public, server_secret, client_public, client_secret)


def read_key_file(path: str) -> bytes:
    """The secret in `path`; refuses a file that other users can read or write."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise RunKeyError(f"{ENV_AUTHKEY_FILE}={path}: cannot open the key file ({e})") from e
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise RunKeyError(
                f"{ENV_AUTHKEY_FILE}={path}: the key file is accessible to other users "
                f"(mode {stat.filemode(mode)}); chmod 600 it"
            )
        data = f.read(_MAX_KEY_FILE_BYTES + 1)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise RunKeyError(f"{ENV_AUTHKEY_FILE}={path}: over {_MAX_KEY_FILE_BYTES} bytes")
    return data.strip()


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The run secret from `STREAMRL_AUTHKEY_FILE`, else `STREAMRL_AUTHKEY`; None if unset."""
    env = os.environ if environ is None else environ
    if env.get(ENV_AUTHKEY_FILE):
        source = f"{ENV_AUTHKEY_FILE}={env[ENV_AUTHKEY_FILE]}"
        secret = read_key_file(env[ENV_AUTHKEY_FILE])
    elif env.get(ENV_AUTHKEY):
        source, secret = ENV_AUTHKEY, env[ENV_AUTHKEY].encode()
    else:
        return None
    try:
        run_key(secret)  # a short secret fails here
    except RunKeyError as e:
        raise RunKeyError(f"{source}: {e}") from None
    return secret
