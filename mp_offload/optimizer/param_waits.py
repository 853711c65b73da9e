"""Where the next forward waits for a step's new params: at each module, for its own buckets.

The host buckets' new params go up on their own stream (``streams.py``), in forward order,
each with an event (``HostSide.ready``: its copy, and its all-gather behind it).
``ParamWaits`` puts a forward pre-hook on every module that holds trainable parameters:
its first call after a step makes the current stream wait for the events of its own
parameters' buckets, once. So the forward starts behind the first bucket's upload and
runs behind the rest, instead of behind every one. Anything else that reads the weights
calls ``all()`` first (``ZeroOptimizer.params_ready``: a save, ``flush``, the model's
``state_dict``); without a module (a parameter list) the step itself ends with it.
"""

from __future__ import annotations

import torch


class ParamWaits:
    def __init__(self, layout, streams, ready: dict, model: torch.nn.Module | None):
        self.streams, self.ready = streams, ready
        self.in_forward = model is not None  # else the publish waits for all (``all``)
        if model is None:
            return
        bucket_of = {id(s.param): s.bucket for s in layout.slots}
        for m in model.modules():
            mine = {bucket_of.get(id(p)) for p in m.parameters(recurse=False)} - {None}
            if mine:
                buckets = tuple(sorted(mine))
                m.register_forward_pre_hook(lambda mod, args, b=buckets: self.wait_for(b))
        model.register_state_dict_pre_hook(lambda *args: self.all())

    def wait_for(self, buckets) -> None:
        """The current stream waits for these buckets' uploads (each once per step)."""
        for b in buckets:
            event = self.ready.pop(b, None)
            if event is not None:
                self.streams.wait_upload(event)

    def all(self) -> None:
        self.wait_for(list(self.ready))
