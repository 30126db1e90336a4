"""meshd: run a language model across machines, each daemon serving a contiguous range of layers.

The rooms, bottom up; a room imports only rooms before it in `ROOMS` (tests/test_layers.py keeps it so):
- core: logging and what every room may use (no meshd import at all)
- wire: the binary framing, sans-io
- shard: the model math for a range of layers; knows nothing of the mesh
- p2p: hosts, connections, streams, the dialler; knows nothing of relays' protocol or records
- relay: circuit relay, hole punching, reachability
- dht: coverage records, the Kademlia walk, placement and rebalancing plans
- hop: serving other daemons' sessions on this daemon's layers
- entry: generations begun here: routes, attempts, checks, hand-over choices
- api: the local socket, HTTP, metrics and the dashboard
- node: the daemon that wires the rooms, its settings and lifecycle
- cli: the command lines
- sim: the swarm simulator (drives dht's and entry's policies)
- testing: harnesses for tests and benches (fake hosts, local meshes, liars)
"""

ROOMS = ("core", "wire", "shard", "p2p", "relay", "dht", "hop", "entry", "api", "node", "cli", "sim", "testing")
