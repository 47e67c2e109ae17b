"""Devices to a named mesh: axis sizes, device order, virtual CPU devices; the interconnect topology,
collectives over mesh axes, their cost model, the HLO collective parser and the chips' datasheet peaks
(imports nothing of ours)."""
from mesh import collectives, cost, hlo, topology
from mesh.cost import bus_factor, predict_us, record_us
from mesh.layout import AXES, MeshConfigError, axis_sizes, make_mesh, resolve_axis_sizes, use_cpu_devices
from mesh.topology import Level, Topology, axis_links, get_topology, hybrid_device_order, hybrid_devices

__all__ = ["AXES", "Level", "MeshConfigError", "Topology", "axis_links", "axis_sizes", "bus_factor", "collectives",
           "cost", "get_topology", "hlo", "hybrid_device_order", "hybrid_devices", "make_mesh", "predict_us",
           "record_us", "resolve_axis_sizes", "topology", "use_cpu_devices"]
