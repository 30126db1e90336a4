"""meshd.dht: who serves which layers. Signed coverage records in a Kademlia DHT, the mesh view that
publishes and refreshes them, the coverage map, placement of a joining daemon and rebalancing."""
