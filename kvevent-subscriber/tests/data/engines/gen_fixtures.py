#!/usr/bin/env python3
"""Regenerates the engine fixtures of this folder from the engines' own publisher code.

The `.frames` files hold ZMQ messages exactly as the engines' `ZmqEventPublisher` sends them
(topic, 8-byte seq, msgpack payload). They are produced by importing only the publisher module
of the released vLLM and SGLang wheels (no torch, no GPU): the few engine-internal imports it
makes are replaced by small stand-ins, and everything that reaches the wire (the event classes,
msgspec's encoder, the publisher thread, the replay socket) is the engine's code.

Usage (needs `pip` reaching PyPI, and `msgspec` + `pyzmq` importable):

    python3 -m pip install msgspec pyzmq
    python3 gen_fixtures.py            # downloads the wheels with `pip download --no-deps`
    python3 gen_fixtures.py --vllm-wheel W1.whl --sglang-wheel W2.whl --vllm-legacy-wheel W3.whl

Each message is read back twice, live through a SUB socket and through the engine's replay
socket; the script fails unless both are byte-identical. Output is deterministic (fixed
timestamps and hashes), so a regeneration with the same versions leaves the files unchanged.
The tests never run this script: CI has no pip packages, it only reads the checked-in files.
"""

import argparse
import glob
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
import zipfile

VLLM_VERSION = "0.34.0"
VLLM_LEGACY_VERSION = "0.9.0"  # the legacy tagged-array event form
SGLANG_VERSION = "0.5.23"
HERE = os.path.dirname(os.path.abspath(__file__))
TOPIC = "kv"
BS = 16


def toks(start, n_blocks, bs=BS):
    return list(range(start, start + n_blocks * bs))


def stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_module(wheel, member, name):
    """Executes one module file of a wheel as module `name`."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(member).decode("utf-8")
    mod = types.ModuleType(name)
    mod.__file__ = member
    sys.modules[name] = mod
    exec(compile(source, member, "exec"), mod.__dict__)
    return mod


def load_vllm(wheel):
    # Stand-ins for the imports of vllm/distributed/kv_events.py that pull in torch.
    for pkg in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"]:
        stub(pkg, __path__=[])

    class KVEventsConfig:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    stub("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda p: tuple(p.rsplit(":", 2)),
    )
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return load_module(wheel, "vllm/distributed/kv_events.py", "vllm.distributed.kv_events")


def load_vllm_legacy(wheel):
    for pkg in ["vllm", "vllm.config"]:
        if pkg not in sys.modules:
            stub(pkg, __path__=[])

    class KVEventsConfig:
        pass

    sys.modules["vllm.config"].KVEventsConfig = KVEventsConfig
    if "vllm.logger" not in sys.modules:
        stub("vllm.logger", init_logger=logging.getLogger)
    return load_module(wheel, "vllm/distributed/kv_events.py", "vllm_legacy_kv_events")


def vllm_legacy_batches(m):
    """vLLM 0.9.0: events and batches are positional arrays, no dp rank, no medium."""
    S = m.BlockStored
    b = [
        ("base prompt 1000.., 4 blocks, parent nil", [
            S(block_hashes=[0x11, 0x12, 0x13, 15_760_518_052_499_183_552],
              parent_block_hash=None, token_ids=toks(1000, 4), block_size=BS, lora_id=None),
        ]),
        ("one more block chained on the last one", [
            S(block_hashes=[0x15], parent_block_hash=15_760_518_052_499_183_552,
              token_ids=toks(1064, 1), block_size=BS, lora_id=None),
        ]),
        ("LoRA number 1 (no name in this version): prompt 2000..", [
            S(block_hashes=[0x21, 0x22, 0x23, 0x24], parent_block_hash=None,
              token_ids=toks(2000, 4), block_size=BS, lora_id=1),
        ]),
        ("the chained block removed", [m.BlockRemoved(block_hashes=[0x15])]),
        ("AllBlocksCleared", [m.AllBlocksCleared()]),
    ]
    return [(c, m.KVEventBatch(ts=1_789_095_700.0 + i, events=e)) for i, (c, e) in enumerate(b)]


def load_sglang(wheel):
    for pkg in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"]:
        stub(pkg, __path__=[])

    class BaseModel:  # only KVEventsConfig uses it; never instantiated here
        pass

    stub("pydantic", BaseModel=BaseModel)
    stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    stub("sglang.srt.utils.network", NetworkAddress=object)
    return load_module(
        wheel, "sglang/srt/disaggregation/kv_events.py", "sglang.srt.disaggregation.kv_events"
    )


def vllm_batches(m):
    """(comment, KVEventBatch) in publish order; seq = index."""
    S = m.BlockStored
    R = m.BlockRemoved
    full = dict(group_idx=0, kv_cache_spec_kind="full_attention")
    base = [0x1111, 0x2222, 15_760_518_052_499_183_552, 0x4444]  # one ≥ 2^63
    lora = [0x5101, 0x5102, 0x5103, 0x5104]
    b = []
    b.append(("base prompt 1000.., 4 GPU blocks, uint64 hashes (one >= 2^63)", [
        S(block_hashes=base, parent_block_hash=None, token_ids=toks(1000, 4), block_size=BS,
          lora_id=None, medium="GPU", lora_name=None, **full),
    ]))
    b.append(("LoRA sql-lora (lora_id 1) prompt 2000.., adapter name in every block's extra_keys", [
        S(block_hashes=lora, parent_block_hash=None, token_ids=toks(2000, 4), block_size=BS,
          lora_id=1, medium="GPU", lora_name="sql-lora",
          extra_keys=[("sql-lora",)] * 4, **full),
    ]))
    b.append(("LoRA chat-lora (lora_id 7, unmapped number) prompt 2500.., by name", [
        S(block_hashes=[0x5701, 0x5702, 0x5703, 0x5704], parent_block_hash=None,
          token_ids=toks(2500, 4), block_size=BS, lora_id=7, medium="GPU",
          lora_name="chat-lora", extra_keys=[("chat-lora",)] * 4, **full),
    ]))
    b.append(("salted prompt 3000.. (cache_salt on block 0)", [
        S(block_hashes=[0x6001, 0x6002, 0x6003, 0x6004], parent_block_hash=None,
          token_ids=toks(3000, 4), block_size=BS, lora_id=None, medium="GPU", lora_name=None,
          extra_keys=[("salt-1",), None, None, None], **full),
    ]))
    b.append(("salted LoRA prompt 4000.. (name, then salt on block 0)", [
        S(block_hashes=[0x7001, 0x7002, 0x7003, 0x7004], parent_block_hash=None,
          token_ids=toks(4000, 4), block_size=BS, lora_id=1, medium="GPU",
          lora_name="sql-lora",
          extra_keys=[("sql-lora", "salt-2")] + [("sql-lora",)] * 3, **full),
    ]))
    b.append(("multimodal prompt 5000.. (image hash pair in block 1)", [
        S(block_hashes=[0x8001, 0x8002, 0x8003, 0x8004], parent_block_hash=None,
          token_ids=toks(5000, 4), block_size=BS, lora_id=None, medium="GPU", lora_name=None,
          extra_keys=[None, (("img-0", 16),), None, None], **full),
    ]))
    b.append(("hybrid: sliding-window group 1 stores 6000.. and removes the base prompt's tail", [
        S(block_hashes=[0x9001, 0x9002, 0x9003, 0x9004], parent_block_hash=None,
          token_ids=toks(6000, 4), block_size=BS, lora_id=None, medium="GPU", lora_name=None,
          group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32),
        R(block_hashes=base[2:], medium="GPU", group_idx=1),
    ]))
    b.append(("offload: CPU placeholders (no tokens) of the LoRA prompt's tail, then GPU removal", [
        S(block_hashes=[lora[2]], parent_block_hash=None, token_ids=[], block_size=0,
          lora_id=None, medium="CPU", lora_name=None, group_idx=0),
        S(block_hashes=[lora[3]], parent_block_hash=None, token_ids=[], block_size=0,
          lora_id=None, medium="CPU", lora_name=None, group_idx=0),
        R(block_hashes=lora[2:], medium="GPU", group_idx=0),
    ]))
    h32 = [bytes([i]) * 32 for i in (0xA1, 0xA2, 0xA3)]
    b.append(("32-byte hashes: prompt 7000.. as a root of 2 blocks", [
        S(block_hashes=h32[:2], parent_block_hash=None, token_ids=toks(7000, 2), block_size=BS,
          lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], **full),
    ]))
    b.append(("32-byte hashes: 2 more blocks chained on the previous event's last block", [
        S(block_hashes=[h32[2], bytes([0xA4]) * 32], parent_block_hash=h32[1],
          token_ids=toks(7032, 2), block_size=BS, lora_id=None, medium="GPU", lora_name=None,
          **full),
    ]))
    b.append(("base prompt removed on GPU (group 0): the match shrinks", [
        R(block_hashes=base[3:], medium="GPU", group_idx=0),
    ]))
    b.append(("AllBlocksCleared", [m.AllBlocksCleared()]))
    return [(c, m.KVEventBatch(ts=1_789_095_808.0 + i, events=e)) for i, (c, e) in enumerate(b)]


def sglang_batches(m):
    S = m.BlockStored
    R = m.BlockRemoved
    base = [-0x1122334455667788, 0x2111, -2, 0x2333]  # signed 64-bit
    b = []
    b.append(("base prompt 11000.., 4 GPU blocks, negative int64 hashes", [
        S(block_hashes=base, parent_block_hash=None, token_ids=toks(11000, 4), block_size=BS,
          lora_id=None, medium="GPU"),
    ]))
    b.append(("LoRA by name only (lora_id null): prompt 12000..", [
        S(block_hashes=[0x3101, 0x3102, 0x3103, 0x3104], parent_block_hash=None,
          token_ids=toks(12000, 4), block_size=BS, lora_id=None, medium="GPU",
          lora_name="sql-lora"),
    ]))
    b.append(("cache_salt prompt 13000..", [
        S(block_hashes=[0x4101, 0x4102, 0x4103, 0x4104], parent_block_hash=None,
          token_ids=toks(13000, 4), block_size=BS, lora_id=None, medium="GPU",
          cache_salt="tenant-salt"),
    ]))
    b.append(("offload: CPU_PINNED copy of the base prompt's tail, then GPU removal", [
        S(block_hashes=base[2:], parent_block_hash=base[1], token_ids=toks(11032, 2),
          block_size=BS, lora_id=None, medium="CPU_PINNED"),
        R(block_hashes=base[2:], medium="GPU"),
    ]))
    b.append(("DISK tier: prompt 14000.. stored only on disk", [
        S(block_hashes=[0x5101, 0x5102, 0x5103, 0x5104], parent_block_hash=None,
          token_ids=toks(14000, 4), block_size=BS, lora_id=None, medium="DISK"),
    ]))
    b.append(("AllBlocksCleared", [m.AllBlocksCleared()]))
    return [(c, m.KVEventBatch(ts=1_789_095_900.0 + i, events=e)) for i, (c, e) in enumerate(b)]


def capture(mod, make_publisher, batches, rank):
    """Publishes through the engine's publisher; returns [(comment, topic, seq, payload)]."""
    import zmq

    ctx = zmq.Context.instance()

    def free_port():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    port, replay_port = free_port(), free_port()
    # The engine binds (`*`, its default) and adds the data-parallel rank to both ports.
    pub = make_publisher(
        endpoint=f"tcp://*:{port - rank}",
        replay_endpoint=f"tcp://*:{replay_port - rank}",
        topic=TOPIC,
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(1.0)  # the PUB side learns the subscription
    for _, batch in batches:
        pub.publish(batch)
    live = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while len(live) < len(batches) and poller.poll(5000):
        live.append(sub.recv_multipart())
    assert len(live) == len(batches), f"live: got {len(live)} of {len(batches)}"
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while dealer.poll(5000):
        frames = dealer.recv_multipart()[1:]  # drop the REQ-style empty delimiter
        if frames[-2] == b"\xff" * 8:
            break
        replayed.append(frames)
    # Older engines reply [seq, payload] without the topic; seq and payload must match.
    assert [f[-2:] for f in replayed] == [f[-2:] for f in live], "replay differs from live"
    pub.shutdown()
    for s in (sub, dealer):
        s.close(linger=0)
    return [(c, *f) for (c, _), f in zip(batches, live)]


def write(path, header, rows):
    with open(path, "w") as f:
        f.write(header)
        for comment, topic, seq, payload in rows:
            f.write(f"# seq {int.from_bytes(seq, 'big')}: {comment}\n")
            f.write(f"{topic.hex()} {seq.hex()} {payload.hex()}\n")
    print("wrote", path, len(rows), "messages")


def download(pkg, version, dest):
    subprocess.check_call(
        [sys.executable, "-m", "pip", "download", f"{pkg}=={version}", "--no-deps", "-d", dest]
    )
    return glob.glob(os.path.join(dest, f"{pkg}-{version}-*.whl"))[0]


HEADER = """# {engine} {version}: ZMQ messages from the engine's own ZmqEventPublisher.
# Generated by gen_fixtures.py in this folder; do not edit. Format: comment lines start with '#';
# every other line is one message: topic, seq and msgpack payload as hex, space-separated.
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-wheel")
    ap.add_argument("--sglang-wheel")
    ap.add_argument("--vllm-legacy-wheel")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        vw = args.vllm_wheel or download("vllm", VLLM_VERSION, tmp)
        sw = args.sglang_wheel or download("sglang", SGLANG_VERSION, tmp)
        lw = args.vllm_legacy_wheel or download("vllm", VLLM_LEGACY_VERSION, tmp)
        v = load_vllm(vw)
        rows = capture(
            v,
            lambda **kw: v.ZmqEventPublisher(data_parallel_rank=0, **kw),
            vllm_batches(v),
            0,
        )
        write(os.path.join(HERE, f"vllm-{VLLM_VERSION}.frames"),
              HEADER.format(engine="vLLM", version=VLLM_VERSION), rows)
        legacy = load_vllm_legacy(lw)
        rows = capture(legacy, legacy.ZmqEventPublisher, vllm_legacy_batches(legacy), 0)
        write(os.path.join(HERE, f"vllm-{VLLM_LEGACY_VERSION}.frames"),
              HEADER.format(engine="vLLM", version=VLLM_LEGACY_VERSION), rows)
        s = load_sglang(sw)
        rows = capture(
            s,
            lambda **kw: s.ZmqEventPublisher(attn_dp_rank=1, **kw),
            sglang_batches(s),
            1,
        )
        write(os.path.join(HERE, f"sglang-{SGLANG_VERSION}.frames"),
              HEADER.format(engine="SGLang", version=SGLANG_VERSION), rows)


if __name__ == "__main__":
    main()
