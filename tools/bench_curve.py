"""The ceiling of the transport's bulk path: raw pyzmq throughput with and without CURVE.

    python tools/bench_curve.py [--quick] [--mb 538]

Two processes on localhost, a DEALER (this process) pushing `--mb` MB in 8 MiB
messages to a ROUTER in a child that copies each into a preallocated buffer
(what `shard_receiver.ShardReceiver` does), once in clear (ZeroMQ's NULL mechanism)
and once under CURVE (encrypted and authenticated, as the channels run).
Nothing of streamrl_jax's own code is on the path, so the ratio is what CURVE
itself costs here. Medians over `--reps`; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import zmq

CHUNK = 8 << 20


def child(port: int, curve: str, nbytes: int, reps: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if curve:
        server_secret = curve.split(",")[1].encode()
        sock.curve_server = True
        sock.curve_secretkey = server_secret
    sock.connect(f"tcp://127.0.0.1:{port}")
    dest = np.empty(nbytes, np.uint8)
    view = memoryview(dest)
    rid = sock.recv_multipart()[0]  # the hello: the DEALER's routing id
    for _ in range(reps + 1):
        got = 0
        while got < nbytes:
            chunk = sock.recv_multipart(copy=False)[-1].buffer
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        sock.send_multipart([rid, b"done"])
    sock.close(linger=1000)


def run(curve: bool, nbytes: int, reps: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    arg = ""
    if curve:
        public, secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        sock.curve_serverkey = public
        sock.curve_publickey, sock.curve_secretkey = client_public, client_secret
        arg = f"{public.decode()},{secret.decode()}"
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(port), arg, str(nbytes), str(reps)]
    )
    data = np.ones(nbytes, np.uint8)
    view = memoryview(data)
    sock.send(b"hello")  # the ROUTER learns our routing id from it
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for start in range(0, nbytes, CHUNK):
            sock.send(view[start : start + CHUNK], copy=False)
        while sock.recv() != b"done":
            pass
        times.append(time.perf_counter() - t0)
    proc.wait(60)
    sock.close(linger=0)
    return float(statistics.median(times[1:]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        port, curve, nbytes, reps = sys.argv[2:6]
        return child(int(port), curve, int(nbytes), int(reps))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--mb", type=float, default=538.06)
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 10)
    nbytes = int(args.mb * 1e6)
    out = {"bench": "curve", "bytes": nbytes, "reps": reps, "load": os.getloadavg()[0]}
    for name, curve in (("null", False), ("curve", True)):
        seconds = run(curve, nbytes, reps)
        out[f"{name}_s"], out[f"{name}_gbps"] = seconds, nbytes / seconds / 1e9
        print(f"{name}: {seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s)", flush=True)
    out["curve_over_null"] = out["curve_s"] / out["null_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
