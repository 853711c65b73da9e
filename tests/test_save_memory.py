"""A partial-offload save writes the live parts of the slice: it allocates no second copy.

The counter sees every tensor an ATen op creates (a concatenation, a copy to another
device), so the bytes a save allocates are measured, not assumed; the checkpoint written
from the parts loads at any offload fraction exactly.
"""

import torch
from test_offload_fraction import _single, _train
from torch.utils._python_dispatch import TorchDispatchMode

from mp_offload.checkpoint import on_disk as fmt


class AllocatedBytes(TorchDispatchMode):
    """Bytes of the new storages the ops run under it create (outputs that are no input's)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_partial_offload_save_allocates_less_than_a_bucket(tmp_path):
    model, opt = _single(0.5, bucket=2000)
    _train(model, opt, 2)
    assert opt.device_side is not None and opt.host_side.numel > 0
    path = str(tmp_path / "optim.pt")
    with AllocatedBytes() as counted:
        fmt.write_file(opt.state_dict(), path)
    bucket = 4 * 2000
    assert counted.bytes <= bucket, f"a save allocated {counted.bytes} B, a bucket is {bucket}"
    # Read back at every split the run can take: the slice is the one saved, exactly.
    saved = torch.load(path, weights_only=True)
    want = {  # the slice in order: the host part, then the device share (the last buckets)
        k: torch.cat([opt.host_side.parts(k), opt.device_side.parts(k)])
        for k in ("master", "exp_avg")
    }
    # and the format-2 form (each key one whole tensor) still loads into a split run
    old = dict(saved, **{k: torch.cat(saved[k]) for k in ("master", "exp_avg", "exp_avg_sq")})
    for fraction, state in ((0.0, saved), (0.25, saved), (0.5, saved), (1.0, saved), (0.5, old)):
        _, other = _single(fraction, bucket=2000)
        other.load_state_dict(state)
        for key in ("master", "exp_avg"):
            got = torch.cat([side.parts(key) for side in other.sides])
            assert torch.equal(got, want[key]), (fraction, key)


def test_saved_range_reads_across_parts():
    whole = torch.arange(10.0)
    parts = [whole[:4], whole[4:4], whole[4:]]
    for lo in range(10):
        for n in range(1, 11 - lo):
            assert torch.equal(fmt.saved_range(parts, lo, n), whole[lo : lo + n])
    assert fmt.saved_range(parts, 5, 3).data_ptr() == whole[5:].data_ptr()  # a view
    assert torch.equal(fmt.saved_range(whole, 2, 3), whole[2:5])
