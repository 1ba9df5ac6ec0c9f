"""``python -m hpar_agent``: the ``hpar-agent`` command, for environments whose scripts are not on PATH."""

import sys

if __name__ == "__main__":
    from hpar_agent.tools.cli import main  # only when run: importing this module loads no tool

    sys.exit(main())
