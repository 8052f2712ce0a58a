"""Devices for the experiments: the mesh, and what is sharded over it.

A mesh has up to four axes: ``data`` splits each batch (every device holds
all parameters it needs and sees ``B / data`` examples; gradients are summed
across ``data`` by XLA), ``seq`` (and ``ring``) split each sequence (the LM
only: its attention is ``aj.SequenceParallel``, ring or all-to-all over
``seq``, the hybrid's ring across ``ring``; every other layer is per token)
and ``model`` splits the Transformer's heads and feed-forward units
(``attention_jax.layers.sharding``). GRU models have nothing to split by
``model`` and are replicated over it. Everything else goes through JAX's
SPMD partitioner: ``jax.set_mesh``, ``NamedSharding``, parameter annotations
(``nnx.with_partitioning``); the only hand-written communication is the
sequence-parallel attention's.

Multi-host: ``initialize_distributed`` must run before anything touches
JAX's backend; each process then builds the same global batch from the seed
and contributes the rows its devices hold (``jax.make_array_from_callback``),
so the numbers do not depend on the number of hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
import os

from flax import nnx
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from experiments import config_flags

AXES = ("data", "ring", "seq", "model")
# The axes a sequence is split over, major first.
SEQUENCE_AXES = ("ring", "seq")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-host start-up (``initialize_distributed``); each field a flag."""
  distributed: bool = config_flags.field(
      False, "Multi-host: call jax.distributed.initialize() first (also done "
      "when JAX_COORDINATOR_ADDRESS is set). Without the three flags below "
      "JAX reads the cluster from its environment (TPU pod, SLURM, Open MPI).")
  coordinator_address: str | None = config_flags.field(
      None, "Multi-host: host:port of process 0.")
  num_processes: int | None = config_flags.field(
      None, "Multi-host: number of processes.", lower_bound=1)
  process_id: int | None = config_flags.field(
      None, "Multi-host: this process's index.", lower_bound=0)


def parse_mesh(spec: str) -> dict[str, int]:
  """``"data:2,model:4"`` -> ``{"data": 2, "model": 4}``.

  An empty spec means all devices on ``data``. A size of ``-1`` (at most
  one) takes the devices the other axes leave. A product below the device
  count uses the first devices (``data:1`` is a single-device run).

  Raises:
    ValueError: unknown axis names, repeated axes, sizes that are not
      positive integers, or more devices than JAX sees.
  """
  count = jax.device_count()
  if not spec.strip():
    return {"data": count}
  sizes = {}
  for part in spec.split(","):
    name, sep, size = part.strip().partition(":")
    if not sep or name not in AXES or name in sizes:
      raise ValueError(
          f"--mesh must look like 'data:2,model:4' with axes from {AXES}, "
          f"each at most once; got {spec!r}.")
    try:
      sizes[name] = int(size)
    except ValueError:
      raise ValueError(f"--mesh size of {name!r} must be an integer, got "
                       f"{size!r} in {spec!r}.") from None
    if sizes[name] == 0 or sizes[name] < -1:
      raise ValueError(f"--mesh size of {name!r} must be positive (or -1 "
                       f"for the rest), got {sizes[name]} in {spec!r}.")
  free = [n for n, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"--mesh: at most one axis may be -1, got {spec!r}.")
  known = math.prod(s for s in sizes.values() if s != -1)
  if free:
    sizes[free[0]] = count // known
  if known > count or math.prod(sizes.values()) < 1:
    raise ValueError(
        f"--mesh {spec!r} needs {known} devices, but JAX sees {count} "
        f"({jax.devices()[0].platform}). For simulated CPU devices set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N.")
  return sizes


def build_mesh(sizes: dict[str, int]) -> jax.sharding.Mesh:
  """A mesh with the axes of ``AXES`` (size 1 where not given)."""
  shape = tuple(sizes.get(a, 1) for a in AXES)
  return jax.make_mesh(shape, AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
                       devices=jax.devices()[:math.prod(shape)])


def model_axis(mesh: jax.sharding.Mesh) -> str | None:
  """``"model"`` when the mesh splits models, else None (nothing to annotate)."""
  return "model" if mesh.shape["model"] > 1 else None


def sequence_devices(mesh: jax.sharding.Mesh) -> int:
  """How many devices split each sequence (``ring * seq``)."""
  return math.prod(mesh.shape[a] for a in SEQUENCE_AXES)


def check_no_sequence_axes(mesh: jax.sharding.Mesh, experiment: str) -> None:
  """ValueError when ``mesh`` splits sequences and ``experiment`` cannot."""
  if sequence_devices(mesh) > 1:
    raise ValueError(
        f"--mesh splits sequences over {SEQUENCE_AXES} "
        f"({dict(mesh.shape)}), but {experiment} has no sequence-parallel "
        "attention: only --experiment=lm does. Use data and model axes.")


def check_batch(batch_size: int, mesh: jax.sharding.Mesh) -> None:
  data = mesh.shape["data"]
  if batch_size % data:
    raise ValueError(f"--batch_size={batch_size} must be divisible by the "
                     f"mesh's data axis ({data} devices).")


def shard_state(node, mesh: jax.sharding.Mesh) -> None:
  """Places a module's (or optimizer's) state on ``mesh`` in place.

  Annotated variables get their ``PartitionSpec``; everything else is
  replicated. Values are unchanged, so sharded and single-device runs start
  from the same numbers.
  """
  state = nnx.state(node)
  shardings = nnx.get_named_sharding(state, mesh)
  nnx.update(node, jax.device_put(state, shardings))


def shard_batch(arrays: Sequence[np.ndarray], mesh: jax.sharding.Mesh):
  """Global host arrays -> arrays split over ``data`` along axis 0 (and
  ``[B, T, ...]`` arrays over the sequence axes along axis 1, when the
  mesh splits sequences).

  Works on one host or many: each process supplies the rows of the global
  array that its own devices hold.
  """
  out = []
  split_seq = sequence_devices(mesh) > 1
  for x in arrays:
    x = np.asarray(x)
    rest = [None] * (x.ndim - 1)
    if split_seq and rest:
      rest[0] = SEQUENCE_AXES
    spec = PartitionSpec("data", *rest)
    sharding = NamedSharding(mesh, spec)
    out.append(jax.make_array_from_callback(x.shape, sharding,
                                            lambda index, x=x: x[index]))
  return tuple(out)


def initialize_distributed(config: DistributedConfig) -> None:
  """Starts multi-host JAX if asked; call before any JAX work.

  Calls ``jax.distributed.initialize`` when ``config.distributed`` is set or
  ``JAX_COORDINATOR_ADDRESS`` is (a launcher's environment). Without
  addresses in ``config`` JAX reads the cluster from the environment (TPU
  pods, SLURM, Open MPI, or ``JAX_COORDINATOR_ADDRESS``/
  ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``).
  """
  if not (config.distributed or os.environ.get("JAX_COORDINATOR_ADDRESS")):
    return
  jax.distributed.initialize(coordinator_address=config.coordinator_address,
                             num_processes=config.num_processes,
                             process_id=config.process_id)
