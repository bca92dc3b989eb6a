"""``python -m sparknet``: the ``sparknet`` command (:func:`sparknet.cli.main`)."""

import sys

from sparknet.cli import main

sys.exit(main())
