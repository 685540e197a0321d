"""What a run's optimizer state costs where it lives off the devices (config.optimizer.master_tier,
mu_tier, nu_tier; training/tiers.py updates it): the bytes each tier holds, the traffic each step
moves, and the time the time model charges for it.

The engine updates each distinct shard on the first device of its node that holds it (a node is
a process of a multi-node job), a group at a time, with the next group's read and the last one's
write in flight while one updates. So a step's update takes as long as its slowest stream:
the busiest device's PCIe link (its shards of every kind off the devices read and written back, at
the GPU's host_bandwidth each way and host_duplex_bandwidth both ways together), or a node's NVMe
drives (the kinds on nvme:, read and written, at NVME_BANDWIDTH); it follows the compiled step, so
it adds to the step's time. The first group's read is not hidden: GROUP_BYTES at the slower rate.
"""

import dataclasses
import math

import jax

# The state a group of the update holds (master weights and both moments, fp32): large enough that
# NVMe reads and writes are long and sequential (a stacked leaf's rows are contiguous in its file),
# small enough that two groups in flight and one updating are a small share of a device's memory.
GROUP_BYTES = 1 << 30
# A node's NVMe drives, reads and writes sharing them: a DGX node's RAID of local NVMe drives
# carries about 25 GB/s (ZeRO-Infinity, Rajbhandari et al. 2021, on a DGX-2), against 3–7 GB/s
# for one drive. What a machine's own drives reach is `python -m benchmarks.nvme --dir=DIR`'s.
NVME_BANDWIDTH = 25e9
KINDS = {'master': 'master_tier', 'mu': 'mu_tier', 'nu': 'nu_tier'}


@dataclasses.dataclass(frozen=True)
class TierCost:
  placement: dict  # {'master': 'device' | 'host' | 'nvme:DIR', 'mu': …, 'nu': …}
  owned_bytes: int  # one kind's bytes the busiest device updates (its distinct shards)
  node_bytes: int  # and the busiest node
  host_bytes_per_node: int  # what a node's host memory holds of the state (the kinds on host)
  nvme_bytes_per_node: int  # what a node's NVMe directory holds (the kinds on nvme:), all of
                            # which each step reads and writes back
  pcie_bytes: int  # the busiest device's reads from the host each step (as many written back)
  group_bytes: int  # GROUP_BYTES: a device's share of one group, three of which may be live
  update_s: float | None  # what the update adds to the step (None: no GPU to charge it at)
  pcie_s: float | None
  nvme_s: float | None


def cost(opt_config, params, devices, gpu, gpus_per_node: int) -> TierCost | None:
  """The tiers' cost of config.optimizer (`opt_config`) for a state whose parameters are
  `params` (abstract, in the shardings a checkpoint holds them in) on `devices`, `gpu`s
  (planning.gpus.GPU, or None where the time model does not describe them); None where the state
  is on the devices."""
  opt = opt_config
  placement = {kind: getattr(opt, setting) for kind, setting in KINDS.items()}
  off = [kind for kind, tier in placement.items() if tier != 'device']
  if not off:
    return None
  owned = owned_bytes(params, list(devices), gpus_per_node)
  busiest = max(owned.values())
  per_node = {}
  for device, size in owned.items():
    per_node[device // gpus_per_node] = per_node.get(device // gpus_per_node, 0) + size
  node = max(per_node.values())
  on = lambda tier: sum(1 for kind in off if placement[kind].split(':')[0] == tier)
  pcie = busiest * len(off)  # each way
  nvme = node * on('nvme')  # each way
  if gpu is None:
    pcie_s = nvme_s = update_s = None
  else:
    pcie_s = max(pcie / gpu.host_bandwidth, 2 * pcie / gpu.host_duplex_bandwidth)
    nvme_s = 2 * nvme / NVME_BANDWIDTH
    first_group = GROUP_BYTES * (busiest / node if node else 0)
    update_s = max(pcie_s, nvme_s) + first_group / gpu.host_bandwidth
  return TierCost(placement=placement, owned_bytes=busiest, node_bytes=node,
                  host_bytes_per_node=node * on('host'), nvme_bytes_per_node=nvme,
                  pcie_bytes=pcie, group_bytes=GROUP_BYTES, update_s=update_s, pcie_s=pcie_s,
                  nvme_s=nvme_s)


def distinct_shards(devices_indices: dict, order: dict, node_of=lambda device: 0) -> list:
  """[(index, holders)]: each distinct shard of an array among `devices_indices` (a sharding's
  {device: index}), once a node (each node keeps its own copy), with the devices holding it in
  `order` ({device: place in the mesh}): the first updates it (training/tiers.py)."""
  held = {}
  for device, index in devices_indices.items():
    key = (node_of(device), tuple((s.start, s.stop, s.step) for s in index))
    held.setdefault(key, (index, []))[1].append(device)
  return [(index, tuple(sorted(holders, key=order.get))) for index, holders in held.values()]


def owned_bytes(abstract_params, devices: list, gpus_per_node: int) -> dict[int, int]:
  """{device's place in `devices` (the mesh's order, whose runs of gpus_per_node are nodes):
  bytes of the distinct shards it updates}: each shard on the first device of its node that holds
  it (training/tiers.py), one kind of state's worth."""
  order = {d: i for i, d in enumerate(devices)}
  owned = dict.fromkeys(order.values(), 0)
  for x in jax.tree.leaves(abstract_params):
    size = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for _, holders in distinct_shards(x.sharding.devices_indices_map(x.shape), order,
                                      lambda device: order[device] // gpus_per_node):
      owned[order[holders[0]]] += size
  return owned
