"""``python -m hpar_agent``: the ``hpar-agent`` command, for environments whose scripts are not on PATH."""

import sys

from hpar_agent.tools.cli import main

sys.exit(main())
