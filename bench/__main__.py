"""`python -m pdlab.bench`: the `bench` command."""

import sys

from pdlab.bench.cli import main

sys.exit(main())
