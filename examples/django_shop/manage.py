#!/usr/bin/env python
"""The Django shop's ``manage.py``: ``python manage.py place_order`` and the usual commands."""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Run a Django management command with this project's settings."""
    from django.core.management import execute_from_command_line

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
