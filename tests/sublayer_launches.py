"""The check every one-launch sublayer test runs (KDA, DeepSeek-V4 attention; the PyVM on the CPU,
the megakernel on the GPU): several launches, each against the model's reference on the same
inputs, the output poisoned before each, the caches the sublayer updates in place carried from
launch to launch (the next launch starts from what this one wrote, not from the reference's).

Imported as `from sublayer_launches import check_launches` (tests/ is on sys.path: pytest puts
the folder of tests/conftest.py there, also for the tests under tests/gpu)."""


def check_launches(tensors, run, inputs, reference, caches, err, what="", launches=2,
                   out_tol=2e-2, cache_tol=1e-2, reference_after_run=False, out=("resid", "x"),
                   outputs=(), poison=("resid",)):
    """tensors: the runtime's buffers by name; run(launch): one launch; inputs(launch): that
    launch's fresh inputs (caches included: the carried ones replace them); reference(inputs) ->
    {"resid": x + sublayer(x), cache name: updated cache}; err(got, want): relative error.
    The residual's increment (resid - x) is compared, not resid: x would hide the sublayer.
    reference_after_run: the reference is computed after the launch, from the same inputs (it
    may read what the launch decided: DeepSeek-V4 CSA's index list, checked there).
    out = (output, the input its increment is taken from): mHC sublayers ("streams", "streams":
    updated in place); `outputs`: more outputs compared whole (with out_tol); `poison`: the
    buffers NaN-filled before each launch (not an in-place output: it holds the input)."""
    carried = {}
    out_name, base_name = out
    for launch in range(launches):
        inp = dict(inputs(launch), **carried)
        want = None if reference_after_run else reference(inp)
        for name, v in inp.items():
            tensors[name].copy_(v)
        for name in poison:
            tensors[name].fill_(float("nan"))
        run(launch)
        if reference_after_run:
            want = reference(inp)
        x = inp[base_name].float()
        e = err(tensors[out_name].float() - x, want[out_name].float() - x)
        assert e <= out_tol, f"{what}launch {launch}: sublayer output rel err {e:.3e}"
        for name in outputs:
            e = err(tensors[name], want[name])
            assert e <= out_tol, f"{what}launch {launch}: {name} rel err {e:.3e}"
        for name in caches:
            e = err(tensors[name], want[name])
            assert e <= cache_tol, f"{what}launch {launch}: {name} rel err {e:.3e}"
        carried = {n: tensors[n].clone() for n in caches}
