"""meshd's commands: `meshd` (join, local, demo: `main.py`) and `meshctl` (`ctl.py`), thin over the rest."""
