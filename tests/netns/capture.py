"""A passive capture of every IPv4 TCP segment that crosses the hub namespace's interfaces (each
host's veth and the bridge), reassembled per flow and direction: what anyone on the path sees."""

from __future__ import annotations

import socket
import struct
import threading
from collections import defaultdict

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800

Flow = tuple[str, int, str, int]  # source address, source port, destination address, destination port


class Capture:
    """`with Capture() as cap:` records until the block ends; then `cap.streams()`."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
        self.sock.settimeout(0.1)
        self.frames: list[bytes] = []
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        # PACKET_STATISTICS: (packets, drops) since the socket opened; a dropped frame is a hole.
        _, self.dropped = struct.unpack("II", self.sock.getsockopt(263, 6, 8))
        self.sock.close()
        return False

    def _run(self):
        while not self._stop.is_set():
            try:
                self.frames.append(self.sock.recv(65536))
            except TimeoutError:
                continue

    def streams(self) -> dict[Flow, bytes]:
        """Each flow's bytes in sequence order (a segment seen on several interfaces counts once)."""
        segments: dict[Flow, dict[int, bytes]] = defaultdict(dict)
        for f in self.frames:
            if len(f) < 34 or struct.unpack("!H", f[12:14])[0] != ETH_P_IP:
                continue
            ip = f[14:]
            ihl = (ip[0] & 0x0F) * 4
            total = struct.unpack("!H", ip[2:4])[0]
            if ip[9] != socket.IPPROTO_TCP or len(ip) < ihl + 20:
                continue
            tcp = ip[ihl:total]
            sport, dport, seq = struct.unpack("!HHI", tcp[:8])
            payload = tcp[(tcp[12] >> 4) * 4 :]
            if payload:
                flow = (socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
                seen = segments[flow].get(seq, b"")
                if len(payload) > len(seen):
                    segments[flow][seq] = payload
        out = {}
        for flow, segs in segments.items():
            # Offsets modulo 2^32 (a flow may wrap) from the sequence number after the widest gap.
            seqs = sorted(segs)
            gaps = [((seqs[(i + 1) % len(seqs)] - s) % (1 << 32), i) for i, s in enumerate(seqs)]
            base = seqs[(max(gaps)[1] + 1) % len(seqs)]
            buf = bytearray()
            for seq, data in sorted(segs.items(), key=lambda kv: (kv[0] - base) % (1 << 32)):
                off = (seq - base) % (1 << 32)
                if len(buf) < off + len(data):
                    buf.extend(b"\0" * (off + len(data) - len(buf)))
                buf[off : off + len(data)] = data
            out[flow] = bytes(buf)
        return out


def varints(values: list[int]) -> bytes:
    """Protobuf's packed encoding of `values` (a repeated uint32 field's body)."""
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)
