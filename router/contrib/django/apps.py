"""The Django app (``"router.contrib.django"`` in ``INSTALLED_APPS``): registers the schema
check, creates the router's tables after ``migrate`` in databases config.yaml does not name
(Django's test databases: ``router.contrib.django.tables``), and forgets the outbox when its
settings change."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig

__all__ = ["RouterAppConfig"]

_SETTINGS = {"ROUTER_CONFIG", "BASE_DIR"}


class RouterAppConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """outbox-router's Django app."""

    name = "router.contrib.django"
    label = "outbox_router"
    verbose_name = "outbox-router"

    def ready(self) -> None:
        """Register the ``database`` check, the ``post_migrate`` receiver and the settings
        listener."""
        from django.core import checks
        from django.core.signals import setting_changed
        from django.db.models.signals import post_migrate

        from router.contrib.django.schema import check_schema
        from router.contrib.django.tables import migrate_tables

        checks.register(check_schema, checks.Tags.database)
        # Sent once per app after each migrate: this app's is the one to answer.
        post_migrate.connect(migrate_tables, sender=self, dispatch_uid="router.contrib.django")
        setting_changed.connect(_settings_changed, dispatch_uid="router.contrib.django")


def _settings_changed(setting: str, **kwargs: Any) -> None:
    if setting in _SETTINGS:
        from router.contrib.django.config import reset_outbox

        reset_outbox()
