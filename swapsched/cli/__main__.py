"""``python -m swapsched.cli``: the ``swapsched`` command."""

import sys

from swapsched.cli import main

sys.exit(main())
