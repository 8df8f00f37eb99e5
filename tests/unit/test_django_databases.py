"""Which router database a Django database is (``router.contrib.django.databases``): by
where both point, never by guessing between several; and the URL ``init_db`` builds from
Django's settings points where Django does. No Django and no database needed: a Django
connection is seen only through ``vendor``, ``alias`` and ``settings_dict``."""

from __future__ import annotations

import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import router.contrib.django as contrib_django
from router import ConfigError, StagingError
from router.contrib.django.databases import (
    database_settings,
    django_location,
    matching_database,
    router_database,
    router_location,
)
from tests.conftest import MEMORY_BROKERS, make_config


def connection(vendor: str, alias: str = "default", **settings: Any) -> Any:
    """What the matching reads of a Django connection."""
    return SimpleNamespace(vendor=vendor, alias=alias, settings_dict=settings)


def pg(name: str = "shop", alias: str = "default", **settings: Any) -> Any:
    return connection("postgresql", alias, **{"NAME": name, "USER": "app", **settings})


def config(tmp_path: Path, **databases: str) -> Any:
    return make_config(databases, MEMORY_BROKERS, base_dir=tmp_path)


@pytest.mark.parametrize(
    ("django", "url"),
    [
        (pg(HOST="127.0.0.1", PORT="5432"), "postgresql://app@localhost/shop"),
        (pg(HOST="", PORT=""), "postgresql://other:secret@127.0.0.1:5432/shop"),
        (pg(HOST="db.internal", PORT=6432), "postgresql+asyncpg://app@DB.internal:6432/shop"),
        (
            connection("mysql", NAME="shop", HOST="localhost"),
            "mariadb://root@127.0.0.1:3306/shop",
        ),
        (pg(HOST="db2", PORT="6432"), "postgresql://app@db1:5432,db2:6432/shop"),
    ],
    ids=["loopback-names", "empty-host-and-port", "host-and-port", "mariadb", "multi-host"],
)
def test_a_django_database_matches_the_router_database_at_the_same_place(
    tmp_path: Path, django: Any, url: str
) -> None:
    found = config(tmp_path, archive="sqlite:///archive.db", main=url)
    assert matching_database(found, django) == "main"
    assert router_database(found, django) == "main"


@pytest.mark.parametrize(
    ("django", "url"),
    [
        (pg("shop"), "postgresql://app@localhost/shop_test"),
        (pg(PORT="5433"), "postgresql://app@localhost/shop"),
        (pg(HOST="db.internal"), "postgresql://app@localhost/shop"),
        (connection("mysql", NAME="shop"), "postgresql://app@localhost/shop"),
    ],
    ids=["name", "port", "host", "kind"],
)
def test_a_django_database_elsewhere_matches_nothing(tmp_path: Path, django: Any, url: str) -> None:
    assert matching_database(config(tmp_path, main=url), django) is None


def test_sqlite_files_match_by_path_relative_paths_from_the_configs_folder(
    tmp_path: Path,
) -> None:
    found = config(tmp_path, main="sqlite:///var/shop.db", archive="sqlite:///var/old.db")
    django = connection("sqlite", NAME=tmp_path / "var" / ".." / "var" / "shop.db")
    assert matching_database(found, django) == "main"
    in_memory = connection("sqlite", NAME="file:memorydb_default?mode=memory&cache=shared")
    assert django_location(in_memory) is None
    assert matching_database(found, in_memory) is None


def test_without_a_match_the_only_router_database_is_used(tmp_path: Path) -> None:
    found = config(tmp_path, main="postgresql://app@localhost/shop")
    assert router_database(found, pg("test_shop")) == "main"  # Django's test database


def test_several_router_databases_and_no_match_is_refused(tmp_path: Path) -> None:
    found = config(tmp_path, main="postgresql://app@localhost/shop", archive="sqlite:///archive.db")
    with pytest.raises(StagingError) as refused:
        router_database(found, pg("test_shop", alias="other"))
    assert str(refused.value) == (
        "Django database 'other' (postgresql localhost:5432/test_shop) is none of the "
        "router's databases ['archive', 'main']: pass database=... to stage()"
    )


def test_two_router_databases_at_one_place_are_not_guessed_between(tmp_path: Path) -> None:
    url = "postgresql://app@localhost/shop"
    assert matching_database(config(tmp_path, a=url, b=url), pg()) is None


@pytest.mark.parametrize(
    ("django", "url"),
    [
        (
            pg(USER="app", PASSWORD="p@ss:/w?rd", HOST="db", PORT="6432"),
            "postgresql://app:p%40ss%3A%2Fw%3Frd@db:6432/shop",
        ),
        (pg(USER="", HOST=""), "postgresql:///shop"),
        (
            connection("mysql", NAME="shop", USER="root", HOST="::1"),
            "mysql://root@[::1]/shop",
        ),
    ],
    ids=["password-quoted", "socket", "ipv6"],
)
def test_init_db_reaches_the_database_django_does(tmp_path: Path, django: Any, url: str) -> None:
    settings = database_settings(django)
    assert settings.url.get_secret_value() == url
    assert router_location(settings, tmp_path) == django_location(django)


def test_init_db_refuses_an_in_memory_sqlite_database() -> None:
    with pytest.raises(ConfigError, match="in-memory SQLite database"):
        database_settings(connection("sqlite", NAME=":memory:"))


def test_the_package_exports_what_its_all_lists() -> None:
    public = {
        name
        for name, value in vars(contrib_django).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert sorted(public) == sorted(contrib_django.__all__)
