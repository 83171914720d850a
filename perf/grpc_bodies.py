#!/usr/bin/env python3
"""Writes gRPC-framed request bodies for h2load (perf/h2load_lookup.sh): a ReportCacheState
stream that gives REPLICAS replicas a BLOCKS-block chain each, a LookupRoute for that chain
(lookup.bin), and a LookupRoute carrying BLOCKS x 16 token ids instead (lookup_tokens.bin, the
server fingerprints them). Protobuf is encoded by hand (a few fields), so this needs nothing
beyond Python 3. MODEL (default "m") names the model, for picking a partition's owner core.

Usage: perf/grpc_bodies.py <out-dir> [blocks] [replicas]
"""
import os
import hashlib
import struct
import sys


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def s(num, text):
    return field(num, 2, text.encode() if isinstance(text, str) else text)


def i(num, value):
    return field(num, 0, varint(value))


def grpc_frame(msg):
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def main():
    out = sys.argv[1]
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    replicas = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    hashes = [hashlib.sha256(b"block-%d" % j).digest()[:8] for j in range(blocks)]
    model, tenant, scheme = os.environ.get("MODEL", "m"), "t", "vllm-sha256-v1"
    updates = b""
    for r in range(replicas):
        # Replica r holds the first blocks - 4*r blocks, so the ranking is not a tie.
        held = hashes[: max(1, blocks - 4 * r)]
        entry = b"".join(s(3, h) for h in held) + b"".join(i(4, 16) for _ in held)
        update = s(1, f"replica-{r}") + s(2, model) + s(3, tenant) + s(4, scheme) + s(6, entry)
        updates += grpc_frame(update)
    lookup = s(1, model) + s(2, tenant) + s(5, scheme)
    lookup += b"".join(s(7, h) for h in hashes) + b"".join(i(8, 16) for _ in hashes)
    open(f"{out}/report.bin", "wb").write(updates)
    open(f"{out}/lookup.bin", "wb").write(grpc_frame(lookup))
    tokens = b"".join(varint(t) for t in range(blocks * 16))
    lookup_tokens = s(1, model) + s(2, tenant) + s(5, scheme) + s(9, tokens)
    open(f"{out}/lookup_tokens.bin", "wb").write(grpc_frame(lookup_tokens))


if __name__ == "__main__":
    main()
