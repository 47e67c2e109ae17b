"""Devices to a named mesh: axis sizes, device order, virtual CPU devices (imports nothing of ours)."""
from mesh.layout import AXES, MeshConfigError, make_mesh, resolve_axis_sizes, use_cpu_devices

__all__ = ["AXES", "MeshConfigError", "make_mesh", "resolve_axis_sizes", "use_cpu_devices"]
