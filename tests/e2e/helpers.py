"""Running the ``router`` command and the example scripts as a user would."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTER = Path(sys.executable).with_name("router")


def router(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``router ARGS`` to completion."""
    return subprocess.run(
        [str(ROUTER), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def python(
    script: str, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run one of the repository's Python scripts."""
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class Serving:
    """``router serve`` in the background, its log in a file."""

    def __init__(
        self,
        cwd: Path,
        env: dict[str, str] | None = None,
        *args: str,
        new_session: bool = False,
    ) -> None:
        """``new_session``: the router and its workers in a process group of their own, as
        on a host of their own, so ``os.killpg(process.pid, ...)`` reaches them all and never
        the test."""
        self.log = cwd / "serve.log"
        self._file = self.log.open("w")
        self.process = subprocess.Popen(
            [str(ROUTER), *args, "serve"],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=self._file,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )

    def wait_for(self, text: str, timeout: float = 20) -> None:
        """Wait until the log shows ``text``."""
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text():
            if self.process.poll() is not None:
                raise AssertionError(f"router serve exited:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not logged:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal the router and wait for it to exit; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._file.close()


def copy_default_config(folder: Path) -> Path:
    """The shipped config.yaml, copied into a test's folder."""
    target = folder / "config.yaml"
    shutil.copy(ROOT / "config.yaml", target)
    return target
