"""Reachability (dial-back by peers); later relays and hole punching."""
