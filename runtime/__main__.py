"""`python -m pdlab.runtime`: the `runtime` command."""

import sys

from pdlab.runtime.cli import main

sys.exit(main())
