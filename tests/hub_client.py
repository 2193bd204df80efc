"""The environment of a client process in the online tests (tests/test_hub_standin.py, test_hub_faults.py,
online_pipeline.py): the stand-in as the hub, caches of its own, and a socket guard: a sitecustomize on PYTHONPATH that
every Python process started with it imports (make's commands, torchrun's workers, a vLLM server), refusing and logging
any TCP connection that leaves this machine."""

from __future__ import annotations

import os
from pathlib import Path

LOG_ENV = "BLOCKGEN_SOCKET_LOG"
SOCKET_GUARD = '''"""Written by tests/hub_client.py: TCP connections leave this machine only over the loopback or to its own
addresses; any other is refused and logged to $BLOCKGEN_SOCKET_LOG. (A UDP connect sends nothing: libraries use it to
learn their own address.)"""
import ipaddress, os, socket

_connect = socket.socket.connect
_own = set()


def _local(host):
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        return host == "localhost"
    if not _own:
        try:
            _own.update(socket.gethostbyname_ex(socket.gethostname())[2])
        except OSError:
            pass
    return host in _own


def _guarded(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and not _local(str(address[0])):
        with open(os.environ["BLOCKGEN_SOCKET_LOG"], "a") as log:
            log.write(f"{os.getpid()} {address!r}\\n")
        raise OSError(f"refused by the test's socket guard: a connection to {address!r}")
    return _connect(sock, address)


if os.environ.get("BLOCKGEN_SOCKET_LOG"):
    socket.socket.connect = _guarded
'''


def client_env(endpoint: str, hf_home: Path, release_cache: Path, guard: Path, log: Path, **extra: str) -> dict[str, str]:
    """This process's environment without its hub settings, plus: HF_ENDPOINT, HF_HOME and the release cache given,
    telemetry off, the socket guard (written into the folder `guard`) logging to `log`, and `extra`."""
    guard.mkdir(parents=True, exist_ok=True)
    (guard / "sitecustomize.py").write_text(SOCKET_GUARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home), "BLOCKGEN_RELEASE_CACHE": str(release_cache),
            "HF_HUB_DISABLE_TELEMETRY": "1", LOG_ENV: str(log),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(guard), env.get("PYTHONPATH")])), **extra}
