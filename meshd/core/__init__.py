"""The bottom room: what every other room may use (logging, the compute executor); it imports
nothing of meshd."""
