"""`python -m ownerserve` runs the CLI."""

import sys

from ownerserve.cli import main

sys.exit(main())
