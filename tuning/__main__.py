"""`python -m pdlab.tuning`: the `tune` command."""

import sys

from pdlab.tuning.cli import main

sys.exit(main())
