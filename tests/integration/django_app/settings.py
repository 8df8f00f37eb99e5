"""Settings of the test project, from the environment the test gives its process.

``ROUTER_TEST_DJANGO_DB``: the ``DATABASES`` entry (JSON), used as ``default`` and again as
``other`` (one database, two aliases); ``ROUTER_TEST_BASE_DIR``: ``BASE_DIR``, the folder
of ``config.yaml`` (``ROUTER_CONFIG`` is relative to it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DATABASE: dict[str, Any] = json.loads(os.environ["ROUTER_TEST_DJANGO_DB"])
if DATABASE["ENGINE"] == "django.db.backends.mysql":
    import pymysql

    pymysql.install_as_MySQLdb()  # Django's mysql backend on PyMySQL, no compiler needed

BASE_DIR = Path(os.environ["ROUTER_TEST_BASE_DIR"])
ROUTER_CONFIG = "config.yaml"
SECRET_KEY = "only-for-tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {"default": DATABASE, "other": dict(DATABASE)}
INSTALLED_APPS = ["router.contrib.django", "tests.integration.django_app.orders"]
