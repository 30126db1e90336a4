"""meshd.hop: serving a range of layers to other daemons: the session table, admission, the batching
scheduler, passes on the compute thread, links to the next hop, and the shard stream protocol."""
