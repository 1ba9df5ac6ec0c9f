"""One collector per source; ``hpar_agent.agent.default_components`` is the set ``attach()`` installs."""
