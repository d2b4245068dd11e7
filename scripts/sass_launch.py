"""Launch the commit kernels once each (after a warm-up), for Nsight Compute's SASS view.

Run under ncu by ``scripts/gpu_session.sh sass``: the Pallas replay and scatter and the triton
backend's, 30 layers at 25 x 4, each backend's default ``CommitConfig``. ncu keeps the SASS of
every kernel it profiles; its source page prints it (``--page source --print-source sass``),
which is how the binary XLA builds for a Pallas kernel can be read (XLA's dump does not
write it).
"""

import jax
from variants import commit_case

from gdn_lossless_jax import backends

pool, tup, snp, idx = commit_case(25, 4)
for b in ("pallas", "triton"):
    mod = backends.resolve(b, "commit")
    for name, tape in (("replay", tup), ("scatter", snp)):
        f = jax.jit(lambda pool, tape, mod=mod: mod.commit(pool, tape, *idx), donate_argnums=0)
        pool = jax.block_until_ready(f(pool, tape))  # compile + warm-up
        pool = jax.block_until_ready(f(pool, tape))
        print("launched", b, name, flush=True)
