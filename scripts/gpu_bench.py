"""Times all_gather(x) @ w and psum_scatter(x @ w) over all local GPUs:
commfuse's fused ops vs XLA's collective + dot. Run it once plainly and once
with XLA's windowed einsum enabled in XLA_FLAGS (scripts/gpu_check.sh does).
Prints one line per case: op, impl, shape, median ms over 20 runs."""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import commfuse

label = sys.argv[1] if len(sys.argv) > 1 else "xla"
devs = jax.devices("gpu")
n = len(devs)
mesh = jax.make_mesh((n,), ("x",), devices=devs)


def timed(f, *args):
    f(*args).block_until_ready()
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        f(*args).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


for m, k, c in [(4096, 8192, 8192), (8192, 8192, 28672)]:
    x = jax.device_put(jnp.ones((n * m // n, k), jnp.bfloat16), NamedSharding(mesh, P("x")))
    w = jax.device_put(jnp.ones((k, c // n), jnp.bfloat16), NamedSharding(mesh, P(None, "x")))
    cases = {
        "ag_matmul": (lambda a, b: jax.lax.all_gather(a, "x", tiled=True) @ b,
                      lambda a, b: commfuse.all_gather_matmul(a, b, "x"), P(None, "x")),
    }
    for op, (unfused, fused, out) in cases.items():
        impls = {label: unfused} if label != "xla" else {"xla": unfused, "commfuse": fused}
        for impl, body in impls.items():
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=out))
            try:
                print(f"{op:12} {impl:16} m={m} k={k} n={c} n_gpu={n}: {timed(f, x, w):8.3f} ms", flush=True)
            except Exception as e:  # the CUDA handler may be unimplemented: say so, go on
                print(f"{op:12} {impl:16} m={m} k={k} n={c}: FAILED: {str(e).splitlines()[0]}", flush=True)
    xr = jax.device_put(jnp.ones((m, k // n), jnp.bfloat16), NamedSharding(mesh, P(None, "x")))
    wr = jax.device_put(jnp.ones((k, c), jnp.bfloat16), NamedSharding(mesh, P("x")))
    rs_unfused = lambda a, b: jax.lax.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True)
    rs_fused = lambda a, b: commfuse.matmul_reduce_scatter(a, b, "x")
    impls = {label: rs_unfused} if label != "xla" else {"xla": rs_unfused, "commfuse": rs_fused}
    for impl, body in impls.items():
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
        try:
            print(f"{'matmul_rs':12} {impl:16} m={m} k={k} n={c} n_gpu={n}: {timed(f, xr, wr):8.3f} ms", flush=True)
        except Exception as e:
            print(f"{'matmul_rs':12} {impl:16} m={m} k={k} n={c}: FAILED: {str(e).splitlines()[0]}", flush=True)
