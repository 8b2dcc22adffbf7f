"""A 64-bit checksum computed where the bytes are (CPU or GPU): `mlh64`, plus the NaN/inf check there.

    mlh64(buf)                                    # buf: flat uint8 tensor on any device -> int
    digest, bad = device_scan(buf, pieces, True)  # hash a bucket + names of its non-finite tensors
    mlh64_reference(data: bytes)                  # pure Python, the definition (tests compare)

xxh3 (weight_sync/checksum.py) needs the bytes on the host; the cuda_ipc transport keeps
them on the GPU, so it checksums with `mlh64`, which is a few elementwise torch ops:

    words W_0 .. W_{n-1}: the bytes as little-endian int32, sign-extended (the last zero-padded)
    chunk c = words [c*C, (c+1)*C), C = CHUNK_WORDS; two odd key tables, j < C:
        A_j = splitmix64(SEED + j) | 1,   B_j = splitmix64(SEED + C + j) | 1
    a_c = sum_j A_j * W_{c*C+j},  b_c = sum_j B_j * W_{c*C+j}       (mod 2^64: multilinear)
    S   = sum_c fmix64(fmix64(a_c + (c + 1) * GOLDEN) + b_c)        (mod 2^64: chunk order matters)
    mlh64 = fmix64(S ^ nbytes)

Odd keys make every product a bijection of its word, so changing any single word always
changes the checksum (fmix64 is a bijection too). Words are 32-bit so that a difference
never has more than 31 trailing zero bits: two changed words cancel in one lane only when
their keys agree in >= 33 low bits (about 2^-33 over the keys), in both lanes about 2^-66
(64-bit words would let any two flips of the top bit cancel). It is an integrity check
against corruption and torn copies, like xxh3, not a MAC (the admin token is the
authentication). int64 arithmetic wraps mod 2^64 in torch on CPU and CUDA alike, and sums
mod 2^64 do not depend on the reduction order, so CPU and GPU give the same value.
Temporaries stay bounded: a few chunks are multiplied at a time. One host sync per call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weight_sync.checksum import Piece

ALGO = "mlh64"
CHUNK_WORDS = 1 << 16  # words per chunk: the key table (512 KiB of int64)
SEED = 0x9E3779B97F4A7C15
GOLDEN = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1
_FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)
_SPLITMIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_KEYS: dict[torch.device, torch.Tensor] = {}


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as unsigned `x`."""
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 `x` by `s` bits (torch's >> is arithmetic on signed types)."""
    return torch.bitwise_and(torch.bitwise_right_shift(x, s), (1 << (64 - s)) - 1)


def _fmix(x: torch.Tensor, consts: tuple[int, int], shifts: tuple[int, int, int]) -> torch.Tensor:
    x = x ^ _srl(x, shifts[0])
    x = x * _signed(consts[0])
    x = x ^ _srl(x, shifts[1])
    x = x * _signed(consts[1])
    return x ^ _srl(x, shifts[2])


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer (a bijection) on int64 tensors."""
    return _fmix(x, _FMIX, (33, 33, 33))


def keys(device: torch.device) -> torch.Tensor:
    """The two tables of CHUNK_WORDS odd keys: int64 [2, CHUNK_WORDS], computed once per device."""
    k = _KEYS.get(device)
    if k is None:
        j = torch.arange(2 * CHUNK_WORDS, dtype=torch.int64) + _signed(SEED)
        k = _fmix(j, _SPLITMIX, (30, 27, 31)) | 1  # splitmix64's output function
        k = _KEYS[device] = k.view(2, CHUNK_WORDS).to(device)
    return k


def _words(buf: torch.Tensor) -> torch.Tensor:
    """`buf` ([nbytes] uint8) as int32 words, the last one zero-padded (a view when aligned)."""
    n = buf.numel()
    if n % 4 == 0 and buf.data_ptr() % 4 == 0:
        return buf.view(torch.int32)
    padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=buf.device)
    padded[:n].copy_(buf)
    return padded.view(torch.int32)


def _group_chunks(device: torch.device) -> int:
    return 32 if device.type == "cuda" else 2  # chunks multiplied at once: 32 MiB / 2 MiB of int64 temporaries


def _partials(words: torch.Tensor) -> torch.Tensor:
    """(a_c, b_c) of every chunk: int64 [num_chunks, 2] on the words' device."""
    k = keys(words.device)
    n = words.numel()
    nfull = n // CHUNK_WORDS
    out = torch.empty(nfull + (1 if n % CHUNK_WORDS else 0), 2, dtype=torch.int64, device=words.device)
    step, cuda = _group_chunks(words.device), words.device.type == "cuda"
    grid = words[: nfull * CHUNK_WORDS].view(nfull, 1, CHUNK_WORDS)
    for c in range(0, nfull, step):
        e = min(c + step, nfull)
        w = grid[c:e] if cuda else grid[c:e].to(torch.int64)  # CUDA promotes int32 inside the multiply
        out[c:e] = (w * k).sum(dim=2)  # [g, 2, C] -> [g, 2]
    if n % CHUNK_WORDS:
        rest = words[nfull * CHUNK_WORDS :].to(torch.int64)
        out[nfull] = (rest * k[:, : rest.numel()]).sum(dim=1)
    return out


def _combine(partials: torch.Tensor, nbytes: int) -> torch.Tensor:
    """fmix64(sum_c fmix64(fmix64(a_c + (c+1)*GOLDEN) + b_c) ^ nbytes), on the device (0-dim int64)."""
    c = torch.arange(1, partials.shape[0] + 1, dtype=torch.int64, device=partials.device)
    s = fmix64(fmix64(partials[:, 0] + c * _signed(GOLDEN)) + partials[:, 1]).sum()
    return fmix64(s ^ nbytes)


def _unsigned(x: torch.Tensor) -> int:
    return int(x.item()) & M64


def mlh64(buf: torch.Tensor) -> int:
    """mlh64 of a flat uint8 tensor on any device (one host sync)."""
    return _unsigned(_combine(_partials(_words(buf)), buf.numel()))


def device_scan(buf: torch.Tensor, pieces: Iterable[Piece], check_finite: bool = True) -> tuple[int, list[str]]:
    """mlh64 of bucket `buf` and the names of its floating pieces holding NaN/inf, computed on
    `buf`'s device with one host sync (a piece whose float32 sum is not finite is checked exactly)."""
    digest = _combine(_partials(_words(buf)), buf.numel())
    floats = [(a, b, dtype, name) for a, b, dtype, name in pieces
              if check_finite and dtype is not None and dtype.is_floating_point and b > a]
    if not floats:
        return _unsigned(digest), []
    sums = torch.stack([buf[a:b].view(dtype).sum(dtype=torch.float32) if dtype.itemsize < 4
                        else buf[a:b].view(dtype).sum().float() for a, b, dtype, _ in floats])
    flags = torch.isfinite(sums).logical_not().cpu()  # the sync: digest and flags together
    value = _unsigned(digest)
    bad = [name for (a, b, dtype, name), f in zip(floats, flags.tolist())
           if f and not bool(torch.isfinite(buf[a:b].view(dtype)).all())]
    return value, bad


# ---------------------------------------------------------------------- the definition, in Python
def _py_fmix(x: int, consts: tuple[int, int], shifts: tuple[int, int, int]) -> int:
    x &= M64
    x ^= x >> shifts[0]
    x = (x * consts[0]) & M64
    x ^= x >> shifts[1]
    x = (x * consts[1]) & M64
    return x ^ (x >> shifts[2])


def mlh64_reference(data: bytes, chunk_words: int = CHUNK_WORDS) -> int:
    """mlh64 in plain Python integers (slow; for tests on small inputs)."""
    padded = data + b"\0" * (-len(data) % 4)
    words = [int.from_bytes(padded[i : i + 4], "little", signed=True) for i in range(0, len(padded), 4)]
    total = 0
    for c, start in enumerate(range(0, len(words), chunk_words)):
        a = b = 0
        for j, w in enumerate(words[start : start + chunk_words]):
            a = (a + (_py_fmix(SEED + j, _SPLITMIX, (30, 27, 31)) | 1) * w) & M64
            b = (b + (_py_fmix(SEED + chunk_words + j, _SPLITMIX, (30, 27, 31)) | 1) * w) & M64
        inner = _py_fmix(a + (c + 1) * GOLDEN, _FMIX, (33, 33, 33))
        total = (total + _py_fmix(inner + b, _FMIX, (33, 33, 33))) & M64
    return _py_fmix(total ^ len(data), _FMIX, (33, 33, 33))
