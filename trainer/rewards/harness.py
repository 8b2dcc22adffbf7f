"""The script that runs INSIDE a code-reward sandbox (standard library only, never imported by the
trainer at run time: `sandbox.py` copies this file into the sandbox).

    python -I -S harness.py JOB.json

JOB is `{"role": ..., "rlimits": {...}, ...}`; the harness sets the resource limits first, then:

- `solution` (untrusted): runs `job["code"]` and serves its globals over two pipes (`rfd`, `wfd`):
  plain values (numbers, strings, bytes, containers of them) travel by value, anything else as
  a handle that the peer can call, index, iterate or read attributes of.
- `tests` (trusted tests, separate sandbox): binds every global of the solution to a proxy,
  runs `job["steps"]` (setup and test snippets) and writes `"<index> <0|1>"` per test to
  `job["out_fd"]`. The solution never runs here, so it cannot forge this report; it can only
  return values, and a value never brings its own `__eq__` across.
- `stdio`: runs `job["code"]` as `__main__` with the sandbox's stdin/stdout (the trainer
  compares the output outside).
"""

import builtins
import json
import os
import resource
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

_PLAIN_SCALARS = (type(None), bool, int, str)
_COLLECTION_TAGS: dict[type, str] = {tuple: "t", set: "s", frozenset: "fs"}
_MAX_DEPTH = 64
Json: TypeAlias = "None | bool | int | float | str | list[Json] | dict[str, Json]"  # a message we write
Wire: TypeAlias = Any  # a message the other side wrote: json.loads' value, its shape checked as it is read


class RemoteError(Exception):
    """An exception raised by the solution, or a malformed message from it."""


def set_rlimits(limits: dict) -> None:
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


class Codec:
    """JSON messages: plain data by value (type-tagged), the rest as handles `{"h": id}`.
    `to_handle(obj)` / `from_handle(id)` say what a handle means on each side."""

    def __init__(self, to_handle: Callable[[object], int], from_handle: Callable[[int], object]) -> None:
        self.to_handle, self.from_handle = to_handle, from_handle

    def encode(self, x: Any, depth: int = 0) -> Json:  # Any: whatever value one side holds
        if depth > _MAX_DEPTH:
            raise ValueError("value nested too deeply")
        t, d = type(x), depth + 1
        if t in _PLAIN_SCALARS and not (t is int and abs(x) >= 1 << 4096):
            return x
        if t is float:
            return {"f": repr(x)}
        if t is complex:
            return {"c": [repr(x.real), repr(x.imag)]}
        if t is bytes:
            return {"b": x.hex()}
        if t is list:
            return [self.encode(v, d) for v in x]
        if t in _COLLECTION_TAGS:
            return {_COLLECTION_TAGS[t]: [self.encode(v, d) for v in x]}
        if t is dict:
            return {"d": [[self.encode(k, d), self.encode(v, d)] for k, v in x.items()]}
        return {"h": self.to_handle(x)}

    def decode(self, x: Wire, depth: int = 0) -> Any:  # Any: a value the other side holds
        if depth > _MAX_DEPTH:
            raise RemoteError("value nested too deeply")
        d = depth + 1
        if type(x) in _PLAIN_SCALARS:
            return x
        if type(x) is list:
            return [self.decode(v, d) for v in x]
        if type(x) is not dict or len(x) != 1:
            raise RemoteError(f"malformed value {str(x)[:80]!r}")
        (tag, v), = x.items()
        kinds = {"t": tuple, "s": set, "fs": frozenset}
        if tag == "f":
            return float(v)
        if tag == "c":
            return complex(float(v[0]), float(v[1]))
        if tag == "b":
            return bytes.fromhex(v)
        if tag in kinds:
            return kinds[tag](self.decode(i, d) for i in v)
        if tag == "d":
            return {self.decode(k, d): self.decode(i, d) for k, i in v}
        if tag == "h" and type(v) is int:
            return self.from_handle(v)
        raise RemoteError(f"malformed value {str(x)[:80]!r}")


