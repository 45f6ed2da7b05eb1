"""Catch CPU/GPU tensor mix-ups on a machine without a GPU.

Inside `on_gpu()` without a GPU, tensors "placed on cuda" stay in CPU memory but carry a mark, and report
`device` cuda:0: the weights of the modules it is given, tensors made with device="cuda"
or moved there with .to()/.cuda(), and every result computed from a marked tensor. An operation that
CUDA would refuse because it mixes devices (a marked tensor with an unmarked one that is not a 0-dim
CPU scalar) raises DeviceMixError naming the operation, as torch would raise on a real GPU. Transfers
(.to, .cpu, .cuda, copy_) and indexing a marked tensor with CPU indices are allowed, as on a GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

MARK = "_virtual_cuda"
CUDA = torch.device("cuda", 0)
TRANSFERS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__}  # GPU data read on the host: a wait for the GPU
CROSS_DEVICE_OK = HOST_READS | {torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.__repr__,
                                torch.Tensor.__format__, torch.Tensor.__len__, torch._has_compatible_shallow_copy_type}
LIKE = {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like,
        torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
        torch.Tensor.new_empty, torch.Tensor.new_tensor}


class DeviceMixError(RuntimeError):
    pass


def is_marked(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, MARK, False)


def _mark(out, on: bool):
    if isinstance(out, torch.Tensor):
        if is_marked(out) != on:
            setattr(out, MARK, on)
    elif isinstance(out, (tuple, list)):
        for o in out:
            _mark(o, on)
    return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _is_cuda(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


def _target_device(args, kwargs):
    """The device a .to(...) call asks for: 'cuda', 'cpu', or None (a dtype-only call)."""
    for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
        if isinstance(a, torch.Tensor):
            return "cuda" if is_marked(a) else "cpu"
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type
    return None



class _VirtualCuda(TorchFunctionMode):
    virtual = True

    """Counts too: `ops`, operations computed on the GPU (an upper bound on kernel launches: views count), and
    `host_reads`, copies of GPU data to the host, each a wait for the GPU to finish (.cpu(), .item(), ...)."""

    def __init__(self):
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in HOST_READS and is_marked(args[0]):
            self.host_reads += 1
        descriptor = getattr(func, "__self__", None)
        if descriptor is torch.Tensor.device:
            return CUDA if is_marked(args[0]) else func(*args, **kwargs)
        if descriptor is torch.Tensor.is_cuda:
            return is_marked(args[0])
        if descriptor is torch.Tensor.data:  # Module.to() swaps a parameter's data: the parameter moves with it
            out = func(*args, **kwargs)
            _mark(args[0] if func.__name__ == "__set__" else out, is_marked(args[-1] if func.__name__ == "__set__"
                                                                             else args[0]))
            return out
        if func in TRANSFERS:
            out = self._transfer(func, args, kwargs)
            self.host_reads += is_marked(args[0]) and not is_marked(out)
            return out
        if func is torch._C._nn._parse_to:  # Module.to() reading its arguments: the device stays as asked
            return func(*args, **kwargs)
        if func is torch.Tensor.numpy and is_marked(args[0]):
            raise DeviceMixError("numpy() of a CUDA tensor: call .cpu() first")
        wants_cuda = _is_cuda(kwargs.get("device"))
        if wants_cuda:
            kwargs["device"] = "cpu"
        self._check_generator(func, kwargs.get("generator"), wants_cuda or any(is_marked(t) for t in _tensors(args)))
        if func in LIKE and "device" not in kwargs:
            return _mark(func(*args, **kwargs), is_marked(args[0]))
        if func not in CROSS_DEVICE_OK:
            self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        if func not in CROSS_DEVICE_OK and (wants_cuda or any(is_marked(t) for t in _tensors((args, kwargs)))):
            _mark(out, True)
            self.ops += any(True for _ in _tensors(out))  # not attribute reads (.shape, .dtype)
        return out

    @staticmethod
    def _check_generator(func, generator, on_cuda: bool):
        if generator is not None and getattr(generator, "virtual_cuda", False) != on_cuda:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            raise DeviceMixError(f"{name} on {'cuda' if on_cuda else 'cpu'} with a generator on "
                                 f"{'cpu' if on_cuda else 'cuda'}")

    @staticmethod
    def _transfer(func, args, kwargs):
        to = {torch.Tensor.cpu: "cpu", torch.Tensor.cuda: "cuda"}.get(func) or _target_device(args, kwargs)
        if to == "cuda":
            kwargs.pop("device", None)
            args = tuple(a for a in args if not isinstance(a, (str, torch.device)))
            rest = [a for a in args[1:] if isinstance(a, torch.dtype)]  # not non_blocking: meaningless here
            out = args[0].to(*rest, **kwargs) if func is torch.Tensor.to and (rest or kwargs) else args[0]
        elif to == "cpu":
            out = func(*args, **kwargs)
        else:
            return _mark(func(*args, **kwargs), is_marked(args[0]))
        if is_marked(out) != (to == "cuda"):
            out = out.clone() if out is args[0] else out  # a real move makes a new tensor
        return _mark(out, to == "cuda")

    @staticmethod
    def _check(func, args, kwargs):
        tensors = list(_tensors((args, kwargs)))
        marked = [t for t in tensors if is_marked(t)]
        if not marked:
            return
        indexing = func in (torch.Tensor.__getitem__, torch.Tensor.index_select) and is_marked(args[0])
        cpu = [t for t in tensors if not is_marked(t) and t.dim() > 0 and not indexing]
        if cpu:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            raise DeviceMixError(f"{name} mixes CUDA tensors {[tuple(t.shape) for t in marked][:3]} with CPU "
                                 f"tensors {[tuple(t.shape) for t in cpu][:3]}")


def _place(modules, on: bool) -> None:
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            _mark(t, on)


class RealGpu:
    """What `on_gpu` yields on a machine with a GPU: nothing emulated, nothing counted."""
    virtual = False
    ops = host_reads = None


@contextlib.contextmanager
def on_gpu(monkeypatch, *modules: torch.nn.Module):
    """Run the block with `modules` on a GPU: the real one when torch sees one (`scripts/gpu_check.sh` runs these
    tests there), else the virtual one, with torch.Generator(cuda) and torch.cuda.synchronize standing in for the
    real ones. The modules are back on the CPU afterwards, for the tests that share them."""
    if torch.cuda.is_available():
        try:
            for module in modules:
                module.to("cuda")
            yield RealGpu()
        finally:
            for module in modules:
                module.to("cpu")
        return

    class Generator(torch.Generator):  # a CPU generator that remembers which device it was made for
        def __new__(cls, device="cpu"):
            generator = super().__new__(cls, "cpu")
            generator.virtual_cuda = torch.device(device).type == "cuda"
            return generator

        def __init__(self, device="cpu"):
            pass

    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    _place(modules, True)
    try:
        with _VirtualCuda() as mode:
            yield mode
    finally:
        _place(modules, False)
