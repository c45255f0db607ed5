"""The GPU check: one command that measures on a real GPU what the simulated device assumes.

``scripts/gpu-check`` runs it (docs/performance.md, "The GPU check"); :mod:`.runner` runs the
parts listed in :mod:`.parts`, each against a :class:`.devices.Device` that is GPU 0 or the
simulated device, so the same steps run on both and ``--simulate`` keeps them working.
"""
