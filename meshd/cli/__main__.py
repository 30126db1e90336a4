"""`python -m meshd.cli ...` runs the `meshd` command."""

import sys

from meshd.cli.main import main

sys.exit(main())
