"""``python -m mongoq``: the same as the ``mongoq`` command."""

import sys

from mongoq.cli import main

sys.exit(main())
