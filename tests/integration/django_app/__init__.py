"""A small Django project for tests/integration/test_django.py: ``settings`` (one database,
as ``default`` and ``other``), the ``orders`` app, and ``scenario``, the steps a test runs in
a process of its own (Django's settings are global to a process)."""
