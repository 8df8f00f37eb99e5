"""Integrations with web frameworks, one package each (``router.contrib.django``); only that
package imports its framework.

They sit beside ``serve`` in the layers (pyproject.toml's import contracts): they build on
``write`` and ``ops``, and nothing else in the router imports them.
"""

__all__: list[str] = []
