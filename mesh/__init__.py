"""Devices to a named mesh: axis sizes, device order, virtual CPU devices; the interconnect topology and
where a mesh's collectives travel on it, collectives over mesh axes, their cost model, the HLO collective
parser, the chips' datasheet peaks, and UserError, the base of every error a user can cause (imports nothing
of ours)."""
from mesh import collectives, cost, hlo, placement, topology
from mesh.cost import bus_factor, predict_us, record_us
from mesh.errors import UserError
from mesh.layout import (
                         AXES,
                         MeshConfigError,
                         axis_sizes,
                         hybrid_device_order,
                         hybrid_devices,
                         make_mesh,
                         resolve_axis_sizes,
                         use_cpu_devices,
)
from mesh.placement import axis_links
from mesh.topology import Level, Topology, TopologyError, get_topology

__all__ = ["AXES", "Level", "MeshConfigError", "Topology", "TopologyError", "UserError", "axis_links",
           "axis_sizes", "bus_factor", "collectives", "cost", "get_topology", "hlo", "hybrid_device_order",
           "hybrid_devices", "make_mesh", "placement", "predict_us", "record_us", "resolve_axis_sizes", "topology",
           "use_cpu_devices"]
