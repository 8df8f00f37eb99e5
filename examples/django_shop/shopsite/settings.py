"""Settings of the Django shop.

One database, from ``DATABASE_URL`` (the variable ``config.yaml`` reads too, so Django and
the router share it): ``sqlite:///./var/shop.db`` by default (relative to this project), or
``postgresql://user:password@host:port/name`` (Django's ``postgresql`` backend, psycopg 3),
or ``mysql://`` / ``mariadb://`` (Django's ``mysql`` backend, on PyMySQL).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def database(url: str) -> dict[str, Any]:
    """Django's ``DATABASES`` entry for ``url``."""
    parts = urlsplit(url)
    scheme = parts.scheme.partition("+")[0]
    if scheme == "sqlite":
        path = Path(unquote(parts.path[1:] if parts.path.startswith("/") else parts.path))
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / path}
    server = {
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
    if scheme in ("postgres", "postgresql"):
        return {"ENGINE": "django.db.backends.postgresql", **server}
    if scheme in ("mysql", "mariadb"):
        # PyMySQL stands in for mysqlclient (no compiler needed); either works with Django.
        import pymysql

        pymysql.install_as_MySQLdb()
        return {"ENGINE": "django.db.backends.mysql", **server, "OPTIONS": {"charset": "utf8mb4"}}
    raise ImproperlyConfigured(
        f"DATABASE_URL: use sqlite:///, postgresql:// or mysql://, not {scheme}://"
    )


DATABASES = {"default": database(os.environ.get("DATABASE_URL", "sqlite:///./var/shop.db"))}

INSTALLED_APPS = [
    "router.contrib.django",  # stage(), and the router.E001 system check
    "orders",
]

# The router's config, relative to BASE_DIR (default: $ROUTER_CONFIG, else ./config.yaml).
ROUTER_CONFIG = "config.yaml"

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-shop-example-only")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
