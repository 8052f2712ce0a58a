"""Work and communication of sequence parallelism: ``python -m benchmarks.scale_out``.

Two tables on ``--devices`` simulated CPU devices (work and bytes, not
speed: simulated devices share the host's cores):

1. **Work per device.** The (query block, key block) pairs each device's
   flash walk computes at each ring step of a causal call
   (``aj.kernels.Ring``'s ``block_work``: the kernel's own key ranges), for
   the contiguous and the zigzag layout: per-device totals over the call,
   their max / min, and the worst max / min over the steps.
2. **Bytes each device sends per attention call**, read off the compiled
   HLO (``benchmarks/hlo_collectives.py``: every collective, loops counted
   by their trip counts) for the ring (contiguous and zigzag), all-to-all
   (Ulysses) and the hybrids (all-to-all inside groups, ring across), the
   forward alone and forward + backward (gradients of q, k, v), for
   multi-head (``K = N``) and grouped-query (``K < N``) keys.

Nothing runs: the programs are compiled for ``ShapeDtypeStruct`` operands,
so the lengths need no memory. Writes ``scale_out.md`` and
``scale_out.json`` to ``--out``.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags
from absl import logging
import jax

from benchmarks import hlo_collectives

_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated devices.",
                                lower_bound=2)
_LENGTH = flags.DEFINE_integer("length", 16384, "Global T = S.",
                               lower_bound=16)
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads N (B = 1, H = 64).",
                              lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2,
                                 "Key/value heads of the GQA rows.",
                                 lower_bound=1)
_BLOCK = flags.DEFINE_integer("block", 128, "Flash block size (work table).",
                              lower_bound=1)
_OUT = flags.DEFINE_string("out", "runs/benchmark", "Output directory.")


def work(length: int, devices: int, block: int) -> dict:
  """Per-layout block counts of a causal call (``[steps, devices]``)."""
  import numpy as np  # noqa: PLC0415

  import attention_jax as aj  # noqa: PLC0415
  from attention_jax.kernels import ring  # noqa: PLC0415

  out = {}
  for layout in ("contiguous", "zigzag"):
    steps = np.asarray(ring.block_work(
        aj.Mask(causal=True), length, length, devices, layout, block, block))
    totals = steps.sum(0)
    per_step = [(row.max() / row.min()) if row.min() else float("inf")
                for row in steps if row.any()]
    out[layout] = {"per_step": steps.tolist(), "totals": totals.tolist(),
                   "ratio": float(totals.max() / totals.min()),
                   "worst_step_ratio": float(max(per_step))}
  return out


def _methods(devices: int):
  """``(name, mesh shape, axis names, SequenceParallel keywords)``."""
  rows = [("ring, contiguous", (devices,), ("seq",),
           dict(method="ring", layout="contiguous")),
          ("ring, zigzag", (devices,), ("seq",),
           dict(method="ring", layout="zigzag", permuted=True)),
          ("all-to-all (Ulysses)", (devices,), ("seq",),
           dict(method="ulysses"))]
  for ring in (2, 4):
    if devices % ring == 0 and devices // ring > 1:
      rows.append((f"hybrid: ring {ring} x all-to-all {devices // ring}, "
                   "zigzag", (ring, devices // ring), ("ring", "seq"),
                   dict(method="hybrid", ring_axis="ring", layout="zigzag",
                        permuted=True)))
  return rows


def communication(length: int, heads: int, kv_heads: int,
                  devices: int) -> list[dict]:
  import jax.numpy as jnp  # noqa: PLC0415

  import attention_jax as aj  # noqa: PLC0415

  rows = []
  for name, shape, names, kw in _methods(devices):
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(
                             names))
    split = aj.SequenceParallel("seq", **kw)
    for k in (heads, kv_heads):
      q = jax.ShapeDtypeStruct((1, heads, length, 64), jnp.float32)
      kv = jax.ShapeDtypeStruct((1, k, length, 64), jnp.float32)

      def forward(q, k, v, split=split):
        return split(q, k, v, is_causal=True)

      def both(q, k, v, forward=forward):
        return jax.grad(lambda *a: forward(*a).sum(), (0, 1, 2))(q, k, v)

      row = {"method": name, "N": heads, "K": k}
      with jax.set_mesh(mesh):
        for label, fn in (("forward", forward), ("forward+backward", both)):
          text = jax.jit(fn).lower(q, kv, kv).compile().as_text()
          got = hlo_collectives.collectives(text)
          row[label] = got
      rows.append(row)
  return rows


def _mib(x: float) -> str:
  return f"{x / 2**20:.3g}"


def tables(result: dict) -> str:
  devices, length = result["devices"], result["length"]
  lines = [f"Causal work per device, T = S = {length}, blocks "
           f"{result['block']} x {result['block']}, {devices} devices "
           "(query-block x key-block pairs the flash walk computes):", "",
           "| layout | per device, over the call | max / min | worst step's "
           "max / min |", "|---|---|---|---|"]
  for layout, w in result["work"].items():
    lines.append(f"| {layout} | {', '.join(map(str, w['totals']))} | "
                 f"{w['ratio']:.2f} | {w['worst_step_ratio']:.2f} |")
  lines += ["", f"MiB each device sends per attention call (B = 1, N = "
            f"{result['heads']}, H = 64, float32, T = S = {length}, causal; "
            "read off the compiled HLO):", "",
            "| method | K | forward | forward + backward | collectives "
            "(forward) |", "|---|---|---|---|---|"]
  for r in result["communication"]:
    ops = ", ".join(f"{n} {kind}" for kind, n in sorted(
        r["forward"]["ops"].items()))
    lines.append(f"| {r['method']} | {r['K']} | "
                 f"{_mib(r['forward']['total_sent'])} | "
                 f"{_mib(r['forward+backward']['total_sent'])} | {ops} |")
  return "\n".join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # hide JAX's backend probing
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  result = {"devices": _DEVICES.value, "length": _LENGTH.value,
            "heads": _HEADS.value, "block": _BLOCK.value,
            "work": work(_LENGTH.value, _DEVICES.value, _BLOCK.value),
            "communication": communication(_LENGTH.value, _HEADS.value,
                                           _KV_HEADS.value, _DEVICES.value)}
  table = tables(result)
  print(table)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "scale_out.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(_OUT.value, "scale_out.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
