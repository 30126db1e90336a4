"""The bottom room: what every other room may use (logging, the compute executor, the settings' one
declaration and their defaults); it imports nothing of meshd."""
