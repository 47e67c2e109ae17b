"""Meshes, topologies, collectives and their costs, the HLO reader, chip peaks and the collective benchmark."""
