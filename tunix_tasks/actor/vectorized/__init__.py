"""`actor.kind: vectorized`: JAX environments and the policy in one jitted loop on the device.

actor.py         `VectorizedActor`: the kind's `ActorRuntime`: segments in a pipeline, groups
ondevice.py      `OnDeviceRollout`: the device loop as the kind's `RolloutEngine`
device_loop.py   the on-device program: E rows, one token per row per step, auto-reset
token_layout.py  a chat format's episode layout as constant token pieces, id <-> char codes
"""
