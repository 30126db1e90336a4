"""A seeded discrete-event simulation of a meshd swarm that runs meshd's own planning code.

`python -m meshd.sim --help`; the world model, calibration and results are in docs/simulator.md.
"""