class Pipe:
    """Newline-delimited JSON over a pair of file descriptors."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.r, self.w = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")

    def send(self, msg: object) -> None:
        self.w.write(json.dumps(msg, allow_nan=False).encode() + b"\n")
        self.w.flush()

    def recv(self) -> Wire:
        line = self.r.readline()
        if not line:
            raise RemoteError("the solution process is gone")
        return json.loads(line)


# ------------------------------------------------------------------ solution side (untrusted)
_OPS: dict[str, Callable[..., object]] = {"len": len, "iter": iter, "next": next, "str": str, "repr": repr,
                                         "getitem": lambda o, k: o[k], "contains": lambda o, k: k in o}


def _silence_stdio() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


def run_solution(job: dict) -> None:
    pipe = Pipe(job["rfd"], job["wfd"])
    handles: list = []

    def to_handle(obj: object) -> int:
        handles.append(obj)
        return len(handles) - 1

    codec = Codec(to_handle, lambda i: handles[i])
    _silence_stdio()
    ns = {"__name__": "__solution__"}
    try:
        exec(compile(job["code"], "<solution>", "exec"), ns)
        ok = True
    except BaseException:
        ok = False
    pipe.send({"ok": ok, "names": [n for n in ns if not n.startswith("__")][:10000]})
    while True:
        req = pipe.recv()
        try:
            pipe.send({"v": codec.encode(_serve(req, ns, codec))})
        except BaseException as e:  # noqa: B036 - everything the solution raises goes back as data
            pipe.send({"e": [type(e).__name__, str(e)[:500]]})


def _serve(req: dict, ns: dict, codec: Codec) -> object:
    op = req["op"]
    if op == "get":
        return ns[req["name"]]
    target = codec.decode({"h": req["h"]})
    args = [codec.decode(a) for a in req.get("args", [])]
    if op == "call":
        return target(*args, **{k: codec.decode(v) for k, v in req.get("kwargs", {}).items()})
    if op == "attr":
        return getattr(target, req["name"])
    return _OPS[op](target, *args)


# ------------------------------------------------------------------ tests side (trusted tests)
def _builtin_exception(name: str, message: str) -> Exception:
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        return cls(message)
    return RemoteError(f"{name}: {message}")


class Client:
    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe
        self.codec = Codec(self._handle_of, lambda i: Remote(self, i))

    @staticmethod
    def _handle_of(obj: object) -> int:
        if isinstance(obj, Remote):
            return object.__getattribute__(obj, "_id")
        raise TypeError(f"{type(obj).__name__} cannot be passed to the solution")

    def request(self, **req: Any) -> Any:  # Any: the proxy hands the solution's values to the tests as they are
        if "args" in req:
            req["args"] = [self.codec.encode(a) for a in req["args"]]
        if "kwargs" in req:
            req["kwargs"] = {str(k): self.codec.encode(v) for k, v in req["kwargs"].items()}
        self.pipe.send(req)
        resp = self.pipe.recv()
        if type(resp) is dict and set(resp) == {"v"}:
            return self.codec.decode(resp["v"])
        if type(resp) is dict and set(resp) == {"e"} and [type(s) for s in resp["e"]] == [str, str]:
            raise _builtin_exception(*resp["e"])
        raise RemoteError("malformed reply from the solution")


class Remote:
    """A proxy for an object that lives in the solution's sandbox. Equality is identity: an object
    of the solution never decides whether a test passes."""

    __slots__ = ("_client", "_id")

    def __init__(self, client: Client, handle: int) -> None:
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_id", handle)

    def _op(self, op: str, *args: object, **kw: object) -> Any:
        return self._client.request(op=op, h=self._id, **kw, **({"args": list(args)} if args else {}))

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return self._client.request(op="call", h=self._id, args=list(args), kwargs=kwargs)

    def __getattr__(self, name: str) -> Any:
        return self._op("attr", name=name)

    def __getitem__(self, key: object) -> Any:
        return self._op("getitem", key)

    def __contains__(self, key: object) -> bool:
        return self._op("contains", key) is True

    def __len__(self) -> int:
        n = self._op("len")
        if type(n) is not int:
            raise TypeError("len() of the solution's object is not an int")
        return n

    def __iter__(self) -> "_RemoteIter":
        return _RemoteIter(self._op("iter"))

    def __str__(self) -> str:
        return str(self._op("str"))

    def __repr__(self) -> str:
        return str(self._op("repr"))


class _RemoteIter:
    def __init__(self, it: object) -> None:
        self.it = it

    def __iter__(self) -> "_RemoteIter":
        return self

    def __next__(self) -> Any:
        if not isinstance(self.it, Remote):
            raise TypeError("the solution's iterator is not an iterator")
        return self.it._op("next")


def run_tests(job: dict) -> None:
    out = os.fdopen(job["out_fd"], "w")
    client = Client(Pipe(job["rfd"], job["wfd"]))
    _silence_stdio()
    hello = client.pipe.recv()
    if type(hello) is not dict or hello.get("ok") is not True or type(hello.get("names")) is not list:
        return  # the solution did not load: every test fails
    ns = {"__name__": "__tests__"}
    for name in hello["names"][:10000]:
        if type(name) is str and name.isidentifier():
            try:
                ns[name] = client.request(op="get", name=name)
            except Exception:
                pass
    for index, (src, is_test) in enumerate(job["steps"]):
        try:
            exec(compile(src, f"<test {index}>", "exec"), ns)
            passed = True
        except BaseException:  # noqa: B036 - a failing test is data, whatever it raised
            passed = False
        if is_test:
            out.write(f"{index} {int(passed)}\n")
            out.flush()


def run_stdio(job: dict) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    exec(compile(job["code"], "<solution>", "exec"), {"__name__": "__main__"})


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    set_rlimits(job["rlimits"])
    {"solution": run_solution, "tests": run_tests, "stdio": run_stdio}[job["role"]](job)


if __name__ == "__main__":
    main()
