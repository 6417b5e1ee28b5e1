"""The replica processes: each a whole `stallfree serve` of the model on a loopback socket the
front bound for it, so its port is known before it starts and no other process can take it.

A replica is the front's configuration with the front's own business taken out: it listens on
plain HTTP at 127.0.0.1 (the front terminates TLS and owns the Unix socket, the proxy's root
path, the Host check and CORS), labels its metrics `engine="i"`, runs one engine (its own
`--tp-size` ranks and worker processes included) and logs no access lines (the front does).
It sits in a process group of its own, so a terminal's Ctrl-C reaches the front alone, which
passes the shutdown on; and it drains and exits when the front's process is gone. The API key stays: a replica's port is
open to this machine, and the client's key is passed on.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from stallfree.config import StallfreeConfig


def replica_config(config: StallfreeConfig, index: int) -> StallfreeConfig:
    server = config.server.model_copy(
        update={
            "host": "127.0.0.1",
            "port": 0,
            "uds": None,
            "ssl_keyfile": None,
            "ssl_certfile": None,
            "ssl_ca_certs": None,
            "allowed_hosts": None,
            "root_path": "",
            "access_log": False,
            "allowed_origins": [],
        }
    )
    return config.model_copy(
        update={
            "server": server,
            "metrics": config.metrics.model_copy(update={"engine_label": str(index)}),
            "replicas": config.replicas.model_copy(update={"data_parallel_size": 1}),
        }
    )


def _drain_when_orphaned() -> None:
    """SIGTERM this process (a drain, then exit) once the front's process is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stallfree-front-watch", daemon=True).start()


def run_replica(config: StallfreeConfig, sock: socket.socket) -> None:
    """A replica process's entry point: serve on `sock` until drained; exit with serve's
    status."""
    os.setpgrp()
    _drain_when_orphaned()
    from stallfree.entrypoints.server.launch import serve

    sys.exit(serve(config, sockets=[sock]))


def loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def start_replica(config: StallfreeConfig, index: int) -> tuple[BaseProcess, str]:
    """Start replica `index`; its process and URL. The front's copy of the socket is closed
    once the child has its own: a replica that dies then refuses connections at once, rather
    than leaving them queued on a socket nobody accepts from."""
    ctx = multiprocessing.get_context("spawn")
    sock = loopback_socket()
    try:
        # not a daemon: a replica starts worker processes of its own (--worker process)
        proc = ctx.Process(
            target=run_replica,
            args=(replica_config(config, index), sock),
            name=f"stallfree-replica{index}",
            daemon=False,
        )
        proc.start()
        port = sock.getsockname()[1]
    finally:
        sock.close()
    return proc, f"http://127.0.0.1:{port}"


def stop_replicas(processes: list[BaseProcess], timeout_s: float) -> None:
    """SIGTERM (a drain) each replica still running, wait up to `timeout_s`, then SIGKILL."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
