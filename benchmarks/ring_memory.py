"""Ring attention's per-device memory: ``python -m benchmarks.ring_memory``.

For each sequence length, compiles forward+backward (gradients of q, k, v)
of: dense attention on one device (the lesson's formula), blockwise attention
on one device, and ``ring_attention`` with the sequence split over
``--devices`` simulated CPU devices, and reports XLA's own accounting of each
program's per-device memory (``compiled.memory_analysis()``: arguments +
outputs + temporaries). Nothing runs, so lengths far beyond this machine's
RAM are fine. Writes ``ring_memory.md`` and ``ring_memory.json`` to ``--out``.

Layout: ``[B, N, T, H]``, T = S, causal (a decoder's self-attention).
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags
from absl import logging
import jax

_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated devices on the ring.",
                                lower_bound=2)
_LENGTHS = flags.DEFINE_list("lengths", ["8192", "32768", "131072"],
                             "Global sequence lengths T = S.")
_HEADS = flags.DEFINE_integer("heads", 8, "N (B = 1, H = 64).", lower_bound=1)
_OUT = flags.DEFINE_string("out", "runs/benchmark", "Output directory.")


def _bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes +
          m.temp_size_in_bytes - m.alias_size_in_bytes)


def _grad(fn):
  return jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), (0, 1, 2)))


def measure(length: int, heads: int, devices: int) -> dict:
  import jax.numpy as jnp  # noqa: PLC0415 - after the device count is set
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import attention_jax as aj  # noqa: PLC0415

  shape = jax.ShapeDtypeStruct((1, heads, length, 64), jnp.float32)
  row = {"T": length, "heads": heads, "devices": devices}
  dense = _grad(lambda q, k, v: aj.scaled_dot_product_attention(
      q, k, v, is_causal=True, implementation="dense"))
  row["dense_1dev"] = _bytes(dense.lower(shape, shape, shape).compile())
  blockwise = _grad(lambda q, k, v: aj.blockwise_attention(
      q, k, v, is_causal=True))
  row["blockwise_1dev"] = _bytes(blockwise.lower(shape, shape,
                                                 shape).compile())
  mesh = jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))
  spec = P(None, None, "seq")
  ring = _grad(jax.shard_map(
      lambda q, k, v: aj.ring_attention(q, k, v, axis_name="seq",
                                        is_causal=True),
      mesh=mesh, in_specs=spec, out_specs=spec))
  row["ring_per_device"] = _bytes(ring.lower(shape, shape, shape).compile())
  return row


def _gib(x):
  return "-" if x is None else f"{x / 2**30:.3g}"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # hide JAX's backend probing
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  rows = [measure(int(t), _HEADS.value, _DEVICES.value)
          for t in _LENGTHS.value]
  lines = [
      f"Per-device memory (GiB) of causal attention fwd+bwd, B=1, "
      f"N={_HEADS.value}, H=64, float32, from XLA's memory_analysis; ring "
      f"over {_DEVICES.value} devices.", "",
      "| T = S | dense, 1 device | blockwise, 1 device | ring, per device | "
      "dense / ring |", "|---|---|---|---|---|"]
  for r in rows:
    dense = r["dense_1dev"]
    ratio = f"{dense / r['ring_per_device']:.0f}x"
    lines.append(f"| {r['T']} | {_gib(dense)} | {_gib(r['blockwise_1dev'])} "
                 f"| {_gib(r['ring_per_device'])} | {ratio} |")
  table = "\n".join(lines)
  print(table)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "ring_memory.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(_OUT.value, "ring_memory.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
