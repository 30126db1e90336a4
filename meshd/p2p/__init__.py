"""meshd.p2p: the libp2p host, framed channels over its streams, and the one dialler every part uses."""
