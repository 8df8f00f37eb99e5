"""Which ``config.yaml`` a Django project's outbox reads, and the one ``SyncOutbox`` per
process built from it on first use."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from router.write.sync import SyncOutbox

__all__ = ["config_path", "get_outbox", "reset_outbox"]

_lock = threading.Lock()
_outbox: SyncOutbox | None = None


def config_path() -> Path:
    """The ``ROUTER_CONFIG`` setting (relative to ``BASE_DIR`` when that setting exists), else
    ``$ROUTER_CONFIG``, else ``config.yaml`` in the working directory."""
    from django.conf import settings

    configured = getattr(settings, "ROUTER_CONFIG", None)
    if not configured:
        return Path(os.environ.get("ROUTER_CONFIG", "config.yaml"))
    path = Path(configured)
    base_dir = getattr(settings, "BASE_DIR", None)
    if base_dir is not None and not path.is_absolute():
        return Path(base_dir) / path
    return path


def get_outbox() -> SyncOutbox:
    """The process's ``SyncOutbox``, built from ``config_path()`` on the first call."""
    global _outbox
    outbox = _outbox
    if outbox is None:
        with _lock:
            if _outbox is None:
                _outbox = SyncOutbox.from_file(config_path())
            outbox = _outbox
    return outbox


def reset_outbox() -> None:
    """Forget the outbox: the next ``get_outbox()`` reads the config again (called when
    ``ROUTER_CONFIG`` or ``BASE_DIR`` change, as under ``override_settings``)."""
    global _outbox
    with _lock:
        _outbox = None
