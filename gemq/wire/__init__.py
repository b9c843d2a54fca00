"""The wire format: what a worker puts in the gradient stream and how the aggregator reads it.

| module | one job |
|---|---|
| ``codec`` | a gradient message: header and payload, encoded, decoded and validated |
| ``payload`` | a payload's elements as float32, checked finite and bounded, in one pass |
| ``halfprecision`` | float32 narrowed to the 16-bit wire types, in one pass |

The dependencies point one way: codec -> payload, halfprecision -> the base (gemq.errors,
gemq.ids, gemq.jit). Nothing here touches Redis or torch; the stream entry that carries a
message is named with the keys (gemq.state.keys).
"""
