"""Sharded verify and commit across processes (``jax.distributed``), on one machine's CPUs.

A real cluster is several hosts with a few accelerators each; here several processes on one
machine stand in for the hosts, each with its own simulated CPU devices::

    python examples/multihost.py                       # 2 processes x 2 CPU devices
    python examples/multihost.py --processes 2 --devices 4

The launcher (no ``--process-id``) picks a free port on 127.0.0.1 and starts ``--processes``
copies of this script, each with ``XLA_FLAGS=--xla_force_host_platform_device_count=<devices>``
and ``JAX_PLATFORMS=cpu``; it waits for them (``--timeout``) and exits non-zero if any failed.

Each process calls ``jax.distributed.initialize`` with the coordinator at 127.0.0.1 (process 0
hosts it), so ``jax.devices()`` lists every process's devices and a mesh can span them. The mesh
puts the data axis across processes and the tensor axis within each (heads on the fast links of
one host, requests across hosts). Every process draws the same global inputs from the seed and
builds the global arrays from them (``jax.make_array_from_callback``: each process fills only its
own devices' shards); then, for both record modes, ``MeshPlan.verify`` of every layer from the
pool by slot into a tape buffer and ``MeshPlan.commit``. No step needs a collective: each
process computes its own requests' heads. Finally each process runs the unsharded functions on
one of its devices (the single-device run) and compares every shard it holds bit for bit.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def launch(args) -> int:
    with socket.socket() as s:  # a free port for the coordinator, on the loopback interface only
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}")  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--processes", str(args.processes),
                          "--devices", str(args.devices), "--port", str(port), "--seed", str(args.seed)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for i in range(args.processes)
    ]
    deadline, status = time.monotonic() + args.timeout, 0
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            print(f"process {i}: timed out after {args.timeout} s")
            status = 1
        print(out.rstrip())
        status = status or p.returncode
    print("multihost: OK" if status == 0 else f"multihost: FAILED (exit {status})")
    return status


def run(args) -> int:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                               process_id=args.process_id, initialization_timeout=120)  # fmt: skip
    import jax.numpy as jnp
    import numpy as np

    import gdn_lossless_jax as gl
    from gdn_lossless_jax import sharding
    from gdn_lossless_jax.testing.cases import Shape, commit_indices, verify_inputs
    from gdn_lossless_jax.testing import compare_bitwise

    me, P, local = jax.process_index(), jax.process_count(), jax.local_device_count()
    # Data across processes, tensor within one: device [d, t] is process d's t-th device.
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(P, local)
    plan = sharding.MeshPlan(jax.sharding.Mesh(devices, ("data", "tensor")), tensor="tensor", data="data")

    # H = 8 q/k heads (2 v-heads each) so that the tensor axis can be 2, 4 or 8; 2 requests and 4
    # slots per process.
    L, s = 2, Shape(N=2 * P, D=3, H=8, HV=16, K=16, V=16)
    S, R = 4 * P, 2 * P
    rng = np.random.default_rng(args.seed)
    pool_np = (0.5 * rng.standard_normal((L, S, s.HV, s.V, s.K))).astype(np.float32)
    layers = []
    for _ in range(L):
        x = verify_inputs(rng, s, kind="mixed")
        del x["state0"]
        layers.append({k: np.asarray(v) for k, v in x.items()})
    idx = commit_indices(args.seed, N=s.N, D=s.D, slots_in_pool=S, rows_in_tape=R, shards=P)
    tapes_np = {
        "tuples": gl.Tuples(u=rng.standard_normal((L, R, s.D, s.HV, s.V)).astype(np.float32),
                            k=rng.standard_normal((L, R, s.D, s.H, s.K)).astype(np.float32),
                            g=-np.abs(rng.standard_normal((L, R, s.D, s.HV))).astype(np.float32)),
        "snapshots": gl.Snapshots(rng.standard_normal((L, R, s.D, s.HV, s.V, s.K)).astype(np.float32)),
    }  # fmt: skip

    def global_array(x, kind):  # each process fills only the shards of its own devices
        return jax.make_array_from_callback(x.shape, plan.sharding(kind, x.ndim), lambda i: x[i])

    def global_tree(tree, kind):
        kinds = sharding.tape_kinds(tree) if kind == "tape" else jax.tree.map(lambda _: kind, tree)
        return jax.tree.map(global_array, tree, kinds)

    pool = global_array(pool_np, "pool_state")
    xs = [{k: global_array(v, sharding.ARG_KINDS["verify"][k]) for k, v in x.items()} for x in layers]
    ix = [global_array(np.asarray(a), "index") for a in idx.as_args()]
    t0 = time.perf_counter()
    results = {}
    for record, buf in tapes_np.items():
        tape, outs = global_tree(buf, "tape"), []
        for layer in range(L):
            o, tape = plan.verify(pool, **xs[layer], slots=ix[0], layer=jnp.int32(layer), tape=tape, rows=ix[4],
                                  record=record, backend="reference")  # fmt: skip
            outs.append(o)
        results[record] = (outs, tape, plan.commit(pool, tape, *ix, backend="reference"))
    sharded_s = time.perf_counter() - t0

    # The single-device run: the unsharded functions, on this process's first device.
    dev = jax.local_devices()[0]
    put = lambda t: jax.device_put(t, dev)  # noqa: E731
    args1 = [put(np.asarray(a)) for a in idx.as_args()]
    mismatches, shards = [], 0
    for record, buf in tapes_np.items():
        tape, outs = put(buf), []
        for layer in range(L):
            o, tape = gl.verify(put(pool_np), **put(layers[layer]), slots=args1[0], layer=layer, tape=tape,
                                rows=args1[4], record=record, backend="reference")  # fmt: skip
            outs.append(o)
        want = (outs, tape, gl.commit(put(pool_np), tape, *args1, backend="reference"))
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(results[record])):
            for shard in g.addressable_shards:
                report = compare_bitwise(np.asarray(w)[shard.index], np.asarray(shard.data))
                shards += 1
                if not report.equal:
                    mismatches.append(f"{record} {shard.device}: {report}")
    # Within one process, the two record modes' commits agree too (the library's claim, here sharded).
    for a, b in zip(results["tuples"][2].addressable_shards, results["snapshots"][2].addressable_shards):
        if not compare_bitwise(np.asarray(a.data), np.asarray(b.data)).equal:
            mismatches.append(f"tuple commit vs snapshot commit on {a.device}")
    mesh = " x ".join(f"{n} {a}" for a, n in plan.mesh.shape.items())
    if mismatches:
        print(f"process {me}: MISMATCH on a {mesh} mesh:\n  " + "\n  ".join(mismatches))
        return 1
    print(f"process {me} of {P}: {local} CPU devices, mesh {mesh}: verify of {L} layers and commit in both record modes "
          f"in {sharded_s:.1f} s; {shards} shards held here bit-identical to the single-device run")
    jax.distributed.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="processes (stand-ins for hosts; default 2)")
    p.add_argument("--devices", type=int, default=2, help="CPU devices per process: the tensor axis (1, 2, 4 or 8)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the launcher kills the processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.devices not in (1, 2, 4, 8) or args.processes < 1:
        p.error(f"--devices must be 1, 2, 4 or 8 (H=8 q/k heads) and --processes >= 1, got {args.devices}, "
                f"{args.processes}")  # fmt: skip
    return launch(args) if args.process_id is None else run(args)


if __name__ == "__main__":
    sys.exit(main())
