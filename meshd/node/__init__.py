"""meshd.node: the daemon. `Daemon` wires the parts together; the lifecycle table, status, settings,
logging and the compute thread live here, and only here are the environment and the command line read."""
