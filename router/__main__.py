"""``python -m router``: the same as the ``router`` command."""

import sys

from router.cli import main

sys.exit(main())
